"""ModelRunner: SchedulerOutput -> packed tensors -> model -> logits of the sampled positions.

A pure-decode step (every scheduled request has exactly one new token, none verifies proposed tokens)
runs through persistent input buffers (``input_buffers.py``; a hybrid model's state slots too) and, on
CUDA, a captured graph per batch-size bucket (``graphs.py``); steps with prompt chunks or verification rows
run eagerly from tensors built for the step. Which device fast paths the model takes is decided once at
start by the self-check (``self_check.py``) unless ``enforce_eager``.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Union

import torch

from sidecar.config import EngineConfig
from sidecar.engine.cpu_graphs import CpuDecodePlans
from sidecar.engine.graphs import DecodeGraphs, capture_or_none
from sidecar.engine.group_step import attach_groups, group_rows, layer_caches
from sidecar.engine import step_timing
from sidecar.engine.input_buffers import DecodeInputs, DecodeRow, decode_buckets, decode_step, pick_bucket
from sidecar.engine.input_buffers import table_width
from sidecar.engine.kv_budget import plan_kv_budget
from sidecar.engine.kv_cache import KVCacheManager
from sidecar.engine.kv_evict import is_scored
from sidecar.engine.linear_state import LinearStates, groups_of, plan_slots
from sidecar.engine.kv_copy import BlockCopier
from sidecar.engine.kv_scores import SlotScores
from sidecar.engine.kv_zero import PoolZeroing
from sidecar.engine.prompt_logprobs import collect, wants_rows
from sidecar.engine.request import Request
from sidecar.engine.scheduler import SchedulerOutput
from sidecar.model import kv_quant, mla
from sidecar.model.attention import AttentionMetadata, PrefillSegment
from sidecar.model.kernels.gpu_paths import PATH_NAMES, FastPaths
from sidecar.model.loader import LoadedModel

log = logging.getLogger("sidecar.engine")


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        sampler_check: Optional[Callable[[torch.Tensor], Optional[str]]] = None,
    ) -> None:
        self.model = loaded.model
        self.sampler_check = sampler_check  # the device sampler's self-check (None: that path stays off)
        self.device = loaded.device
        # The host is free while an accelerator runs the forward, so host work (grammar masks) can overlap
        # it; on a CPU the forward already uses every core and a second thread only competes with it.
        self.host_overlaps_forward = self.device.type != "cpu"
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.kv_dtype, self.kv_dtype_reason = kv_quant.resolve_kv_dtype(
            config.kv_cache_dtype, self.device, self.dtype
        )
        mla.check_kv_dtype(loaded.args, self.kv_dtype, self.dtype)
        self.kv_budget = plan_kv_budget(config, loaded, self.kv_dtype)  # a smaller element holds more tokens
        self.num_blocks = self.kv_budget.num_blocks
        a = self.model.args  # a tensor-parallel rank's own KV heads
        self.kv_plan = self.kv_budget.plan  # KV groups (kv_groups.py): layers of one kind share tensors
        self.kv_caches = layer_caches(a, self.kv_budget, self.block_size, self.kv_dtype, self.device)
        # the whole model's linear layers: a pipeline stage 0 without any still decides every stage's slots
        w = loaded.args
        slots = plan_slots(w, self.dtype, config.max_num_seqs, self.kv_budget.bytes) if w.linear_layers else 0
        ckpts = slots if config.enable_prefix_caching else 0  # prefix-cache states: the slots' bytes again
        self.states = LinearStates(a, slots, self.dtype, self.device, ckpts) if slots else None
        # what each layer's mixer reads: KV caches, and a hybrid model's state slots
        self.layer_caches = self.states.layer_caches(a, self.kv_caches) if self.states else self.kv_caches
        self.buffered = True  # pure-decode steps run through the persistent buffers (state slots included)
        self.copier = BlockCopier(self.kv_caches, self.device)  # offload copies (a side stream on CUDA)
        # Attention received per cache slot, for scored KV eviction (kv_scores.py).
        self.slot_scores = SlotScores(self.num_blocks * self.block_size, self.block_size, self.device)
        # Blocks read as zeros until written; committed (kv_cache_commit), the pages are written by a background
        # thread from the pool's end down while lazy zeroing covers the ids in use (kv_zero.py).
        self.zeroing = PoolZeroing(self.kv_caches, self.num_blocks, config.kv_cache_commit)
        self.kv_cache_bytes = self.kv_budget.bytes
        if getattr(self.model, "fast_paths", None) is None:
            self.model.fast_paths = FastPaths()
        self.fast_paths: FastPaths = self.model.fast_paths
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size  # split: CPU replays per group
        split = f"tensor_parallel_size {tp}" if pp == 1 else f"pipeline_parallel_size {pp}"
        self.eager_reason = "enforce_eager" if config.enforce_eager else split
        self.enforce_eager = config.enforce_eager or tp * pp > 1
        self.lora = None  # the engine's LoraManager: which adapter slot each request's tokens use
        self.quantized = bool(loaded.quantization)
        max_len = min(loaded.max_model_len, self.num_blocks * self.block_size)
        group_of = self.kv_plan.group_of() if self.kv_plan is not None else None  # tables of every group
        blocks, state_rows = -(-max_len // self.block_size) + 1, self.states.slots if self.states else 0
        self.inputs = DecodeInputs(
            config.max_num_seqs, blocks, self.block_size, self.device, group_of, state_rows
        )
        self.graphs = DecodeGraphs(self._decode_step, self.device)
        self.cpu_plans = CpuDecodePlans(
            self.model, self.layer_caches, self.inputs, self.states, self.slot_scores.received
        )
        self.set_decode_padding(False)
        if self.device.type == "cuda" or self.enforce_eager:
            self.prepare_fast_paths()
        else:  # on CPU: decode steps replayed from C once a replayed step matches the eager one
            self.cpu_plans.self_check()

    def set_decode_padding(self, padded: bool) -> None:
        """Bucket pure-decode batches (1, 2, 4, 8, 16, ...: what graphs need) or run them at their exact size
        (no padding cost: the default wherever no graphs are captured)."""
        self.buckets = decode_buckets(self.inputs.max_batch, padded)

    def prepare_fast_paths(self, force_check: bool = False) -> None:
        """Decide the device fast paths: all off with ``enforce_eager``; otherwise the self-check turns on each
        path that agrees with the eager reference (on CUDA, or on any device when ``force_check``), then
        decode graphs are captured for every bucket when that path survived. Call before serving."""
        from sidecar.engine import self_check

        self.graphs.clear()
        self.fast_paths.set_all(False)
        self.fast_paths.reasons = {}
        self.set_decode_padding(False)
        if self.enforce_eager:
            for name in PATH_NAMES:
                self.fast_paths.disable(name, self.eager_reason)
            return self.cpu_plans.disable(self.eager_reason)
        if not (self.device.type == "cuda" or force_check):
            return  # on CPU our C kernels are the fast path; the device fields stay off
        self_check.run(self, sampler_check=self.sampler_check)
        self.capture_graphs()

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture one decode graph per bucket when the ``cuda_graphs`` path is on (padded buckets then)."""
        self.graphs.clear()
        self.set_decode_padding(self.fast_paths.cuda_graphs)
        if not self.fast_paths.cuda_graphs:
            return
        reason = capture_or_none(
            self.graphs, self.buckets, lambda b: self.inputs.fill_padding(b, self.inputs.max_blocks)
        )
        if reason is not None:
            log.warning("decode graphs off: %s", reason)
            self.fast_paths.disable("cuda_graphs", reason)
            self.set_decode_padding(False)

    def fast_path_states(self) -> dict[str, bool]:
        """Every device fast path -> whether it is on (the ``sidecar_fast_path_active`` gauge)."""
        return {name: bool(getattr(self.fast_paths, name)) for name in PATH_NAMES}

    def fast_path_info(self) -> dict:
        """``fast_paths``: the active device fast paths; ``fast_path_fallbacks``: path -> why it is off."""
        paths = self.fast_paths
        return {"fast_paths": paths.active(), "fast_path_fallbacks": dict(paths.reasons or {})}

    def _zero_through(self, top: int) -> None:
        self.zeroing.through(top)

    def kv_info(self) -> dict:
        """The KV cache's element type (and why, for a fallback) and its capacity in tokens."""
        return {
            "kv_cache_dtype": kv_quant.kv_dtype_name(self.kv_dtype),
            "kv_cache_dtype_reason": self.kv_dtype_reason,
            "kv_cache_tokens": (self.num_blocks - 1) * self.block_size,
            **(self.states.info() if self.states is not None else {}),
            "cache_groups": groups_of(self),
        }

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block of every layer (values and scales) as host bytes (``kv_quant.read_block``; on CUDA a
        side-stream copy into pinned memory, ``kv_copy``)."""
        return self.copier.read(block_id)

    def write_blocks(self, block_ids: list[int], datas: list[torch.Tensor]) -> None:
        """Fill blocks from ``read_block``'s bytes. Lazy zeroing is brought past them first, so the first
        step that uses a block does not wipe what was loaded."""
        self._zero_through(max(block_ids, default=-1))
        self.copier.write(block_ids, datas)

    def copy_blocks(self, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy-on-write of shared blocks: each ``src`` block's KV (every layer) over its ``dst`` block, queued
        on the compute stream before the step that writes ``dst``; lazy zeroing is brought past ``dst`` first."""
        self._zero_through(max(dst_ids, default=-1))
        kv_quant.copy_blocks(self.kv_caches, src_ids, dst_ids)

    @property
    def kv_scores(self) -> torch.Tensor:
        """Attention received per cache slot (zeros until a scored step writes a slot)."""
        return self.slot_scores.received

    def lowest_blocks(self, block_ids: list[int], now: int, k: int) -> list[int]:
        """``SlotScores.lowest``: the ``k`` least attended of these blocks, for a sequence at ``now``."""
        return self.slot_scores.lowest(block_ids, now, k)

    def tensor(self, data: list[int]) -> torch.Tensor:
        """A long tensor of ``data`` on the model's device."""
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def time_decode_rows(self, rows: Union[int, Sequence[int]], repeats: int = 7) -> Optional[list[float]]:
        """``step_timing.time_decode_rows`` on this runner (None for a hybrid model: its rows need states)."""
        return None if self.states is not None else step_timing.time_decode_rows(self, rows, repeats)

    def _decode_step(self, bucket: int) -> torch.Tensor:
        if self.cpu_plans.replays():
            return self.cpu_plans.run(bucket)
        return decode_step(self.model, self.layer_caches, self.inputs, bucket)

    def fits_decode_buffers(self, n: int, width: int) -> bool:
        return n <= self.inputs.max_batch and width <= self.inputs.max_blocks

    @torch.inference_mode()
    def decode_rows(
        self,
        rows: Sequence[DecodeRow],
        sample: Sequence[int],
        prev_ids: Optional[torch.Tensor] = None,
        scored: bool = False,
    ) -> Optional[torch.Tensor]:
        """One decode step of ``rows`` through the persistent buffers (and a graph where captured); returns
        the logits of rows ``sample`` (in that order), selected on the device, or None when none samples.
        With ``prev_ids`` (a device tensor, e.g. the previous step's sampled ids) each row's ``token`` is an
        index into it and the input id is gathered on the device: the host never needs its value.
        ``scored``: the attention each key receives is added to ``slot_scores`` (scored KV eviction)."""
        bucket = pick_bucket(self.buckets, len(rows))
        # A graph's tables are always max_blocks wide, and so are a CPU replay's.
        fixed = bucket in self.graphs.captured or self.cpu_plans.replays()
        width = self.inputs.max_blocks if fixed else table_width(rows)
        self.inputs.fill(rows, sample, bucket, width)
        if prev_ids is not None:  # stream-ordered after the fill's copy and before the forward reads it
            ids = self.inputs.ids[: len(rows)]
            ids.copy_(prev_ids.index_select(0, ids))
        # A scored step adds received attention to the slot scores (the slots it writes reset first): the CPU
        # replays hold a plan of that form; a captured graph holds the unscored step only, so it runs eagerly.
        self.inputs.scores = self.slot_scores.for_step(*self.inputs.written(bucket)) if scored else None
        hidden = self._decode_step(bucket) if scored else self.graphs.run(bucket)
        if not sample:
            return None
        return self.model.logits_at(hidden, self.inputs.sample_rows[: len(sample)])

    @torch.inference_mode()
    def launch_decode(
        self,
        reqs: Sequence[Request],
        kv: KVCacheManager,
        prev_ids: Optional[torch.Tensor] = None,
        src: Optional[Sequence[int]] = None,
    ) -> Optional[torch.Tensor]:
        """Queue a pure-decode step in which every request computes the token at its ``num_computed_tokens``
        (slots already allocated) and samples; returns the logits (rows in ``reqs`` order) without waiting
        for the device, or None (nothing run) when the batch does not fit the buffers. With ``prev_ids``,
        request i's input token is ``prev_ids[src[i]]`` (gathered on the device), not read from the host."""
        bs = self.block_size
        tables = [kv.block_ids(r) for r in reqs]
        if (
            not reqs
            or not self.buffered
            or not self.fits_decode_buffers(len(tables), max(len(t) for t in tables))
        ):
            return None
        rows = []
        for i, (r, table) in enumerate(zip(reqs, tables)):
            c, k = r.num_computed_tokens, r.num_computed_tokens - r.kv_evicted  # position, cache index
            tok = src[i] if prev_ids is not None else r.all_token_ids[c]
            st = kv.state_slot(r) if self.states else 0
            rows.append(DecodeRow(tok, c, table[k // bs] * bs + k % bs, k + 1, table, state_slot=st))
        self._zero_through(max(max(t) for t in tables))
        if self.kv_plan is not None:  # each row's slot and table in every further KV group
            rows, top = group_rows(rows, reqs, kv)
            self._zero_through(top)
        return self.decode_rows(rows, list(range(len(rows))), prev_ids)

    def _execute_decode(
        self, sched: SchedulerOutput, kv: KVCacheManager
    ) -> Optional[tuple[list[Request], Optional[torch.Tensor]]]:
        """A pure-decode step through the buffers; None (nothing run) when the batch does not fit them."""
        bs = self.block_size
        tables = [kv.block_ids(s.request) for s in sched.scheduled]
        rows: list[DecodeRow] = []
        sample: list[int] = []
        sample_reqs: list[Request] = []
        row_reqs: list[Request] = []  # the request of each row
        for s, table in zip(sched.scheduled, tables):
            r = s.request
            c, k = r.num_computed_tokens, r.num_computed_tokens - r.kv_evicted  # position, cache index
            # A request verifying proposed tokens takes one row per token, each attending to its own context
            # length: the rows a plain decode of each token would be, so the step is the replayed one.
            tokens = [r.all_token_ids[c], *r.spec_token_ids[: s.num_spec_tokens]]
            if s.completes_prompt:
                sample.extend(range(len(rows), len(rows) + len(tokens)))
                sample_reqs.append(r)
            row_reqs.extend([r] * len(tokens))
            st = kv.state_slot(r) if self.states is not None else 0  # one row each: no speculation then
            for j, tok in enumerate(tokens):
                slot = table[(k + j) // bs] * bs + (k + j) % bs
                rows.append(DecodeRow(tok, c + j, slot, k + j + 1, table, state_slot=st))
        if not self.fits_decode_buffers(len(rows), max(len(t) for t in tables)):
            return None
        self._zero_through(max(max(t) for t in tables))
        if self.kv_plan is not None:
            rows, top = group_rows(rows, row_reqs, kv)
            self._zero_through(top)
        logits = self.decode_rows(rows, sample, scored=any(map(is_scored, row_reqs)))
        return (sample_reqs, logits) if sample_reqs else ([], None)

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, kv: KVCacheManager
    ) -> tuple[list[Request], Optional[torch.Tensor]]:
        """Run one step. Returns the requests that sample this step and their logits: one row each, or
        1 + num_spec_tokens consecutive rows for a request verifying proposed tokens."""
        spans = [(s.request, s.num_new_tokens) for s in sched.scheduled]
        token_slots = self.lora.token_slots(spans) if self.lora is not None else None
        # A batch with adapter rows runs eagerly (below): the captured decode graphs hold the base model only.
        if (
            token_slots is None
            and self.buffered
            and sched.scheduled
            and all(s.num_new_tokens - s.num_spec_tokens == 1 for s in sched.scheduled)
            and not any(wants_rows(s.request) for s in sched.scheduled)
        ):
            done = self._execute_decode(sched, kv)
            if done is not None:
                return done
        bs = self.block_size
        # A request verifying proposed tokens joins the decode group with one query row per token, each
        # attending to its own context length: every row then goes through exactly the attention a plain
        # decode of that token would, so verification reproduces plain decoding's numerics.
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1 and not s.num_spec_tokens]
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1 or s.num_spec_tokens]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        written: list[int] = []  # the position of the token each slot receives (scored eviction)
        segments: list[PrefillSegment] = []
        sample_idx: list[int] = []
        sample_reqs: list[Request] = []
        max_block = 0
        tables: list[list[int]] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # chunks whose prompt log-probs are asked for
        for s in prefills + decodes:
            r = s.request
            c, n = r.num_computed_tokens, s.num_new_tokens
            table = kv.block_ids(r)
            tables.append(table)
            max_block = max(max_block, max(table))
            start = len(ids)
            if wants_rows(r):
                prompt_rows.append((r, start, c, n))
            ids.extend(r.all_token_ids[c : c + n])
            if s.num_spec_tokens:  # proposed tokens ride after the last real one, at positions c+1..
                ids.extend(r.spec_token_ids[: s.num_spec_tokens])
            off = self.model.rope_offset(r.num_tokens)  # 0 but for LongRoPE's long sequences
            pos.extend(range(c + off, c + n + off))  # true positions; cache indices skip evicted tokens
            written.extend(range(c, c + n))
            e = r.kv_evicted
            slots.extend(table[(p - e) // bs] * bs + (p - e) % bs for p in range(c, c + n))
            if n > 1 and not s.num_spec_tokens:
                kept = c + n - e
                seg = PrefillSegment(start, n, kept, self.tensor(table[: -(-kept // bs)]))
                seg.state_slot, seg.state_start = (kv.state_slot(r) if self.states else 0), c == 0
                segments.append(seg)
            if s.completes_prompt:
                sample_idx.extend(range(len(ids) - 1 - s.num_spec_tokens, len(ids)))
                sample_reqs.append(r)
        self._zero_through(max_block)
        meta = AttentionMetadata(slot_mapping=self.tensor(slots), block_size=bs, prefills=segments)
        if any(is_scored(s.request) for s in sched.scheduled):
            meta.kv_scores = self.slot_scores.for_step(meta.slot_mapping, self.tensor(written))
        if decodes:
            dtables, ctx_lens = [], []
            for s, t in zip(decodes, tables[len(prefills) :]):
                c = s.request.num_computed_tokens - s.request.kv_evicted
                dtables.extend([t] * s.num_new_tokens)
                ctx_lens.extend(range(c + 1, c + 1 + s.num_new_tokens))
            width = max(len(t) for t in dtables)
            meta.decode_block_tables = self.tensor([t + [0] * (width - len(t)) for t in dtables]).view(
                len(dtables), width
            )
            meta.decode_ctx_lens = self.tensor(ctx_lens)
            if self.states is not None:
                meta.decode_state_slots = self.tensor([kv.state_slot(s.request) for s in decodes])
        if self.kv_plan is not None:  # each layer attends through its KV group's tables
            self._zero_through(attach_groups(meta, kv, prefills + decodes, len(prefills), self.tensor))
        if token_slots is None:
            hidden = self.model(self.tensor(ids), self.tensor(pos), self.layer_caches, meta)
        else:  # one slot per token, in the packed order: prefills, then decodes
            self.lora.set_batch(
                self.lora.token_slots([(s.request, s.num_new_tokens) for s in prefills + decodes])
            )
            try:
                hidden = self.model(self.tensor(ids), self.tensor(pos), self.layer_caches, meta)
            finally:
                self.lora.set_batch(None)
        collect(self.model, hidden, prompt_rows)
        if not sample_reqs:
            return [], None
        logits = self.model.logits_at(hidden, self.tensor(sample_idx))
        return sample_reqs, logits
