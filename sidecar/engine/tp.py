"""Tensor parallelism: one model split over ``tensor_parallel_size`` processes (model/tp_shard.py).

This process is rank 0: it schedules, owns the block tables and samples; ranks 1..N-1 are worker processes
(``torch.multiprocessing`` spawn) that each hold their slices of the weights and their own KV pool of the same
number of blocks, so rank 0's block tables address every rank's pool alike. The ranks form their own
torch.distributed process group (gloo on CPU, NCCL on CUDA: the backend is the one switch) over a TCPStore
that rank 0 serves on a free loopback port.

Each forward's inputs (token ids, positions, slots, the attention metadata) and each step's sampled row
indices reach the workers through one pipe per worker, pickled, not through a collective: an idle worker
waits on its pipe with no collective timeout running, rank 0 sees a worker gone from its process sentinel
before it sends, and a worker sees rank 0 gone from its pipe closing. The collectives inside the forward
(model/tp_shard.py) carry the group's timeout, and gloo fails them at once when a peer's connection closes;
rank 0 waits on gloo in slices that ask ``alive`` (a peer whose host vanished, its connections silent, is
ended by the heartbeat watchdog within seconds: the wait ends then, not at the collective timeout).

On one host's CPUs the group's float32 / bf16 all-reduces go through a shared-memory segment (tp_shm.py), and
every rank replays its pure-decode steps from C after a joint self-check (tp_replay.py: every rank, or none;
rank 0 then sends each replayed step's rows instead of a forward's inputs). On CUDA every rank self-checks the
device fast paths and captures its decode graphs with the others (tp_device.py: one decision for the group).

Faults: a worker that exits, or a collective that fails or times out, breaks the group for good (``broken``
names the rank and its exit code): the step's requests and every later one fail with ``TPWorkerLost``,
rank 0 ends the other workers, and AsyncEngine stops (the server then exits non-zero). A worker that
never joins fails start-up with an error naming its rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
import weakref
from typing import Any, Optional

import torch

from sidecar.config import EngineConfig
from sidecar.engine.request import SamplingParams
from sidecar.engine import cpu_bind, rendezvous, tp_device, tp_replay, tp_shm, dist_inputs as di
from sidecar.engine.tp_worker import serve
from sidecar.model.attention import AttentionMetadata
from sidecar.model.loader import LoadedModel, load_model, resolve_device
from sidecar.model.tp_shard import Comm, Shard

log = logging.getLogger("sidecar.engine")

START_TIMEOUT_S = 300.0  # for every rank to join and load its slices
# One collective inside a forward: the ranks run the same work between two, so a wait this long means a rank
# stopped (an idle worker waits on its pipe, where no timeout runs).
COLLECTIVE_TIMEOUT_S = 30.0


class TPWorkerLost(RuntimeError):
    """The tensor-parallel group broke (a worker exited, or a collective failed): the model cannot run."""


def make_group(
    backend: str, store: Any, rank: int, world: int, timeout_s: float, host: str = "127.0.0.1"
) -> Any:
    """This model's own process group (not torch.distributed's default one) over ``store``."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore("sidecar-tp", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":  # the CUDA switch: same collectives on device tensors
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, world, opts)


def wait_for_ranks(
    store: Any, procs: dict[int, Any], timeout_s: float, option: str = "tensor_parallel_size"
) -> None:
    """Wait until every rank in ``procs`` (rank -> process) has joined ``store``; raises RuntimeError naming
    the first rank that exited before joining, or every rank still missing at the deadline."""
    deadline = time.monotonic() + timeout_s
    missing = sorted(procs)
    while missing:
        missing = [r for r in missing if not store.check([f"joined/{r}"])]
        for r in missing:
            if procs[r].exitcode is not None:
                raise RuntimeError(
                    f"{option}: rank {r} (pid {procs[r].pid}) exited with code "
                    f"{procs[r].exitcode} before joining the process group (workers are spawned: a script "
                    "that starts the engine must guard its entry point with if __name__ == '__main__')"
                )
        if missing and time.monotonic() > deadline:
            raise RuntimeError(
                f"{option}: rank(s) {', '.join(map(str, missing))} did not join the process "
                f"group within {timeout_s:.0f} s"
            )
        time.sleep(0.02)


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank ``rank``'s config: its own GPU of its node on CUDA."""
    if resolve_device(config.device).type != "cuda":
        return config
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    return dataclasses.replace(config, device=f"cuda:{rendezvous.local_rank(world, config.nnodes, rank)}")


