"""Incremental detokenization: UTF-8 safe deltas and stop strings.

Byte-level tokenizers can split one character across tokens. We decode a
small window of recent tokens and only commit text once it no longer ends in
the replacement character, so a delta never carries half a character.
Stop strings are searched in the committed text; while a request runs, the
last ``len(longest stop) - 1`` characters are held back so a stop string that
is still being written never leaks into a streamed delta.
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


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: TextSettings) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = list(params.stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.stopped_by: Optional[str] = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> Optional[str]:
        """Append one token; returns the stop string if the text now contains one
        (the text is cut before it)."""
        if self.stopped_by is not None:
            return self.stopped_by
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        pending = len(self.ids) - self.read_offset
        # A UTF-8 character spans at most 4 bytes, so more pending tokens than that ending in U+FFFD
        # are invalid bytes, not a character still being written: commit them rather than wait forever.
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and pending <= MAX_PENDING_TOKENS):
            return None  # an incomplete character (or nothing printable) so far
        before = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if self.stop:
            start = max(0, before - self.holdback)
            best = None
            for s in self.stop:
                idx = self.text.find(s, start)
                if idx != -1 and (best is None or idx < best[0]):
                    best = (idx, s)
            if best is not None:
                self.text = self.text[:best[0]]
                self.stopped_by = best[1]
        return self.stopped_by

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: everything once finished, else minus the stop-string holdback."""
        if finished or self.holdback == 0:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
