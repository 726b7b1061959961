"""One constrained request's grammar state: its matcher, its lazy trigger and its end rules.

Two end rules, each a flag of the request's ``Constraint``; tool-call grammars turn them on:

- ``open_end``: where the grammar may end (the matcher accepts), no mask is applied; the model's
  own sample decides, and a token the grammar refuses there ends the output (the end-of-sequence
  token takes its place) instead of being re-drawn under the mask. Masking there would turn a token
  the model meant for something else (a newline before prose) into a commitment to go on, e.g. to
  start another tool call it never chose.
- ``end_on_repeat``: a *unit* is the output from the token that leaves an accepting state to the
  token that reaches one again (one tool call; a separator between accepting states belongs to no
  unit). When a unit's text, without surrounding whitespace, equals an earlier unit's, the output
  ends right after it (``ended``); the reader of the output drops the repeat. The grammar fixes the
  formatting (separators, property order), so an identical value is identical text.
"""

from __future__ import annotations

from typing import Any, Optional


class GrammarState:
    """A request's matcher plus the state of its lazy trigger and end rules."""

    __slots__ = ("matcher", "state", "trigger", "triggered", "tail", "open_end", "units", "unit", "ended")

    def __init__(
        self,
        matcher: Any,
        trigger: Optional[str],
        open_end: bool = False,
        end_on_repeat: bool = False,
        key: str = "",
    ) -> None:
        self.matcher = matcher
        self.state = hash(key)  # a digest of (grammar, tokens consumed): equal states have equal masks
        self.trigger = trigger
        self.triggered = trigger is None
        self.tail = ""  # last generated characters, enough to see a trigger forming
        self.open_end = open_end
        self.units: Optional[set[bytes]] = set() if end_on_repeat else None  # completed units
        self.unit: Optional[bytes] = None if matcher.is_accepting() else b""  # the unit being written
        self.ended = False  # a unit repeated an earlier one: the output ends here

    def open_here(self) -> bool:
        """True where the model's unmasked sample decides (the grammar may end and ``open_end`` is on)."""
        return self.open_end and self.triggered and self.matcher.is_accepting()

    def needs_mask(self) -> bool:
        if self.open_here():
            return False
        if self.triggered:
            return True
        # Mask as soon as the text ends with a proper prefix of the trigger: the next token could
        # complete the trigger and must then continue a valid call.
        t = self.trigger
        return any(self.tail.endswith(t[:k]) for k in range(1, len(t)))

    def advance(self, token_bytes: bytes) -> None:
        """Account for a token the matcher has just consumed."""
        if not self.triggered:
            self.tail = (self.tail + token_bytes.decode("utf-8", "replace"))[-2 * len(self.trigger) :]
            self.triggered = self.trigger in self.tail
        if self.units is None or self.matcher.is_error():
            return
        accepting = self.matcher.is_accepting()
        if self.unit is None:
            if not accepting:  # this token leaves an accepting state: a unit begins with it
                self.unit = token_bytes
            return
        self.unit += token_bytes
        if accepting:
            done, self.unit = self.unit.strip(), None
            if done in self.units:
                self.ended = True
            self.units.add(done)