def load(config: EngineConfig) -> tuple[Optional["TensorParallel"], LoadedModel]:
    """(None, the model) for one process; else the started group and rank 0's slices of the model."""
    if config.tensor_parallel_size == 1:
        return None, load_model(config)
    tp = TensorParallel(config)
    try:
        return tp, load_model(_rank_config(config, 0), shard=tp.shard)
    except BaseException:
        tp.close()
        raise


class TensorParallel:
    """Rank 0's side of the group: the workers, their pipes, the shard this process holds. Pipeline
    parallelism (pp.py) is the same group with other slices, worker loop and model wrapper (the hooks)."""

    option, label = "tensor_parallel_size", "tensor-parallel"

    def __init__(self, config: EngineConfig) -> None:
        import torch.multiprocessing as mp

        self.world = getattr(config, self.option)
        self.config = config
        self.replay_checks: dict[int, Optional[str]] = {}  # each rank's CPU replay self-check (tp_replay.py)
        self.device_checks: dict = {}  # rank -> path -> why its device check failed there (tp_device.py)
        self.backend = "nccl" if resolve_device(config.device).type == "cuda" else "gloo"
        self.broken: Optional[str] = None
        self.lora: Optional[Any] = None  # rank 0's adapter slots (attach_lora)
        if self.backend == "nccl":
            torch.cuda.set_device(resolve_device(_rank_config(config, 0).device))
        addr = config.master_addr
        store = rendezvous.connect(addr, config.master_port, self.world, server=True)
        ctx = mp.get_context("spawn")
        # the shared-memory all-reduce's segment, published before the workers start (tp_shm.py)
        self.shm, self.shm_name = (None, "")
        self.shm_reason: Optional[str] = "pipeline parallelism has no all-reduce"
        if self.option == "tensor_parallel_size":
            self.shm, self.shm_name = tp_shm.offer(config, self.world, store, COLLECTIVE_TIMEOUT_S)
            self.shm_reason = None if self.shm_name else tp_shm.refusal(config) or "segment not created"
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}
        self.watchdog: Optional[rendezvous.Watchdog] = None
        self._watchdogs: list = []  # the finalizer stops it too: a group dropped without close()
        self._finalizer = weakref.finalize(self, rendezvous.shutdown, self.procs, self.conns, self._watchdogs)
        local = rendezvous.node_ranks(self.world, config.nnodes, 0)
        cpu_bind.share_with_children()
        for rank in range(1, self.world):  # the other nodes' ranks are spawned by their own agents
            if rank not in local:
                conn = rendezvous.StoreConn(addr, store.port, self.world, rank, "rank0")
                self.procs[rank], self.conns[rank] = rendezvous.RemoteProc(store, rank), conn
                continue
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=self.worker_main,
                args=(rank, self.world, store.port, _rank_config(config, rank), theirs),
                name=f"sidecar-{self.label}{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self.procs[rank], self.conns[rank] = proc, mine
        self._pinned = cpu_bind.place(config, 0)  # after the spawns: a child inherits its parent's CPUs
        try:
            wait_for_ranks(store, self.procs, START_TIMEOUT_S, self.option)
            host = rendezvous.bind_host(addr)
            group = make_group(self.backend, store, 0, self.world, COLLECTIVE_TIMEOUT_S, host)
        except BaseException:
            self.close()
            raise
        self.watchdog = rendezvous.Watchdog(addr, store.port, self.world, self.procs)
        self._watchdogs.append(self.watchdog)
        self.store = store  # the workers' connection to it stays up while the group lives
        self.group = group
        # NCCL's waits only order streams (its own watchdog times operations): slices on gloo only
        self.comm = Comm(group, 0, self.world, self.alive if self.backend == "gloo" else None)
        if self.shm_name:
            try:
                self.shm_reason = tp_shm.join(self.comm, self.shm_name, self.shm, COLLECTIVE_TIMEOUT_S)
            except BaseException:
                self.close()
                raise
        self.shard = self.rank_zero_shard(self.comm)
        log.info("%s: %d ranks over %s, workers %s", self.label, self.world, self.backend, self.pids())

    @property
    def worker_main(self) -> Any:
        """The workers' entry point (module level: spawn pickles it by name)."""
        return _worker_main

    def rank_zero_shard(self, comm: Comm) -> Any:
        """What rank 0 passes to load_model as its ``shard``."""
        return Shard(0, self.world, comm)

    def drive(self, model: Any) -> Any:
        """The runner's model once the workers are ready: forwards go to every rank."""
        return RankZeroModel(model, self)

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def attach(self, runner: Any) -> None:
        """Give every worker rank 0's pool size, wait until each has loaded its slices and allocated its pool,
        then drive them from ``runner``'s model."""
        try:
            self.send(("pool", runner.num_blocks))
            for rank in self.procs:
                self._expect(rank, "ready")
        except BaseException:
            self.close()
            raise
        runner.model = self.drive(runner.model)
        tp_replay.start(self, runner)  # CPU decode replays on every rank, or on none
        tp_device.start(self, runner)  # on CUDA: device paths and graphs on every rank, or on none

    def attach_lora(self, layers: Any) -> None:
        """Write each adapter rank 0 loads into ``layers``' slots into the workers' same slots, in order."""
        self.lora = layers
        layers.mirror = lambda slot, adapter: self.send(di.pack_adapter(slot, adapter))

    def _expect(self, rank: int, what: str) -> tuple:
        conn, proc = self.conns[rank], self.procs[rank]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not conn.poll(0.05):
            if proc.exitcode is not None or time.monotonic() > deadline:
                state = "timed out" if proc.exitcode is None else f"exited with code {proc.exitcode}"
                raise RuntimeError(f"{self.option}: rank {rank} (pid {proc.pid}) {state} while loading")
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"{self.option}: rank {rank} failed: {msg[1]}")
        assert msg[0] == what, msg
        return msg

    def receive(self, rank: int, what: str) -> tuple:
        """Worker ``rank``'s next message, of kind ``what``; a failure (the worker gone) breaks the group."""
        return self.run(self._expect, rank, what)

    def check_params(self, params: SamplingParams) -> None:
        """Refuse, naming the field, what would need rank-0-only state kept on every rank."""
        for name, used in (
            ("prompt_logprobs", params.prompt_logprobs is not None),
            ("beam_width", params.beam_width is not None),
            ("kv_budget", params.kv_budget is not None),
        ):
            if used:
                raise ValueError(f"{name}: not supported with {self.option} {self.world}")

    def alive(self) -> None:
        """Raises TPWorkerLost once a worker has exited or been ended (by the watchdog, its beat stale)."""
        for rank, proc in self.procs.items():
            if proc.exitcode is not None:
                raise TPWorkerLost(f"{self.label} worker rank {rank} exited with code {proc.exitcode}")

    def check(self) -> None:
        """Raises TPWorkerLost once the group is broken."""
        if self.broken is not None:
            raise TPWorkerLost(self.broken)

    def send(self, msg: Any) -> None:
        """Send ``msg`` to every worker; raises TPWorkerLost when the group is broken or a worker is gone."""
        if self.broken is None:
            try:
                for rank, proc in self.procs.items():
                    if proc.exitcode is not None:
                        raise EOFError(f"rank {rank} exited")
                for conn in self.conns.values():
                    conn.send(msg)
            except (OSError, EOFError) as exc:
                self.fail(exc)
        self.check()

    def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on rank 0, whose collectives meet the workers'; any failure breaks the group."""
        self.check()
        try:
            return fn(*args)
        except Exception as exc:
            self.fail(exc)
            raise TPWorkerLost(self.broken) from exc

    def fail(self, exc: BaseException) -> None:
        """Break the group for good: record why (the first dead worker, else the error) and end the workers,
        which may wait in a collective that will never complete."""
        deadline = time.monotonic() + 1.0  # a peer's closed connection can arrive before its exit status
        dead = []
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = [(r, p) for r, p in self.procs.items() if p.exitcode is not None]
        if dead:
            r, p = dead[0]
            self.broken = f"{self.label} worker rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            hung = self.watchdog.hung.get(r) if self.watchdog is not None else None
            if hung is not None:
                self.broken += f" after its heartbeat stopped for {hung:.0f} s"
            said = _last_error(self.conns[r])
            self.broken += f" ({said})" if said else ""
        else:
            self.broken = f"{self.label} group failed: {type(exc).__name__}: {exc}"
        log.error("%s; the model cannot run any more", self.broken)
        self.close()

    def close(self) -> None:
        """End the workers (idempotent); the shared-memory segment is aborted (a worker waiting in it stops
        at once) and its name removed."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.shm is not None:
            self.shm.abort()
        if self.shm_name:
            tp_shm.sa.unlink(self.shm_name)
        self._finalizer()
        if getattr(self, "_pinned", False):
            self._pinned = False
            cpu_bind.release()


def _last_error(conn: Any) -> Optional[str]:
    """The error a worker reported on its pipe before it exited, if any."""
    try:
        while conn.poll(0):
            msg = conn.recv()
            if msg and msg[0] == "error":
                return msg[1]
    except (OSError, EOFError):
        pass
    return None


class RankZeroModel:
    """Rank 0's model: each forward and each logits selection first goes to the workers, which run the same
    call on their slices; anything else is the model's own attribute."""

    def __init__(self, model: Any, tp: TensorParallel) -> None:
        self._model, self._tp = model, tp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata):
        self._tp.check()
        self._tp.send(("fwd", di.pack_inputs(ids, positions, meta, self._tp.lora)))
        return self._tp.run(self._model, ids, positions, kv_caches, meta)

    def logits_at(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self._tp.send(("logits", rows.cpu().numpy()))
        return self._tp.run(self._model.logits_at, hidden, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TPWorkerLost("tensor parallelism computes logits of selected rows only (logits_at)")


def join_group(rank: int, world: int, port: int, config: EngineConfig) -> Any:
    """A worker's side of start-up: join rank 0's store, then the process group (returned)."""
    cpu_bind.place(config, rank)
    store = rendezvous.connect(config.master_addr, port, world)
    store.set(f"joined/{rank}", str(os.getpid()))
    rendezvous.beat(config.master_addr, port, world, rank)
    device = resolve_device(config.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    return make_group(
        backend, store, rank, world, COLLECTIVE_TIMEOUT_S, rendezvous.bind_host(config.master_addr)
    )


def _worker_main(rank: int, world: int, port: int, config: EngineConfig, conn: Any) -> None:
    """A worker rank: join the group, load its slices, allocate its pool, then run what rank 0 sends."""
    rendezvous.run_worker(conn, _worker_body, rank, world, port, config, conn)


def _worker_body(rank: int, world: int, port: int, config: EngineConfig, conn: Any) -> None:
    comm = Comm(join_group(rank, world, port, config), rank, world)
    name = tp_shm.worker_segment(rendezvous.connect(config.master_addr, port, world))
    if name:
        tp_shm.join(comm, name, None, COLLECTIVE_TIMEOUT_S)
    serve(load_model(config, shard=Shard(rank, world, comm)), config, conn, comm)
