"""Run the gRPC + OpenAI HTTP sidecar (``sidecar serve``).

Lifecycle: bind both servers (health NOT_SERVING) -> write the port file ->
load the model and the semantic cache -> SERVING. On SIGTERM/SIGINT: health
NOT_SERVING, new calls get UNAVAILABLE, running requests get up to
``--shutdown-timeout`` seconds to finish, the rest are aborted; exit 0. A second
signal cuts the grace period short.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any, Optional

from sidecar.config import SidecarConfig
from sidecar.server.flags import add_config_arguments, config_from_args

log = logging.getLogger("sidecar.app")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        cfg = dataclasses.replace(cfg, engine=cfg.engine.with_torchrun_env(dict(os.environ)))
        from sidecar.server.logs import setup_logging

        if cfg.engine.node_rank > 0:  # a split model's other host: runs its ranks, serves nothing
            from sidecar.engine.node import run_node

            setup_logging(cfg.server.log_level, cfg.server.log_json)
            return run_node(cfg.engine)
        from sidecar.server.service import InferenceService

        service = InferenceService(cfg)  # parses API keys: a bad keys file is a config error
    except ValueError as exc:
        print(f"sidecar serve: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.server.log_level, cfg.server.log_json)
    try:
        code = asyncio.run(Sidecar(cfg, service).main())
    except StartupError as exc:
        print(f"sidecar serve: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if code == ENGINE_STOPPED:
        _exit_now(code)
    return code


ENGINE_STOPPED = 1  # the exit status once the engine stopped by itself (a split model lost a rank)


def _exit_now(code: int) -> None:
    """Exit without tearing the engine down: a split model's broken process group may still hold an operation
    with a peer whose host vanished, and its teardown would wait for the group's timeout to end it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StartupError(Exception):
    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def write_port_file(path: str, grpc_port: int, http_port: Optional[int]) -> None:
    """Atomic: readers see either no file or the complete JSON."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"grpc_port": grpc_port, "http_port": http_port, "pid": os.getpid()}, fh)
    os.replace(tmp, path)


def _in_thread(fn: Any, *a: Any) -> asyncio.Future:
    """Run blocking ``fn`` in a daemon thread, so a signal during model load can exit at once."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def work() -> None:
        try:
            res = fn(*a)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(lambda e=exc: fut.done() or fut.set_exception(e))
        else:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(res))

    threading.Thread(target=work, name="sidecar-load", daemon=True).start()
    return fut


