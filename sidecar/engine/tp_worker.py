"""A tensor-parallel worker rank's side once it holds its slices (tp.py starts it): its KV pool, then the
forwards, replayed decode steps (from C on a CPU, tp_replay.py; from its decode graphs, tp_device.py) and
other messages rank 0 sends through its pipe."""

from __future__ import annotations

from typing import Any, Optional

import torch

from sidecar.config import EngineConfig
from sidecar.engine import dist_inputs as di
from sidecar.engine import tp_device, tp_replay
from sidecar.model import kv_quant, mla
from sidecar.model.loader import LoadedModel
from sidecar.model.tp_shard import Comm


def worker_pool(
    loaded: LoadedModel, config: EngineConfig, conn: Any, shapes: list[tuple[int, int]]
) -> Optional[list]:
    """A worker's KV pool, a cache per layer of ``shapes`` ((KV heads, head size) each; a latent-attention
    model's latent form instead, mla.py), of the block count rank 0 sends first (None: rank 0 closed
    instead); zeroed whole, since rank 0 zeroes a block lazily before its first use."""
    msg = conn.recv()
    if msg is None:
        return None
    a, device = loaded.model.args, loaded.device
    kv_dtype = kv_quant.resolve_kv_dtype(config.kv_cache_dtype, device, loaded.dtype)[0]
    kv_caches = [mla.layer_cache(a, msg[1], config.block_size, kv_dtype, device, shape) for shape in shapes]
    kv_quant.zero_blocks(kv_caches, 0, msg[1] - 1)
    conn.send(("ready",))
    return kv_caches


@torch.inference_mode()
def serve(loaded: LoadedModel, config: EngineConfig, conn: Any, comm: Comm) -> None:
    """A worker rank's loop once its slices are loaded: its KV pool, then each message rank 0 sends, run on its
    slices (a forward, a replayed decode step, the replay self-check, the device check, an adapter, a logits
    selection) until rank 0 closes the pipe."""
    model, device = loaded.model, loaded.device
    kv_caches = worker_pool(loaded, config, conn, model.args.kv_shapes())
    if kv_caches is None:
        return
    hidden, lora, plans, ranked = None, di.worker_lora(model, config), None, None
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg[0] == "fwd":
            ids, pos, meta, token_slots = di.unpack_inputs(msg[1], device)
            with di.lora_batch(lora, token_slots):
                hidden = model(ids, pos, kv_caches, meta)
        elif msg[0] == "decode":  # a replayed pure-decode step (tp_replay.py)
            hidden = plans.step(msg[1])
        elif msg[0] == "replay":  # the group's replay self-check, with rank 0's buffers' dimensions
            plans = tp_replay.WorkerPlans(model, kv_caches, device, msg[1])
            conn.send(("checked", plans.check(comm)))
        elif msg[0] == "gstep":  # a decode step through the graphs (tp_device.py)
            hidden = tp_device.worker_step(ranked, msg[1])
        elif msg[0] == "device":  # the group's device check, with rank 0's buffers' dimensions
            ranked = tp_device.worker_check(loaded, kv_caches, comm, conn, msg[1])
        elif msg[0] == "device_off":
            tp_device.worker_off(ranked)
        elif msg[0] == "lora":
            di.load_adapter(lora, msg)
        elif msg[0] == "logits":
            model.logits_at(hidden, torch.from_numpy(msg[1]).to(device))
