"""Load generator over gRPC or the OpenAI HTTP API (``sidecar bench serve``).

Open loop (Poisson arrivals at ``--request-rate``) or closed loop (``--concurrency``
clients), a seeded mix of prompt/output lengths with a shared-prefix share,
bounded by ``--num-requests`` and ``--duration``. Reports TTFT, TPOT, ITL and E2E
percentiles, throughput and goodput under the SLOs, as JSON + PNG in ``--out``.
``--overhead`` instead sends 1-token requests one at a time and compares the
client round trip with the server's own arrival-to-completion time, which is
the cost of the RPC layer. ``--launch`` starts a sidecar subprocess for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from typing import Any

from sidecar.bench.report import format_table, percentile, write_report
from sidecar.bench.serve_load import GrpcClient, OpenAIClient, Result, Spec, launch, make_workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc", help="wire API to drive")
    p.add_argument(
        "--target",
        default="127.0.0.1:50051",
        help="host:port of the gRPC server (or of the HTTP server with --api openai)",
    )
    p.add_argument(
        "--launch", action="store_true", help="start a sidecar subprocess on free ports for the run"
    )
    p.add_argument("--model", default="demo", help="model for --launch, and the model name sent over OpenAI")
    p.add_argument(
        "--launch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `sidecar serve` argument for --launch (repeatable, e.g. --launch-arg=--num-kv-blocks=512)",
    )
    p.add_argument("--api-key", default=None, help="API key sent as 'authorization: Bearer'")
    p.add_argument("--num-requests", type=int, default=200, help="requests to send (upper bound)")
    p.add_argument(
        "--duration", type=float, default=120.0, help="stop sending new requests after this many seconds"
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrival rate in requests/s (inf: all at once); ignored with --concurrency",
    )
    p.add_argument(
        "--concurrency", type=int, default=None, help="closed loop: this many clients back to back"
    )
    p.add_argument("--prompt-words", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument(
        "--shared-prefix-ratio", type=float, default=0.5, help="share of prompts with the shared prefix"
    )
    p.add_argument("--shared-prefix-words", type=int, default=64, help="length of the shared prefix in words")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (lengths vary)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--overhead", action="store_true", help="measure 1-token round trip vs server time (gRPC)")
    p.add_argument("--overhead-requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=4, help="requests sent before measuring")
    p.add_argument("--out", default="bench-results", help="directory for serve.json / serve.png")


def run(args: argparse.Namespace) -> int:
    for name, lo, hi in (("prompt_words", *args.prompt_words), ("max_tokens", *args.max_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name}: need 1 <= MIN <= MAX, got {lo} {hi}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {args.concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"request_rate: must be > 0, got {args.request_rate}")
    if args.launch:
        with launch(args.model, list(args.launch_arg)) as ports:
            port = ports["http_port"] if args.api == "openai" and not args.overhead else ports["grpc_port"]
            if port is None:
                raise ValueError("api: the launched sidecar has no HTTP server")
            return asyncio.run(_main(args, f"127.0.0.1:{port}"))
    return asyncio.run(_main(args, args.target))


def _client(args: argparse.Namespace, target: str) -> Any:
    if args.api == "openai" and not args.overhead:
        return OpenAIClient(f"http://{target}", args.api_key, args.model)
    return GrpcClient(target, args.api_key)


async def _main(args: argparse.Namespace, target: str) -> int:
    client = _client(args, target)
    try:
        if args.overhead:
            payload, bars = await _overhead(client, args)
            name = "serve_overhead"
        else:
            payload, bars = await _load(client, args)
            name = f"serve_{args.api}"
    finally:
        await client.close()
    payload["command"] = "sidecar bench serve " + " ".join(_argv(args))
    jpath, ppath = write_report(args.out, name, payload, bars=bars, ylabel="ms")
    print(f"wrote {jpath}" + (f" and {ppath}" if ppath else ""))
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    import sys

    return sys.argv[sys.argv.index("serve") + 1 :] if "serve" in sys.argv else []


def _ms_stats(values: list[float]) -> dict[str, float]:
    vals = [v * 1000.0 for v in values if not math.isnan(v)]
    return {
        "p50": percentile(vals, 50),
        "p90": percentile(vals, 90),
        "p99": percentile(vals, 99),
        "mean": sum(vals) / len(vals) if vals else float("nan"),
        "n": len(vals),
    }


async def _load(client: Any, args: argparse.Namespace) -> tuple[dict, dict]:
    specs = make_workload(
        args.num_requests + args.warmup,
        args.seed,
        tuple(args.prompt_words),
        tuple(args.max_tokens),
        args.shared_prefix_ratio,
        args.shared_prefix_words,
    )
    warm, specs = specs[: args.warmup], specs[args.warmup :]
    ignore_eos = not args.no_ignore_eos
    call = lambda i, s: client.stream(s, args.temperature, ignore_eos, args.seed + i)  # noqa: E731
    await asyncio.gather(*(call(i, s) for i, s in enumerate(warm)))
    t0 = time.perf_counter()
    end = t0 + args.duration
    results: list[Result] = []
    if args.concurrency:
        queue = list(enumerate(specs))[::-1]

        async def worker() -> None:
            while queue and time.perf_counter() < end:
                i, s = queue.pop()
                results.append(await call(i, s))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    else:
        rng = random.Random(args.seed)
        tasks = []
        for i, s in enumerate(specs):
            if time.perf_counter() >= end:
                break
            tasks.append(asyncio.ensure_future(call(i, s)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = list(await asyncio.gather(*tasks))
    wall = time.perf_counter() - t0
    return _summarize(results, wall, args)


def _summarize(results: list[Result], wall: float, args: argparse.Namespace) -> tuple[dict, dict]:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1000.0, args.slo_tpot_ms / 1000.0
    good = [r for r in ok if r.ttft_s <= slo_ttft and (math.isnan(r.tpot_s) or r.tpot_s <= slo_tpot)]
    out_tokens = sum(r.output_tokens for r in ok)
    lat = {
        "ttft_ms": _ms_stats([r.ttft_s for r in ok]),
        "tpot_ms": _ms_stats([r.tpot_s for r in ok]),
        "itl_ms": _ms_stats([x for r in ok for x in r.itl_s]),
        "e2e_ms": _ms_stats([r.e2e_s for r in ok]),
    }
    summary = {
        "requests": len(results),
        "completed": len(ok),
        "errors": errors,
        "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "output_token_throughput": out_tokens / wall,
        "goodput_requests_per_s": len(good) / wall,
        "slo_attained": len(good) / max(1, len(ok)),
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
    }
    rows = [{"metric": k, **{q: v[q] for q in ("p50", "p90", "p99", "mean")}} for k, v in lat.items()]
    print(format_table(rows, ["metric", "p50", "p90", "p99", "mean"]))
    print(
        f"completed {len(ok)}/{len(results)} in {wall:.1f}s: {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_token_throughput']:.1f} output tok/s, goodput {summary['goodput_requests_per_s']:.2f} "
        f"req/s ({100 * summary['slo_attained']:.0f}% within SLO), errors {errors or 'none'}"
    )
    mode = {"concurrency": args.concurrency} if args.concurrency else {"request_rate": args.request_rate}
    payload = {
        "benchmark": "serve",
        "api": args.api,
        **mode,
        "seed": args.seed,
        "latency": lat,
        "summary": summary,
        "workload": {
            "prompt_words": list(args.prompt_words),
            "max_tokens": list(args.max_tokens),
            "shared_prefix_ratio": args.shared_prefix_ratio,
        },
    }
    bars = {name: {q: v[q] for q in ("p50", "p90", "p99")} for name, v in lat.items()}
    return payload, bars


async def _overhead(client: GrpcClient, args: argparse.Namespace) -> tuple[dict, dict]:
    spec = Spec(prompt="ping", max_tokens=1, shared_prefix=False)
    for _ in range(args.warmup):
        await client.unary(spec)
    rtt, server, diff, errors = [], [], [], 0
    for _ in range(args.overhead_requests):
        r = await client.unary(spec)
        if not r.ok:
            errors += 1
            continue
        rtt.append(r.e2e_s)
        server.append(r.server_total_ms / 1000.0)
        diff.append(r.e2e_s - r.server_total_ms / 1000.0)
    stats = {"round_trip_ms": _ms_stats(rtt), "server_ms": _ms_stats(server), "overhead_ms": _ms_stats(diff)}
    rows = [{"metric": k, **{q: v[q] for q in ("p50", "p90", "p99", "mean")}} for k, v in stats.items()]
    print(format_table(rows, ["metric", "p50", "p90", "p99", "mean"]))
    o, t = stats["overhead_ms"]["p50"], stats["round_trip_ms"]["p50"]
    print(
        f"1-token gRPC round trip p50 {t:.2f} ms, of which outside the engine p50 {o:.2f} ms "
        f"({100 * o / t:.0f}%); errors {errors}"
    )
    payload = {
        "benchmark": "serve_overhead",
        "api": "grpc",
        "requests": args.overhead_requests,
        "errors": errors,
        **stats,
    }
    return payload, {
        "1-token request (ms)": {
            "round trip p50": t,
            "server p50": stats["server_ms"]["p50"],
            "overhead p50": o,
        }
    }
