"""Memory soak (``sidecar bench soak``): many requests of mixed shapes against a real server, its RSS sampled.

A sidecar whose resident size keeps growing with the requests it served is OOM-killed hours after a
deploy instead of failing at start. This sends ``--num-requests`` requests over the OpenAI HTTP API
(chat and completions, streamed and not, short and long prompts and answers, n of 1 or 2), keeps
``--concurrency`` in flight, and samples the server process's RSS after every ``--sample-every``
finished requests. The report gives the RSS after warm-up (``--warmup-fraction`` of the requests),
its least-squares slope in MiB per 1,000 requests, and its largest deviation from the post-warm-up
mean as a percentage: flat means within a few percent. JSON + PNG (RSS against requests) in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any, Optional

from sidecar.bench.report import machine_info
from sidecar.bench.serve_load import _WORDS, launch
from sidecar.config import DEFAULT_MODEL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model the launched sidecar serves")
    p.add_argument(
        "--target", default=None, help="host:port of a running HTTP server (default: launch one); needs --pid"
    )
    p.add_argument(
        "--pid", type=int, default=None, help="process id of the --target server, to sample its RSS"
    )
    p.add_argument(
        "--launch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `sidecar serve` argument (repeatable, e.g. --launch-arg=--kv-cache-memory-gb=0.5)",
    )
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--sample-every", type=int, default=20, help="sample RSS after this many finished requests"
    )
    p.add_argument("--warmup-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results")


def _body(rng: random.Random, i: int) -> tuple[str, dict]:
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.choice((4, 24, 120, 400))))
    common = {
        "max_tokens": rng.choice((1, 8, 32, 96)),
        "temperature": rng.choice((0.0, 0.8)),
        "n": rng.choice((1, 1, 1, 2)),
        "stream": rng.random() < 0.5,
        "seed": i,
    }
    if rng.random() < 0.6:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"{i}: {words}"}], **common}
    return "/v1/completions", {"prompt": f"{i}: {words}", **common}


async def _drive(base: str, model: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import psutil

    proc = psutil.Process(pid)
    rng = random.Random(args.seed)
    bodies = [_body(rng, i) for i in range(args.num_requests)]
    samples: list[tuple[int, float]] = [(0, proc.memory_info().rss / 2**20)]
    done, errors, next_i = 0, 0, 0
    t0 = time.perf_counter()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done, errors, next_i
        while next_i < len(bodies):
            path, body = bodies[next_i]
            next_i += 1
            try:
                async with client.stream("POST", path, json={"model": model, **body}) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
                    errors += resp.status_code != 200
            except httpx.HTTPError:
                errors += 1
            done += 1
            if done % args.sample_every == 0:
                samples.append((done, proc.memory_info().rss / 2**20))
                _progress(args, samples, errors, time.perf_counter() - t0)

    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    samples.append((done, proc.memory_info().rss / 2**20))
    return {"samples": samples, "errors": errors, "wall_s": time.perf_counter() - t0}


def _progress(
    args: argparse.Namespace, samples: list[tuple[int, float]], errors: int, elapsed: float
) -> None:
    """One line per sample on stderr and the samples so far in ``soak.partial.json``: a long soak can be watched."""
    import sys

    n, rss = samples[-1]
    print(
        f"soak: {n}/{args.num_requests} requests, RSS {rss:.0f} MiB, {errors} errors, {elapsed:.0f}s",
        file=sys.stderr,
        flush=True,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.partial.json").write_text(
        json.dumps({"samples": samples, "errors": errors, "elapsed_s": elapsed})
    )


def summarize(samples: list[tuple[int, float]], warmup_requests: int) -> dict[str, float]:
    """RSS after warm-up: mean, least-squares slope (MiB per 1,000 requests), largest deviation from the mean (%)."""
    after = [(n, r) for n, r in samples if n >= warmup_requests]
    if len(after) < 2:
        raise ValueError(
            "num_requests: too few RSS samples after warm-up; send more requests or sample more often"
        )
    xs, ys = [n for n, _ in after], [r for _, r in after]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return {
        "rss_start_mib": samples[0][1],
        "rss_after_warmup_mean_mib": my,
        "rss_end_mib": ys[-1],
        "rss_slope_mib_per_1k_requests": slope * 1000.0,
        "rss_max_deviation_pct": 100.0 * max(abs(y - my) for y in ys) / my,
        "rss_growth_after_warmup_pct": 100.0 * (ys[-1] - ys[0]) / ys[0],
    }


def _plot(path: Path, samples: list[tuple[int, float]], warmup_requests: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([n for n, _ in samples], [r for _, r in samples], color="#2a7ab9")
    ax.axvline(warmup_requests, color="#a0a0a0", linestyle="--", label="end of warm-up")
    ax.set_xlabel("requests finished")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.num_requests < 1 or args.concurrency < 1 or args.sample_every < 1:
        raise ValueError("num_requests, concurrency, sample_every: must be >= 1")
    if not 0 <= args.warmup_fraction < 1:
        raise ValueError(f"warmup_fraction: must be in [0, 1), got {args.warmup_fraction}")
    if args.target is not None:
        if args.pid is None:
            raise ValueError("pid: --target needs the server's --pid to sample its RSS")
        result = asyncio.run(_drive(f"http://{args.target}", args.model, args.pid, args))
        return _report(args, result, None)
    with launch(args.model, list(args.launch_arg)) as ports:
        result = asyncio.run(_drive(f"http://127.0.0.1:{ports['http_port']}", args.model, ports["pid"], args))
        return _report(args, result, ports)


def _report(args: argparse.Namespace, result: dict, ports: Optional[dict]) -> int:
    warmup = int(args.num_requests * args.warmup_fraction)
    summary = summarize(result["samples"], warmup)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "summary": summary,
        "errors": result["errors"],
        "wall_s": result["wall_s"],
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "model": args.model,
        "launch_args": args.launch_arg,
        "samples": result["samples"],
        "machine": machine_info(),
    }
    (out / "soak.json").write_text(json.dumps(payload, indent=2))
    _plot(
        out / "soak.png",
        result["samples"],
        warmup,
        f"{args.num_requests} mixed requests, slope {summary['rss_slope_mib_per_1k_requests']:.2f} MiB/1k",
    )
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    print(
        f"errors: {result['errors']}  wall: {result['wall_s']:.1f}s  wrote {out / 'soak.json'} and {out / 'soak.png'}"
    )
    return 0 if result["errors"] == 0 else 1
