"""Early validation of output constraints, so a bad schema is refused with the wire field's name.

Compiling without the tokenizer checks the grammar itself (syntax, unsupported schema features in
strict mode); the engine compiles it again against the vocabulary when the request is added (once per
distinct grammar: it keeps compiled grammars by content). Three rules keep this off everyone else's
path:

- callers run it in a worker thread, never on the event loop (``asyncio.to_thread`` in the transports
  and in the service's admission step);
- a constraint's canonical text is at most ``MAX_CONSTRAINT_CHARS``; larger is refused before any
  compiling (grammar work grows with it, and no answer format needs more);
- verdicts are remembered by content (bounded LRU), so the n choices of one request, and repeated
  requests with the same schema, compile it once.

What only the vocabulary shows (the matcher's limits on the first tokens, the compile and mask budgets) is
found when the service has the engine compile the constraint, before the request is admitted; the
constraint's ``origin`` (set here) names the field in that refusal.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

from sidecar.engine.structured import Constraint, grammar_for
from sidecar.server.validation import invalid

MAX_CONSTRAINT_CHARS = 100_000
_CACHE_SIZE = 256
_verdicts: "OrderedDict[str, str]" = OrderedDict()  # constraint key -> "" (valid) or the error
_lock = threading.Lock()


def _verdict(c: Constraint) -> str:
    from llguidance import LLMatcher

    try:
        grammar = grammar_for(c)
    except ValueError as exc:
        return str(exc).removeprefix("structured: ")
    err = LLMatcher.validate_grammar(grammar)
    return err.splitlines()[0][:500] if err and not err.startswith("WARNING") else ""


def check_constraint(c: Optional[Constraint], field: str) -> Optional[Constraint]:
    """Return ``c`` marked with ``field`` as its origin (the engine's later refusals name it), or raise
    ServiceError (invalid_argument) naming ``field``. Blocks for as long as compiling takes: call it from
    a worker thread."""
    if c is None:
        return None
    key = c.key()
    if len(key) > MAX_CONSTRAINT_CHARS:
        raise invalid(
            field, f"too large: {len(key)} characters of schema or grammar, at most {MAX_CONSTRAINT_CHARS}"
        )
    with _lock:
        err = _verdicts.get(key)
        if err is not None:
            _verdicts.move_to_end(key)
    if err is None:
        err = _verdict(c)
        with _lock:
            _verdicts[key] = err
            while len(_verdicts) > _CACHE_SIZE:
                _verdicts.popitem(last=False)
    if err:
        raise invalid(field, err)
    return c.with_origin(field)
