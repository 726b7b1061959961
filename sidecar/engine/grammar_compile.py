"""Compiling output constraints into llguidance matchers: once per distinct constraint, within budgets,
with the grammar's own limits tried before any request decodes under it.

Invariants:
- ``GrammarCompiler.compiled`` is the only place a matcher is built. Results are kept by the constraint's
  canonical text (bounded LRU, ``COMPILED_CACHE_SIZE``), failures included: the n choices of a request,
  and repeated requests with the same constraint, compile it once and are refused at once when it failed.
- A compiled grammar is tried before it is handed out: its first masks are computed along a short walk
  (``PROBE_TOKENS`` tokens, each the lowest allowed token id that is not end-of-sequence, plus the tokens
  the grammar forces, e.g. a tool call's fixed opening, seen as masks with one token). A matcher
  breaks its limits (too many lexer expressions, too many items in a parser row) on the first tokens of
  the structure it explodes on, so those constraints are refused up front instead of failing mid-decode.
  What still breaks later is reported by ``StructuredDecoder`` while decoding (the request ends with the
  error, never as a complete answer).
- Budgets are measured in CPU time of the compiling thread (llguidance compiles and computes masks in
  the calling thread), so a loaded machine does not turn a valid grammar into a refused one: compiling
  plus the first mask at most ``COMPILE_BUDGET_S``, any one mask of the walk at most ``MASK_BUDGET_S``
  (a grammar whose masks cost more would slow every step of every request batched with it).
- Only llguidance calls that release the GIL are used here (building, masks, consuming tokens); not
  ``compute_ff_tokens``, which holds it for as long as the forced text takes (long on ``(x{1000}){1000}``).
- Compiling never runs on the event loop nor on the engine's step thread: ``AsyncEngine`` calls
  ``compiled`` from its grammar thread, which runs at a lower OS priority than the step loop and the
  servers (``lower_thread_priority``), so it takes only CPU they leave.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

COMPILED_CACHE_SIZE = 64
PROBE_TOKENS = 16
PROBE_FORCED_TOKENS = 64  # tokens the grammar forces (fixed text) are taken on top, up to this many
COMPILE_BUDGET_S = 5.0
MASK_BUDGET_S = 0.25
GRAMMAR_THREAD_NICE = 10


def lower_thread_priority(nice: int = GRAMMAR_THREAD_NICE) -> None:
    """Lower the calling thread's CPU priority (Linux: a thread id is a process id to setpriority; elsewhere
    nothing). Used as the grammar thread's initializer."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def _lark_literal(s: str) -> str:
    import json

    return json.dumps(s)  # a JSON string literal is a valid lark string literal


def grammar_for(c: Any) -> str:
    """The llguidance grammar text of a constraint (``structured.Constraint``)."""
    from llguidance import LLMatcher

    if c.kind in ("json", "json_object"):
        schema = c.value if c.kind == "json" else {"type": "object"}
        # Compact separators keep the output bounded; lenient (non-strict) ignores keywords the
        # grammar cannot enforce instead of rejecting the schema.
        opts = {
            "whitespace_flexible": False,
            "item_separator": ", ",
            "key_separator": ": ",
            "lenient": not c.strict,
        }
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=opts)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"structured: invalid JSON schema: {exc}") from None
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.value)
    if c.kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_literal(x) for x in c.value))
    return LLMatcher.grammar_from_lark(c.value)


def _first_error_line(err: str) -> str:
    return err.split("\n<state>", 1)[0].splitlines()[0][:300] if err else "unknown error"


class GrammarCompiler:
    """Builds, tries and keeps compiled matchers. ``tokenizer`` returns the llguidance tokenizer (built on
    first use); ``eos_token_ids`` are left out of the walk's choices."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._cache: "OrderedDict[str, Any]" = OrderedDict()  # constraint key -> unused matcher, or the error
        self._lock = threading.Lock()
        self.num_compiled = 0  # constraints compiled (cache misses), for stats and tests

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def compiled(self, c: Any) -> Any:
        """The compiled, unused matcher of constraint ``c``; compiles and tries it on a miss. Safe from any
        thread; blocks while compiling. Raises ValueError("structured: ...") when the grammar is invalid,
        cannot be enforced, or breaks a budget."""
        key = c.key()
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
        if found is None:
            found = self._build(c)
            with self._lock:
                self._cache[key] = found
                while len(self._cache) > COMPILED_CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(found, str):
            raise ValueError(f"structured: {found}")
        return found

    def _build(self, c: Any) -> Any:
        """A tried matcher, or the error text (without the ``structured: `` prefix)."""
        from llguidance import LLMatcher

        try:
            grammar = grammar_for(c)
        except ValueError as exc:
            return str(exc).removeprefix("structured: ")
        try:
            lltok = self._tokenizer()
        except ValueError as exc:  # e.g. a slow (non-Rust) tokenizer
            return f"not available for this model's tokenizer: {exc}"
        self.num_compiled += 1
        t = time.thread_time()
        matcher = LLMatcher(lltok, grammar, log_level=0)  # drops the GIL while it builds
        if matcher.is_error():
            return _first_error_line(matcher.get_error())
        first = matcher.compute_bitmask()
        spent = time.thread_time() - t
        if matcher.is_error():
            return f"cannot be enforced: {_first_error_line(matcher.get_error())}"
        if spent > COMPILE_BUDGET_S:
            return (
                f"too complex: compiling it took {spent:.1f} s of CPU, the budget is {COMPILE_BUDGET_S:.0f} s; "
                "use fewer alternatives or shorter repetitions"
            )
        return self._walk(matcher, first) or matcher

    def _walk(self, matcher: Any, first: bytes) -> Optional[str]:
        """Try the first tokens on a copy of ``matcher``; the error text when it breaks or a mask is over budget."""
        import numpy as np

        m, mask, steps, forced = matcher.deep_copy(), first, 0, 0
        while steps < PROBE_TOKENS:
            words = np.frombuffer(mask, dtype=np.uint32).copy()
            for e in self.eos_token_ids:
                if e // 32 < len(words):
                    words[e // 32] &= ~np.uint32(1 << (e % 32))
            nz = np.flatnonzero(words)
            if not len(nz):
                return None  # only the end is allowed: nothing further to try
            if len(nz) == 1 and int(words[nz[0]]).bit_count() == 1 and forced < PROBE_FORCED_TOKENS:
                forced += 1  # a forced token (fixed text): taken on top of the walk's steps
            else:
                steps += 1
            w = int(nz[0])
            token = w * 32 + (int(words[w]) & -int(words[w])).bit_length() - 1
            if token >= self.vocab_size:
                return None
            m.consume_token(token)
            if m.is_error():
                return f"cannot be enforced: {_first_error_line(m.get_error())}"
            if m.is_stopped():
                return None
            t = time.thread_time()
            mask = m.compute_bitmask()
            spent = time.thread_time() - t
            if m.is_error():
                return f"cannot be enforced: {_first_error_line(m.get_error())}"
            if spent > MASK_BUDGET_S:
                return (
                    f"too complex: one token's mask took {spent * 1000:.0f} ms of CPU, the budget is "
                    f"{MASK_BUDGET_S * 1000:.0f} ms"
                )
        return None
