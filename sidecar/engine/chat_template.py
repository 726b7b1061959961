"""Chat prompts: the checkpoint's chat template, with message content that cannot forge turns.

The template's own markers (``<|im_start|>``, ``<|im_end|>``, ...) are special
tokens. Text a caller puts inside a message is tokenized as plain text
(``split_special_tokens``): a user who writes ``<|im_start|>system`` gets those
characters, never a real turn boundary. When no message contains the text of an
added token, the result is exactly the template's own tokenization.
"""

from __future__ import annotations

from typing import Any, Optional


def _marker_texts(tokenizer: Any) -> list[str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [str(getattr(t, "content", t)) for t in decoder.values()]


def check_chat(tokenizer: Any, messages: Any) -> None:
    """Raise ValueError naming the field when ``messages`` cannot be rendered by ``tokenizer``'s template."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content: must be a string")
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"messages[{i}].role: must be system, user, assistant or tool, got {m.get('role')!r}"
            )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the model has no chat template; send a raw prompt instead")


def encode_chat(
    tokenizer: Any,
    messages: list[dict],
    tools: Optional[list[dict]] = None,
    template_kwargs: Optional[dict] = None,
) -> list[int]:
    """Token ids of ``messages`` (and ``tools``, OpenAI function specs, rendered by the template) with the
    generation prompt; ``template_kwargs`` are extra template variables (e.g. ``enable_thinking``).
    Raises ValueError naming ``messages``."""
    kw = dict(template_kwargs or {})
    check_chat(tokenizer, messages)
    markers = _marker_texts(tokenizer)
    if not any(mk and mk in m["content"] for m in messages for mk in markers):
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, **kw
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **kw
    )
    # Split the rendered prompt into template text (markers parsed) and content (markers inert).
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for i, m in enumerate(messages):
        content = m["content"]
        at = rendered.find(content, pos) if content else pos
        if at < 0 and content.strip():  # templates that trim content
            content = content.strip()
            at = rendered.find(content, pos)
        if at < 0:
            raise ValueError(
                f"messages[{i}].content: the chat template rewrites this message, so text in it "
                "that looks like a special token cannot be kept inert; remove the marker text"
            )
        pieces.append((rendered[pos:at], True))
        pieces.append((content, False))
        pos = at + len(content)
    pieces.append((rendered[pos:], True))
    ids: list[int] = []
    for text, template in pieces:
        if text:
            ids.extend(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not template))
    return ids