def http_socket(host: str) -> socket.socket:
    """The HTTP listening socket, created with protocol IPPROTO_TCP: asyncio sets TCP_NODELAY only
    on accepted sockets whose protocol says TCP, and without it Nagle's algorithm plus the client's
    delayed ACK hold every small second write (a response body after its headers, each SSE chunk)
    for ~40 ms on reused connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Sidecar:
    def __init__(self, cfg: SidecarConfig, service: Any) -> None:
        self.cfg = cfg
        self.service = service
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        self.grpc_server: Any = None
        self.http: Optional[Any] = None  # (uvicorn server, task)

    def _on_signal(self) -> None:
        if self.stop.is_set():
            self.force.set()
        self.stop.set()

    async def main(self) -> int:
        from sidecar.server.grpc.servicer import Health, build_server

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        s = self.cfg.server
        self.health = Health()
        await self.health.set(False)
        self.grpc_server = build_server(
            self.service,
            self.health,
            s.max_message_bytes,
            s.max_concurrent_streams,
            s.max_connection_age_s,
            s.max_connection_age_grace_s,
        )
        try:
            grpc_port = self.grpc_server.add_insecure_port(_hostport(s.host, s.grpc_port))
        except RuntimeError as exc:
            raise StartupError(f"grpc_port: cannot bind {_hostport(s.host, s.grpc_port)}: {exc}") from None
        await self.grpc_server.start()
        try:
            http_port = await self._start_http()
        except BaseException:
            await self.grpc_server.stop(0)
            raise
        print(f"sidecar: gRPC listening on {_hostport(s.host, grpc_port)}", flush=True)
        if http_port is not None:
            print(f"sidecar: HTTP listening on {_hostport(s.host, http_port)}", flush=True)
        if s.port_file:
            write_port_file(s.port_file, grpc_port, http_port)
        try:
            try:
                loaded = await self._load()
            except BaseException:
                await self._stop_servers()
                raise
            if loaded:
                await self.health.set(True)
                log.info(
                    "ready",
                    extra={"model": self.service.model_name, "grpc_port": grpc_port, "http_port": http_port},
                )
                print(
                    f"sidecar: serving {self.service.model_name} ({describe(self.service.model_info())})",
                    flush=True,
                )
                code = await self._serve()
            await self._drain()
        finally:
            if s.port_file:
                with contextlib.suppress(OSError):
                    os.remove(s.port_file)
        return code if loaded else 0

    async def _serve(self) -> int:
        """Serve until a signal (0) or until the engine stops by itself (1: e.g. a tensor-parallel worker died,
        so the orchestrator restarts the server: ``ENGINE_STOPPED``)."""
        engine = self.service.engine
        while not self.stop.is_set():
            if not engine.is_running:
                print(
                    f"sidecar serve: error: {engine.failure or 'engine stopped'}", file=sys.stderr, flush=True
                )
                return ENGINE_STOPPED
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 0.5)
        return 0

    async def _load(self) -> bool:
        """Load engine and cache; False when a signal arrived first."""

        def load_engine() -> Any:
            # Imported here, off the event loop: torch import alone takes seconds, and health
            # checks must keep answering NOT_SERVING meanwhile.
            from sidecar.engine.async_engine import AsyncEngine

            engine_cfg = self.cfg.engine
            if self.cfg.server.lora_roots and not engine_cfg.enable_lora:
                # Allowing run-time adapters (--lora-root) is asking for adapter slots.
                engine_cfg = dataclasses.replace(engine_cfg, enable_lora=True)
            return AsyncEngine.from_config(engine_cfg)

        async def load() -> tuple[Any, Any, Any]:
            engine = await _in_thread(load_engine)
            cache, embedder = await _in_thread(self._load_cache)
            return engine, cache, embedder

        task = asyncio.ensure_future(load())
        stopper = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not task.done():
            task.cancel()
            log.info("stopped while loading")
            return False
        try:
            engine, cache, embedder = task.result()
        except ValueError as exc:  # bad model/config value: a configuration error
            raise StartupError(str(exc), exit_code=2) from None
        except Exception as exc:
            log.exception("startup failed")
            raise StartupError(f"model: failed to load {self.cfg.engine.model!r}: {exc}") from None
        engine.start()
        self.service.attach(engine, cache, embedder)
        return True

    def _load_cache(self) -> tuple[Any, Any]:
        c = self.cfg.cache
        if not c.enabled:
            return None, None
        try:
            from sidecar.cache.embedder import Embedder
            from sidecar.cache.semantic import SemanticCache
        except ImportError as exc:
            log.warning("semantic cache unavailable (%s); serving without it", exc)
            return None, None
        device = "cpu" if self.cfg.engine.device == "cpu" else None
        embedder = Embedder(c.embedding_model, device=device)
        return SemanticCache(c, embedder), embedder

    async def _start_http(self) -> Optional[int]:
        s = self.cfg.server
        if s.http_port < 0:
            return None
        try:
            from sidecar.server.openai.api import HttpSettings, create_app
        except ModuleNotFoundError as exc:
            if exc.name not in ("sidecar.server.openai", "sidecar.server.openai.api"):
                raise
            log.warning("OpenAI HTTP API not available in this build; serving gRPC only")
            return None
        import uvicorn

        class _Server(uvicorn.Server):
            # Signals belong to the sidecar: it drains gRPC and HTTP together.
            def install_signal_handlers(self) -> None:
                pass

            @contextlib.contextmanager
            def capture_signals(self):
                yield

        sock = http_socket(s.host)
        try:
            sock.bind((s.host, s.http_port))
        except OSError as exc:
            sock.close()
            raise StartupError(
                f"http_port: cannot bind {_hostport(s.host, s.http_port)}: {exc.strerror}"
            ) from None
        port = sock.getsockname()[1]
        from sidecar.server.openai.limits import TimedH11Protocol

        app = create_app(self.service, settings=HttpSettings.from_config(s, self.service.metrics))
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            http=TimedH11Protocol.with_timeout(s.http_read_timeout_s),
            timeout_graceful_shutdown=max(1, int(s.shutdown_timeout_s)),
        )
        server = _Server(config)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()
                raise StartupError("HTTP server exited during startup")
            await asyncio.sleep(0.01)
        self.http = (server, task)
        return port

    async def _drain(self) -> None:
        log.info(
            "draining",
            extra={"timeout_s": self.cfg.server.shutdown_timeout_s, "active": self.service.num_active},
        )
        self.service.begin_drain()
        await self.health.set(False)
        engine = self.service.engine
        if engine is not None:
            drain = asyncio.ensure_future(engine.shutdown(self.cfg.server.shutdown_timeout_s))
            forced = asyncio.ensure_future(self.force.wait())
            await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
            forced.cancel()
            if not drain.done():
                log.warning("second signal: aborting running requests now")
                drain.cancel()
                await engine.shutdown(0)
        await self._stop_servers()
        await self.service.close()
        log.info("stopped")

    async def _stop_servers(self) -> None:
        # Handlers have their final outputs; give them a moment to write and return.
        await self.grpc_server.stop(grace=2.0)
        if self.http is not None:
            server, task = self.http
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=5.0)


def _count(n) -> str:
    """A parameter count as people write it: 135.0M, 30.5B."""
    if not n:
        return "?"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def describe(info: dict) -> str:
    """The start line's account of the served model: architecture and what it runs with."""
    parts = [
        f"arch={info.get('architecture') or '?'}",
        f"dtype={info.get('dtype') or '?'}",
        f"quantization={info.get('quantization') or 'none'}"
        # under quantized weights, the output head's precision (int8 by default, as quantize_lm_head says)
        + (
            f" (lm_head {info['lm_head']})"
            if info.get("quantization") not in (None, "none") and info.get("lm_head")
            else ""
        ),
        f"kv={info.get('kv_cache_dtype') or '?'}",
        f"device={info.get('device') or '?'}",
        f"params={_count(info.get('total_parameters'))}"
        + (
            f" ({_count(info.get('active_parameters'))} active)"
            if info.get("active_parameters") not in (None, info.get("total_parameters"))
            else ""
        ),
        f"fast paths={','.join(info.get('fast_paths') or ()) or 'none'}",
    ]
    if info.get("cpu_decode_replay") is not None:
        parts.append(f"cpu decode replay={'on' if info['cpu_decode_replay'] else 'off'}")
    parts.append(f"tool calls={info.get('tool_call_format') or 'hermes'}")
    if info.get("reasoning"):
        parts.append("reasoning")
    return ", ".join(parts)
