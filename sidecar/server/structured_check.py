"""Early validation of output constraints, so a bad schema is refused with the wire field's name.

Compiling without the tokenizer checks the grammar itself (syntax, unsupported schema features in
strict mode); the engine compiles it again against the vocabulary when the request is added.
"""
from __future__ import annotations

from typing import Optional

from sidecar.engine.structured import Constraint, grammar_for
from sidecar.server.validation import invalid


def check_constraint(c: Optional[Constraint], field: str) -> Optional[Constraint]:
    """Return ``c`` unchanged, or raise ServiceError (invalid_argument) naming ``field``."""
    if c is None:
        return None
    from llguidance import LLMatcher

    try:
        grammar = grammar_for(c)
    except ValueError as exc:
        raise invalid(field, str(exc).removeprefix("structured: ")) from None
    err = LLMatcher.validate_grammar(grammar)
    if err and not err.startswith("WARNING"):
        raise invalid(field, err.splitlines()[0][:500])
    return c
