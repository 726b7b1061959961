"""A node other than node 0 of a split model (``sidecar serve --node-rank K``, K > 0): it serves nothing and
runs its own ranks (rendezvous.node_ranks), which take their inputs from rank 0 over the store.

Exit status: 0 when rank 0 closed the ranks (or went away: the orchestrator restarts node 0, and this node
with it when its ranks end); 1 when a rank failed, with the rank named on stderr.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sidecar.config import EngineConfig
from sidecar.engine import pp, rendezvous, tp

log = logging.getLogger("sidecar.engine")


def run_node(config: EngineConfig) -> int:
    """Spawn this node's ranks, end one when rank 0's watchdog asks (``kill/<rank>``), and return once all
    have exited."""
    import torch.multiprocessing as mp

    world = config.tensor_parallel_size * config.pipeline_parallel_size
    target: Any = pp._stage_main if config.pipeline_parallel_size > 1 else tp._worker_main
    ctx = mp.get_context("spawn")
    try:  # waits for node 0's store
        store = rendezvous.connect(config.master_addr, config.master_port, world)
    except RuntimeError as exc:
        log.error(
            "node %d: cannot reach node 0 at %s:%d: %s",
            config.node_rank,
            config.master_addr,
            config.master_port,
            exc,
        )
        return 1
    procs = {}
    for rank in rendezvous.node_ranks(world, config.nnodes, config.node_rank):
        conn = rendezvous.StoreConn(config.master_addr, config.master_port, world, rank, "worker")
        proc = ctx.Process(
            target=target, args=(rank, world, config.master_port, tp._rank_config(config, rank), conn)
        )
        proc.start()
        procs[rank] = proc
    log.info("node %d of %d: ranks %s", config.node_rank, config.nnodes, {r: p.pid for r, p in procs.items()})
    reported: set[int] = set()
    while len(reported) < len(procs):
        for rank, proc in procs.items():
            try:
                if proc.exitcode is not None and rank not in reported:
                    reported.add(rank)
                    store.set(f"exit/{rank}", str(proc.exitcode))  # what rank 0 names in its error
                elif store.check([f"kill/{rank}"]) and proc.exitcode is None:
                    proc.kill()
            except RuntimeError:  # node 0 is gone: its ranks' own waits end them
                reported.update(r for r, p in procs.items() if p.exitcode is not None)
        time.sleep(0.1)
    failed = {r: p.exitcode for r, p in procs.items() if p.exitcode}
    for rank, code in failed.items():
        log.error("rank %d exited with code %s", rank, code)
    return 1 if failed else 0
