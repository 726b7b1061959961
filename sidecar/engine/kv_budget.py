"""How many KV blocks the pool gets, and why: the footprint is decided once at start and reported.

Without an explicit size the budget is what the deployment can use -- every one of ``max_num_seqs``
sequences at full context -- bounded by ``kv_cache_memory_fraction`` of the memory this process may
still take: on CUDA the device's free memory, on CPU the smaller of the host's available memory and
the container's (cgroup) limit minus what the container already uses, so a pod's limit is honoured
rather than the node's free memory. On CPU a ceiling (``CPU_DEFAULT_KV_CAP_BYTES``) also applies.
The runner commits the whole pool from start (``EngineConfig.kv_cache_commit``; a background thread writes
it, ``kv_zero.py``), so a budget that does not fit fails seconds after start and the resident size does not
creep while blocks are first used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from sidecar.config import EngineConfig
from sidecar.engine.kv_groups import GroupPlan, blocks_per_sequence, plan_groups
from sidecar.model import kv_quant
from sidecar.model.loader import LoadedModel

log = logging.getLogger("sidecar.engine")

CPU_DEFAULT_KV_CAP_BYTES = 4 << 30

# cgroup v2 first, then v1; a v1 "unlimited" is a huge number, v2 says "max".
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_CGROUP_USAGE = ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes")
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int  # including the reserved padding block 0
    bytes: int  # of the whole pool
    source: str  # num_kv_blocks | kv_cache_memory_gb | max_num_seqs x context | memory fraction | cpu cap
    container_limit_bytes: Optional[int]  # the cgroup memory limit, None when unlimited or unknown
    plan: Optional[GroupPlan] = None  # KV groups: a block is a page of plan.per_group layers of one group


def kv_bytes_per_block(
    loaded: LoadedModel,
    block_size: int,
    kv_dtype: Optional[torch.dtype] = None,
    plan: Optional[GroupPlan] = None,
) -> int:
    """Cache bytes of one block over the layers that keep KV (each at its own heads and head size), K and V,
    with the scales of a quantized cache (a hybrid model's linear-attention layers keep state slots instead,
    ``linear_state.py``; layers sharing another's KV keep none; latent attention a latent per token); with KV
    groups (``plan``), over one group's layers at each of the plan's cache shapes (a block id holds a page in
    every shape's tensors, kv_groups.py)."""
    a, dtype = loaded.args, kv_dtype or loaded.dtype
    if plan is not None:  # a block holds one group's layers
        shapes = plan.shapes or a.kv_shapes()[:1]
        per_token = sum(nkv * kv_quant.bytes_per_token_head(dtype, hd) for nkv, hd in shapes)
        return 2 * block_size * plan.per_group * per_token
    if getattr(a, "latent", None) is not None:  # a latent per token and layer (mla.py)
        from sidecar.model import mla

        return mla.bytes_per_block(a, block_size, dtype)
    per_token = sum(nkv * kv_quant.bytes_per_token_head(dtype, hd) for nkv, hd in a.kv_shapes())
    return 2 * block_size * per_token


def _read_int(paths: tuple[str, ...]) -> Optional[int]:
    for path in paths:
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        return None if text == "max" or not text.isdigit() or int(text) >= _UNLIMITED else int(text)
    return None


def container_memory(
    limits: tuple[str, ...] = _CGROUP_LIMITS, usage: tuple[str, ...] = _CGROUP_USAGE
) -> tuple[Optional[int], Optional[int]]:
    """(limit, headroom) in bytes of this process's memory cgroup; (None, None) when unlimited or unknown."""
    limit = _read_int(limits)
    if limit is None:
        return None, None
    used = _read_int(usage) or 0
    return limit, max(0, limit - used)


def _cpu_memory_bound(config: EngineConfig) -> tuple[int, str, Optional[int]]:
    import psutil  # only here: the CUDA image need not ship it

    free = psutil.virtual_memory().available
    limit, headroom = container_memory()
    if headroom is not None:
        free = min(free, headroom)
    bound = int(free * config.kv_cache_memory_fraction)
    if bound > CPU_DEFAULT_KV_CAP_BYTES:
        return CPU_DEFAULT_KV_CAP_BYTES, "cpu cap", limit
    return bound, "memory fraction", limit


def plan_kv_budget(
    config: EngineConfig, loaded: LoadedModel, kv_dtype: Optional[torch.dtype] = None
) -> KVBudget:
    """The pool's size and what decided it, for cache elements of ``kv_dtype`` (default: the model's dtype;
    a quantized cache holds more tokens in the same budget). Raises ValueError naming
    ``kv_cache_memory_gb`` when the budget holds no block."""
    plan, reason = plan_groups(loaded.args, config.tensor_parallel_size * config.pipeline_parallel_size)
    if reason is not None:
        log.info("KV groups off (%s): sliding / chunked layers keep every block of their sequence", reason)
    elif plan is not None:
        log.info("KV groups: %s", plan.describe())
    per_block = kv_bytes_per_block(loaded, config.block_size, kv_dtype, plan)
    if config.num_kv_blocks is not None:
        n = config.num_kv_blocks
        return KVBudget(n, n * per_block, "num_kv_blocks", container_memory()[0], plan)
    limit = None
    if config.kv_cache_memory_gb is not None:
        budget, source = int(config.kv_cache_memory_gb * (1 << 30)), "kv_cache_memory_gb"
    else:
        if loaded.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(loaded.device)
            budget, source = int(free * config.kv_cache_memory_fraction), "memory fraction"
        else:
            budget, source, limit = _cpu_memory_bound(config)
        blocks_per_seq = -(-loaded.max_model_len // config.block_size)
        if plan is not None:  # a sliding / chunked group holds its window's blocks only
            blocks_per_seq = blocks_per_sequence(
                plan, config.block_size, loaded.max_model_len, config.max_num_batched_tokens
            )
        need = config.max_num_seqs * blocks_per_seq * per_block
        if need <= budget:
            budget, source = need, "max_num_seqs x context"
    blocks = budget // per_block + 1
    if blocks < 2:
        raise ValueError(
            f"kv_cache_memory_gb: budget {budget} bytes holds no KV block ({per_block} bytes each)"
        )
    return KVBudget(blocks, blocks * per_block, source, limit, plan)


def plan_num_blocks(config: EngineConfig, loaded: LoadedModel, kv_dtype: Optional[torch.dtype] = None) -> int:
    """Number of KV blocks (including the reserved padding block 0)."""
    return plan_kv_budget(config, loaded, kv_dtype).num_blocks
