"""Where a split model's ranks meet: one host or several, over torch.distributed's TCPStore.

``nnodes`` hosts hold ``world / nnodes`` consecutive ranks each; node 0 holds rank 0 (the server, which
schedules and serves the store at ``master_addr:master_port``), and every node spawns its own ranks. A rank on
node 0 talks to rank 0 over a pipe; a rank on another node over the store (``StoreConn``: numbered keys per
rank and direction, each deleted once read), since pipes do not cross hosts. The process group itself (gloo
or NCCL) connects every pair of ranks directly.

Liveness: every worker beats (``beat/<rank>``, every ``HEARTBEAT_S``) from a thread of its own, which keeps
beating through a long step (the forward releases the GIL), so a stale beat means a process stopped, not a
slow prefill. Rank 0's ``Watchdog`` ends a rank whose beat is ``HEARTBEAT_TIMEOUT_S`` old (a local one
killed, a remote one through its node's agent, ``kill/<rank>``): rank 0's wait on it then fails at once.
"""

from __future__ import annotations

import datetime
import ipaddress
import pickle
import os
import socket
import sys
import threading
import time
from typing import Any, Optional

HEARTBEAT_S = 0.5
HEARTBEAT_TIMEOUT_S = 5.0
START_TIMEOUT_S = 300.0


def node_ranks(world: int, nnodes: int, node: int) -> range:
    per = world // nnodes
    return range(node * per, (node + 1) * per)


def local_rank(world: int, nnodes: int, rank: int) -> int:
    return rank % (world // nnodes)


def bind_host(master_addr: str) -> str:
    """The address this host's gloo connections use: loopback when the master is (one host or a loopback
    test of several), else the host's own name (in Kubernetes a pod's name resolves to its address)."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(master_addr)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    return socket.gethostname()


def connect(addr: str, port: int, world: int, server: bool = False) -> Any:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
    if server:
        return dist.TCPStore(addr, port, world, True, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(addr, port, world, False, timeout=timeout)


class StoreConn:
    """A pipe end over the store for rank ``rank``: ``side`` "worker" reads ``to/`` keys and writes ``from/``
    ones, "rank0" the reverse. Picklable (it connects on first use, in the process that uses it)."""

    def __init__(self, addr: str, port: int, world: int, rank: int, side: str) -> None:
        self.addr, self.port, self.world, self.rank, self.side = addr, port, world, rank, side
        self.sent = self.read = 0
        self._store: Optional[Any] = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_store": None}

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = connect(self.addr, self.port, self.world)
        return self._store

    def _key(self, outgoing: bool, n: int) -> str:
        to_worker = outgoing == (self.side == "rank0")
        return f"{'to' if to_worker else 'from'}/{self.rank}/{n}"

    def send(self, msg: Any) -> None:
        try:
            self.store.set(self._key(True, self.sent), pickle.dumps(msg))
        except RuntimeError as exc:  # the store's host is gone
            raise EOFError(str(exc)) from exc
        self.sent += 1

    def poll(self, timeout: float = 0.0) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.store.check([self._key(False, self.read)]):
                    return True
            except RuntimeError as exc:
                raise EOFError(str(exc)) from exc
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def recv(self) -> Any:
        """The next message; an idle wait has no deadline (EOFError once the store's host is gone). The store
        wakes the wait when the key is set: no polling delay on the step's path."""
        import torch.distributed as dist

        key = self._key(False, self.read)
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=5))
                break
            except dist.DistNetworkError as exc:
                raise EOFError(str(exc)) from exc
            except dist.DistStoreError:  # an idle wait's timeout: wait again
                continue
            except RuntimeError as exc:
                raise EOFError(str(exc)) from exc
        try:
            data = self.store.get(key)
            self.store.delete_key(key)
        except RuntimeError as exc:
            raise EOFError(str(exc)) from exc
        self.read += 1
        return pickle.loads(data)

    def close(self) -> None:
        self._store = None


class RemoteProc:
    """Rank 0's view of a rank on another node: its pid once joined, and an exit status once its beat is
    stale (``HEARTBEAT_TIMEOUT_S``) or it was ended."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank
        self.killed = False

    @property
    def exitcode(self) -> Optional[int]:
        """Its exit status as its node's agent reported it (``exit/<rank>``); -9 once ended from here."""
        try:
            if self.store.check([f"exit/{self.rank}"]):
                return int(self.store.get(f"exit/{self.rank}"))
        except RuntimeError:
            pass
        return -9 if self.killed else None

    @property
    def pid(self) -> Optional[int]:
        key = f"joined/{self.rank}"
        return int(self.store.get(key)) if self.store.check([key]) else None

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(self) -> None:
        self.store.set(f"kill/{self.rank}", "1")
        self.killed = True


def beat(addr: str, port: int, world: int, rank: int) -> None:
    """Start this worker's heartbeat thread (its own store connection)."""

    def run() -> None:
        store, n = connect(addr, port, world), 0
        while True:
            n += 1
            try:
                store.set(f"beat/{rank}", str(n))
            except RuntimeError:
                return  # the store's host is gone: the worker's own wait ends it
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=run, name=f"sidecar-beat{rank}", daemon=True).start()


class Watchdog:
    """Rank 0's thread ending ranks whose beat went stale; ``hung`` names them (for the error message)."""

    def __init__(self, addr: str, port: int, world: int, procs: dict[int, Any]) -> None:
        self.procs, self.hung = procs, {}
        self._stop = threading.Event()
        self._args = (addr, port, world)
        self._thread = threading.Thread(target=self._run, name="sidecar-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread and wait for it: its store connection must close before the store's host does
        (a connection the host drops mid-request makes torch log a failed receive)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2 * HEARTBEAT_S)

    def _run(self) -> None:
        store = connect(*self._args)
        seen = {r: (None, time.monotonic()) for r in self.procs}
        while not self._stop.wait(HEARTBEAT_S):
            now = time.monotonic()
            for r, proc in self.procs.items():
                try:
                    value = store.get(f"beat/{r}") if store.check([f"beat/{r}"]) else None
                except RuntimeError:
                    return
                if value != seen[r][0]:
                    seen[r] = (value, now)
                elif now - seen[r][1] > HEARTBEAT_TIMEOUT_S and proc.exitcode is None and r not in self.hung:
                    self.hung[r] = now - seen[r][1]
                    proc.kill()  # rank 0's wait on its connections then fails at once


def run_worker(conn: Any, body: Any, *args: Any) -> None:
    """``body(*args)`` as a worker process's life: closed by rank 0, or rank 0 gone, it exits 0 at once (no
    process-group teardown, which can wait on peers); an error is reported on ``conn`` (rank 0 names this
    rank) and the process exits 1."""
    code = 0
    try:
        body(*args)
    except (EOFError, KeyboardInterrupt):  # rank 0 is gone
        pass
    except BaseException as exc:
        code = 1
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except (OSError, EOFError):
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shutdown(procs: dict[int, Any], conns: dict[int, Any], watchdogs: list) -> None:
    """Rank 0 ending its local workers: the watchdogs first, then each pipe closed and each process joined
    (killed after two seconds)."""
    for watchdog in watchdogs:  # before the store (this process hosts it) can go
        watchdog.stop()
    for conn in conns.values():
        try:
            conn.send(None)
            conn.close()
        except (OSError, EOFError):
            pass
    for proc in procs.values():
        proc.join(2.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join(2.0)
