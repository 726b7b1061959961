"""Grammar state for structured output (guided decoding), compiled and run by llguidance.

A constrained request's grammar state (its ``llguidance.LLMatcher``) lives in
``StructuredDecoder.registry``, keyed by request id; the Request itself holds none. Invariants:

- The matcher has consumed exactly the request's output tokens. Preemption keeps the output
  tokens (recompute replays them as prompt), so the matcher needs no change to survive it.
- Each step, the masks of the constrained requests that sample are computed before the forward
  is launched; where the forward runs on an accelerator (``overlap``) they are computed on a worker
  thread while it runs (both release the GIL). The sampler applies them as bitmasks.
- A batch without constrained requests costs one dict-emptiness check per step.
- A lazy constraint (tool calls under ``tool_choice=auto``) lets free text through unmasked: its
  grammar only checks each sampled token, and masks are computed from the moment the trigger
  (the start of a tool call) may be forming. A checked token the grammar refuses is re-sampled
  under the mask, so the output always stays inside the grammar.
- Where an ``open_end`` grammar may end, the model samples unmasked and a refused token becomes
  the end of the output; an ``end_on_repeat`` grammar whose last unit repeats an earlier one puts
  its request id in ``ended`` and the engine finishes it with "stop" (rules: grammar_state.py).
- ``release`` is called when the request finishes or is aborted; the registry is then empty
  when no request is live.
- A grammar that fails while decoding (the matcher's limits, e.g. too many alternatives in a row)
  never ends its request as if the output were complete: the request id lands in ``failed`` with
  the matcher's error, and the engine aborts the request with it.
- Grammars are compiled and tried by ``grammar_compile.GrammarCompiler`` (kept by content, failures
  included, budgets, a short walk that refuses constraints breaking their limits up front); each request
  gets a copy of the compiled matcher, so n choices or repeated requests with one schema compile it once.
- Rows whose matchers are in the same state (the same grammar after the same tokens: the n choices of a
  request at their first token, or greedy ones all along) share one mask computation per step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from sidecar.engine.grammar_compile import GrammarCompiler, grammar_for
from sidecar.engine.grammar_state import GrammarState
from sidecar.engine.sampling_rng import SALT_REDRAW

__all__ = ["Constraint", "StructuredDecoder", "apply_bitmask", "grammar_for", "to_constraint"]

MAX_CHOICES = 1024


@dataclass(frozen=True)
class Constraint:
    """A normalized output constraint. ``kind`` is json | json_object | regex | choice | lark."""

    kind: str
    value: Any = None
    strict: bool = False
    lazy_trigger: Optional[str] = None  # lark only: unconstrained until this text may start
    open_end: bool = False  # where the grammar may end, a token it refuses ends the output (grammar_state.py)
    end_on_repeat: bool = False  # a unit (e.g. a tool call) equal to an earlier one ends the output
    # The request field it came from (e.g. "guided_json", "tools"), for errors; not part of its identity.
    origin: str = field(default="", compare=False)

    def key(self) -> str:
        """Canonical text for cache keys: equal constraints give equal keys. Computed once per object (a
        schema's text can be 100,000 characters; the event loop and the engine thread both ask for it)."""
        k = self.__dict__.get("_key")
        if k is None:
            k = json.dumps(
                [self.kind, self.value, self.strict, self.lazy_trigger, self.open_end, self.end_on_repeat],
                sort_keys=True,
                separators=(",", ":"),
                ensure_ascii=False,
            )
            object.__setattr__(self, "_key", k)
        return k

    def with_origin(self, origin: str) -> "Constraint":
        """This constraint marked with the request field it came from (its key carried over)."""
        c = dataclasses.replace(self, origin=origin)
        object.__setattr__(c, "_key", self.key())
        return c


def to_constraint(value: Any) -> Optional[Constraint]:
    """SamplingParams.structured -> Constraint. A dict is a JSON schema, a list of strings a choice,
    a string a regex. Raises ValueError naming ``structured``."""
    if value is None or isinstance(value, Constraint):
        if isinstance(value, Constraint) and value.kind not in (
            "json",
            "json_object",
            "regex",
            "choice",
            "lark",
        ):
            raise ValueError(f"structured: unknown constraint kind {value.kind!r}")
        return value
    if isinstance(value, dict):
        return Constraint("json", value)
    if isinstance(value, str):
        if not value:
            raise ValueError("structured: a regex must not be empty")
        return Constraint("regex", value)
    if isinstance(value, (list, tuple)):
        if not value or len(value) > MAX_CHOICES:
            raise ValueError(f"structured: a choice list needs 1 to {MAX_CHOICES} strings, got {len(value)}")
        if not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured: choices must be non-empty strings")
        return Constraint("choice", list(value))
    raise ValueError(
        "structured: must be a JSON schema (dict), a regex (str) or a choice list (list of str), "
        f"got {type(value).__name__}"
    )


class StructuredDecoder:
    """Compiles constraints, owns the per-request grammar state, produces masks each step."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], overlap: bool = True
    ) -> None:
        self.hf_tokenizer = tokenizer
        self.overlap = overlap  # masks on a worker thread during the forward; else computed before it
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.registry: dict[str, GrammarState] = {}
        self.failed: dict[str, str] = {}  # request id -> the error of a grammar that failed while decoding
        self.compiler = GrammarCompiler(self._tokenizer, vocab_size, self.eos_token_ids)
        self.ended: set[str] = set()  # request ids whose output ends at their last token (a repeated unit)
        self._lltok: Any = None
        self._executor: Any = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self.num_masks = 0  # masks computed (counter for stats/benchmarks)
        self.num_resampled = (
            0  # unmasked tokens refused by the grammar: re-sampled under the mask, or the end
        )
        self.mask_s = 0.0  # time spent computing masks (on the worker: overlapped with the forward)
        self.wait_s = 0.0  # time the engine thread waited for masks after the forward

    def counters(self) -> dict[str, float]:
        return {
            "structured_masks": self.num_masks,
            "structured_resampled": self.num_resampled,
            "structured_mask_s": self.mask_s,
            "structured_mask_wait_s": self.wait_s,
        }

    def prepare(self) -> None:
        """Build the grammar tokenizer now (a server does before it serves): building the vocabulary trie
        holds the GIL throughout, which under a first grammar request would stall every other thread."""
        try:
            self._tokenizer()
        except Exception:  # a tokenizer llguidance cannot use: each constrained request is refused with why
            pass

    def _tokenizer(self) -> Any:
        # Built on first use (or by prepare): the vocabulary trie is costly for large vocabularies.
        with self._lock:
            if self._lltok is None:
                import llguidance
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
                self._executor = llguidance.LLExecutor(max(1, min(4, (os.cpu_count() or 2) // 2)))
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="sidecar-mask")
            return self._lltok

    def compiled(self, c: Constraint) -> Any:
        """The compiled, unused matcher of ``c`` (``GrammarCompiler.compiled``). Safe from any thread: AsyncEngine
        calls it from its grammar thread before handing the request to the engine thread, so a large grammar
        compiles while the engine keeps stepping. Raises ValueError naming ``structured``."""
        return self.compiler.compiled(c)

    def attach(self, request_id: str, c: Optional[Constraint]) -> Optional[GrammarState]:
        """Give a new request its own copy of ``c``'s compiled grammar. Raises ValueError naming ``structured``."""
        if c is None:
            return None
        g = GrammarState(self.compiled(c).deep_copy(), c.lazy_trigger, c.open_end, c.end_on_repeat, c.key())
        self.registry[request_id] = g
        return g

    def release(self, request_id: str) -> None:
        self.registry.pop(request_id, None)
        self.failed.pop(request_id, None)
        self.ended.discard(request_id)

    # -- per step ----------------------------------------------------------------------------------
    def start_masks(
        self, request_ids: Sequence[str]
    ) -> Optional[tuple[dict[str, int], torch.Tensor, Future]]:
        """Begin computing the masks of the given sampling requests that need one; None when none does.
        With ``overlap`` it runs on a worker thread, overlapping the forward pass."""
        if not self.registry:
            return None
        rows: dict[str, int] = {}  # request id -> its mask's row; requests in one state share a row
        first: dict[int, tuple[Any, int]] = {}  # state -> (the matcher computing it, its row)
        for rid in request_ids:
            g = self.registry.get(rid)
            if g is not None and g.needs_mask():
                if g.state not in first:
                    first[g.state] = (g.matcher, len(first))
                rows[rid] = first[g.state][1]
        if not rows:
            return None
        bitmask = torch.empty(
            (len(first), (self.vocab_size + 31) // 32), dtype=torch.int32
        )  # fill writes every word
        pairs = list(first.values())
        self.num_masks += len(pairs)
        if self.overlap:
            fut = self._pool.submit(self._fill, pairs, bitmask)
        else:
            fut = Future()
            self._fill(pairs, bitmask)
            fut.set_result(None)
        return rows, bitmask, fut

    def _fill(self, pairs: list, bitmask: torch.Tensor) -> None:
        t = time.perf_counter()
        row_bytes = bitmask.shape[1] * 4
        if self.overlap:  # spread over the executor's threads
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        else:  # in this thread: no hand-off to threads that would compete with the forward for the cores
            for m, i in pairs:
                m.unsafe_compute_mask_ptr(bitmask.data_ptr() + i * row_bytes, row_bytes)
        self.mask_s += time.perf_counter() - t
        # A matcher in an error state allows nothing; let it end the request instead of sampling garbage.
        for row in [i for m, i in pairs if m.is_error()]:
            self._allow_eos(bitmask, row)

    def _allow_eos(self, bitmask: torch.Tensor, row: int) -> None:
        for e in self.eos_token_ids:
            bit = 1 << (e % 32)
            bitmask[row, e // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words

    def sample(self, sampler: Callable, logits: torch.Tensor, reqs: list, pending: Any) -> tuple[list, list]:
        """Sample with the masks from ``start_masks`` applied, then advance every grammar with its token."""
        if not self.registry:
            return sampler(logits, reqs)
        masks = None
        if pending is not None:
            rows, bitmask, fut = pending
            t = time.perf_counter()
            fut.result()
            self.wait_s += time.perf_counter() - t
            idx = [i for i, r in enumerate(reqs) if r.request_id in rows]
            if idx:
                masks = (idx, bitmask[[rows[reqs[i].request_id] for i in idx]])
        lazy = [
            i
            for i, r in enumerate(reqs)
            if r.request_id in self.registry and (masks is None or i not in masks[0])
        ]
        saved = logits[lazy].clone() if lazy else None  # unmasked rows, kept for a re-sample
        ids, lps = sampler(logits, reqs, masks)
        refused = [
            j
            for j, i in enumerate(lazy)
            if self.registry[reqs[i].request_id].matcher.validate_tokens([ids[i]]) != 1
        ]
        if refused:
            sub = [reqs[lazy[j]] for j in refused]
            bm = torch.zeros((len(sub), (self.vocab_size + 31) // 32), dtype=torch.int32)
            self._fill([(self.registry[r.request_id].matcher, k) for k, r in enumerate(sub)], bm)
            for k, r in enumerate(sub):  # refused where the grammar may end and the model decides: the end
                if self.registry[r.request_id].open_here():
                    bm[k].zero_()
                    self._allow_eos(bm, k)
            self.num_masks += len(sub)
            self.num_resampled += len(sub)
            # An independent draw (another salt): reusing the refused draw's noise would bias the re-draw.
            ids2, lps2 = sampler(saved[refused], sub, (list(range(len(sub))), bm), salt=SALT_REDRAW)
            for j, t, lp in zip(refused, ids2, lps2):
                ids[lazy[j]], lps[lazy[j]] = t, lp
        for r, t in zip(reqs, ids):
            g = self.registry.get(r.request_id)
            if g is not None:
                g.matcher.consume_token(t)
                g.state = hash((g.state, t))
                if g.matcher.is_error():
                    self.failed[r.request_id] = g.matcher.get_error()[:500]
                if not g.triggered or g.units is not None:
                    g.advance(self._lltok.decode_bytes([t]))
                    if g.ended:
                        self.ended.add(r.request_id)
        return ids, lps


_BITS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: set logits[rows[k], v] to -inf where bit v of bitmask[k] is 0."""
    dev = logits.device
    bits = _BITS.get(dev)
    if bits is None:
        bits = _BITS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    v = logits.shape[-1]
    refused = ((bitmask.to(dev, non_blocking=True).unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, :v] == 0
    if len(rows) == logits.shape[0]:  # rows are 0..B-1 in order (the whole batch is constrained)
        logits.masked_fill_(refused, float("-inf"))
    else:
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        logits[idx] = logits[idx].masked_fill_(refused, float("-inf"))
