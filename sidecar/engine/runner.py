"""ModelRunner: SchedulerOutput -> packed tensors -> model -> logits of the sampled positions."""
from __future__ import annotations

import logging
import time
from typing import Optional, Sequence, Union

import psutil
import torch

from sidecar.config import EngineConfig
from sidecar.engine.kv_cache import KVCacheManager
from sidecar.engine.request import Request
from sidecar.engine.scheduler import SchedulerOutput
from sidecar.model.attention import AttentionMetadata, PrefillSegment
from sidecar.model.loader import LoadedModel

log = logging.getLogger("sidecar.engine")

# Without an explicit budget the KV cache takes a fraction of free memory, but never more than
# every sequence at full length could use, and on CPU at most this much.
CPU_DEFAULT_KV_CAP_BYTES = 4 << 30


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    a = loaded.args
    elem = torch.tensor([], dtype=loaded.dtype).element_size()
    return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * elem


def plan_num_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """Number of KV blocks (including the reserved padding block 0)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(loaded, config.block_size)
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * (1 << 30))
    else:
        if loaded.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(loaded.device)
            budget = int(free * config.kv_cache_memory_fraction)
        else:
            budget = min(int(psutil.virtual_memory().available * config.kv_cache_memory_fraction),
                         CPU_DEFAULT_KV_CAP_BYTES)
        blocks_per_seq = -(-loaded.max_model_len // config.block_size)
        budget = min(budget, config.max_num_seqs * blocks_per_seq * per_block)
    blocks = budget // per_block + 1
    if blocks < 2:
        raise ValueError(f"kv_cache_memory_gb: budget {budget} bytes holds no KV block "
                         f"({per_block} bytes each)")
    return blocks


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded.model
        self.device = loaded.device
        # The host is free while an accelerator runs the forward, so host work (grammar masks) can overlap
        # it; on a CPU the forward already uses every core and a second thread only competes with it.
        self.host_overlaps_forward = self.device.type != "cpu"
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.num_blocks = plan_num_blocks(config, loaded)
        a = loaded.args
        shape = (self.num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        # Blocks are zeroed lazily the first time they are used (see _zero_new_blocks): the pool hands
        # out never-used blocks in ascending id order, so the used ids always form a prefix 1..hwm.
        self.kv_caches = [(torch.empty(shape, dtype=self.dtype, device=self.device),
                           torch.empty(shape, dtype=self.dtype, device=self.device)) for _ in range(a.num_layers)]
        self._zeroed_upto = 0
        self._zero_blocks(0, 0)
        self.kv_cache_bytes = self.num_blocks * kv_bytes_per_block(loaded, self.block_size)

    def _zero_blocks(self, lo: int, hi: int) -> None:
        for k, v in self.kv_caches:
            k[lo:hi + 1].zero_()
            v[lo:hi + 1].zero_()
        self._zeroed_upto = max(self._zeroed_upto, hi)

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def time_decode_rows(self, rows: Union[int, Sequence[int]], repeats: int = 7) -> Optional[list[float]]:
        """Fastest seconds (of ``repeats``) of one forward plus logits for r decode rows, for each r in
        ``rows`` (an int n: r = 1..n): the price of verifying r - 1 speculative tokens of one request, or
        of a batch's rows, on this device (GEMM kernels change algorithm with the row count, so the price
        is measured, not assumed). Call before serving: it writes the KV of blocks 1.., which the lazy
        zeroing clears before their first real use. None when the pool is too small."""
        counts = list(range(1, rows + 1)) if isinstance(rows, int) else list(rows)
        max_rows = max(counts)
        bs = self.block_size
        nb = -(-max_rows // bs)
        if self._zeroed_upto > 0 or nb + 1 >= self.num_blocks:
            return None
        table = list(range(1, nb + 1))
        out = []
        for r in counts:
            meta = AttentionMetadata(slot_mapping=self._tensor([bs + i for i in range(r)]), block_size=bs)
            meta.decode_block_tables = self._tensor(table * r).view(r, nb)
            meta.decode_ctx_lens = self._tensor(list(range(1, r + 1)))
            ids, pos = self._tensor([0] * r), self._tensor(list(range(r)))
            times = []
            for i in range(repeats + 1):
                t = time.perf_counter()
                self.model.compute_logits(self.model(ids, pos, self.kv_caches, meta)).sum().item()
                times.append(time.perf_counter() - t)
            # The first run warms up; the fastest of the rest is the one least disturbed by anything else
            # running on the machine (a median still moves with a busy neighbour).
            out.append(min(times[1:]))
        return out

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> tuple[list[Request], Optional[torch.Tensor]]:
        """Run one step. Returns the requests that sample this step and their logits: one row each, or
        1 + num_spec_tokens consecutive rows for a request verifying proposed tokens."""
        bs = self.block_size
        # A request verifying proposed tokens joins the decode group with one query row per token, each
        # attending to its own context length: every row then goes through exactly the attention a plain
        # decode of that token would, so verification reproduces plain decoding's numerics.
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1 and not s.num_spec_tokens]
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1 or s.num_spec_tokens]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        segments: list[PrefillSegment] = []
        sample_idx: list[int] = []
        sample_reqs: list[Request] = []
        max_block = 0
        tables: list[list[int]] = []
        for s in prefills + decodes:
            r = s.request
            c, n = r.num_computed_tokens, s.num_new_tokens
            table = kv.block_ids(r)
            tables.append(table)
            max_block = max(max_block, max(table))
            start = len(ids)
            ids.extend(r.all_token_ids[c:c + n])
            if s.num_spec_tokens:  # proposed tokens ride after the last real one, at positions c+1..
                ids.extend(r.spec_token_ids[:s.num_spec_tokens])
            pos.extend(range(c, c + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            if n > 1 and not s.num_spec_tokens:
                segments.append(PrefillSegment(start, n, c + n, self._tensor(table[: -(-(c + n) // bs)])))
            if s.completes_prompt:
                sample_idx.extend(range(len(ids) - 1 - s.num_spec_tokens, len(ids)))
                sample_reqs.append(r)
        if max_block > self._zeroed_upto:
            self._zero_blocks(self._zeroed_upto + 1, max_block)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), block_size=bs, prefills=segments)
        if decodes:
            dtables, ctx_lens = [], []
            for s, t in zip(decodes, tables[len(prefills):]):
                c = s.request.num_computed_tokens
                dtables.extend([t] * s.num_new_tokens)
                ctx_lens.extend(range(c + 1, c + 1 + s.num_new_tokens))
            width = max(len(t) for t in dtables)
            meta.decode_block_tables = self._tensor([t + [0] * (width - len(t)) for t in dtables]).view(len(dtables), width)
            meta.decode_ctx_lens = self._tensor(ctx_lens)
        hidden = self.model(self._tensor(ids), self._tensor(pos), self.kv_caches, meta)
        if not sample_reqs:
            return [], None
        logits = self.model.compute_logits(hidden.index_select(0, self._tensor(sample_idx)))
        return sample_reqs, logits
