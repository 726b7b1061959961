"""Incremental detokenization: UTF-8 safe deltas and stop strings.

Byte-level tokenizers can split one character across tokens. We decode a
small window of recent tokens and only commit text once it no longer ends in
the replacement character, so a delta never carries half a character.
Stop strings are matched in the committed text as it grows, each by a KMP automaton
(``_StopMatcher``), so the work per token is its new characters, whatever the stop strings' length.
While a request runs, only the text that could still become a stop match is held back -- the longest
end of the text that begins some stop string -- so a stop string that is still being written never
leaks into a streamed delta, and a long stop string does not turn a stream into one chunk at the end.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

MAX_PENDING_TOKENS = 4


class TextSettings(Protocol):
    """What detokenizing reads of a request's SamplingParams (a Request holds its detokenizer, so this
    module does not import request.py)."""

    @property
    def skip_special_tokens(self) -> bool: ...

    @property
    def stop(self) -> Sequence[str]: ...


class _StopMatcher:
    """One stop string's KMP automaton. ``state`` is the length of the longest prefix of the stop string
    that ends the text fed so far (the whole string: a match)."""

    __slots__ = ("stop", "fail", "state")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.fail = [0] * len(stop)  # fail[i]: longest proper border of stop[:i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k
        self.state = 0

    def feed(self, text: str) -> int:
        """Advance over ``text``; returns the index in ``text`` just past the first match, or -1."""
        s, k = self.stop, self.state
        for i, ch in enumerate(text):
            while k and ch != s[k]:
                k = self.fail[k - 1]
            if ch == s[k]:
                k += 1
            if k == len(s):
                self.state = k
                return i + 1
        self.state = k
        return -1


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: TextSettings) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = list(params.stop)
        self._matchers = [_StopMatcher(s) for s in self.stop if s]
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.stopped_by: Optional[str] = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False
        )

    def add_token(self, token_id: int) -> Optional[str]:
        """Append one token; returns the stop string if the text now contains one
        (the text is cut before it)."""
        if self.stopped_by is not None:
            return self.stopped_by
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        pending = len(self.ids) - self.read_offset
        # A UTF-8 character spans at most 4 bytes, so more pending tokens than that ending in U+FFFD
        # are invalid bytes, not a character still being written: commit them rather than wait forever.
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and pending <= MAX_PENDING_TOKENS):
            return None  # an incomplete character (or nothing printable) so far
        before = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        new = self.text[before:]
        best = None  # (start of the earliest match in self.text, its stop string)
        for m in self._matchers:
            end = m.feed(new)
            if end != -1:
                start = before + end - len(m.stop)
                if best is None or start < best[0]:
                    best = (start, m.stop)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stopped_by = best[1]
        return self.stopped_by

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: everything once finished, else minus its end that may still grow into a
        stop string."""
        held = (
            0
            if finished or self.stopped_by is not None
            else max((m.state for m in self._matchers), default=0)
        )
        return self.text[: len(self.text) - held] if held else self.text
