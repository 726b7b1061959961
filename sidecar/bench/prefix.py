"""Prefix caching: the KV cache as a global resource shared across requests and batches.

Scenarios, each run with prefix caching on and off on fresh engines in one run:
- customer-service: one ~500-token system prompt shared by every request, ~50-token questions,
  arriving in waves (separate batches), so reuse must cross batch boundaries;
- multi-turn: conversations whose every turn resends all earlier turns;
- no-sharing: unique prompts, to show what caching costs at a 0% hit rate.
Reported: prefill tokens computed, cache hit fraction, TTFT p50/p99, throughput.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from typing import Any, Callable, Optional

import torch


def _llm(args: argparse.Namespace, caching: bool):
    from sidecar import LLM

    return LLM(
        model=args.model_dir,
        dtype=args.dtype,
        enable_prefix_caching=caching,
        kv_cache_memory_gb=args.kv_cache_gb,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting_requests=1 << 20,
    )


def _run_wave(llm, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    """One batch: every prompt submitted at once, run to completion; outputs in prompt order."""
    from sidecar import SamplingParams

    return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _summarise(
    name: str,
    caching: bool,
    outs: list[Any],
    seconds: float,
    skip_first: int = 0,
    counters: Optional[dict[str, int]] = None,
) -> dict[str, Any]:
    from sidecar.bench.report import percentile

    prompt = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    after = outs[skip_first:]
    ttft = [o.ttft_s * 1000 for o in after]
    return {
        "scenario": name,
        "prefix_caching": "on" if caching else "off",
        "requests": len(outs),
        "prompt_tokens": prompt,
        "prefill_tokens_computed": prompt - cached,
        "cached_fraction": cached / prompt if prompt else 0.0,
        "cached_fraction_after_first": (
            sum(o.num_cached_tokens for o in after) / max(1, sum(len(o.prompt_token_ids) for o in after))
        ),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "seconds": seconds,
        "output_tok_s": sum(len(o.token_ids) for o in outs) / seconds,
        # The engine's own count of the scenario (LLM.stats() deltas): prefix-cache hit tokens, steps.
        **(counters or {}),
    }


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 20000) for _ in range(n)]


def customer_service(args: argparse.Namespace, run: Callable, rng: random.Random) -> list[Any]:
    system = _tokens(rng, args.system_tokens)
    outs = run([system + _tokens(rng, args.question_tokens)])
    for _ in range(args.waves):
        outs += run([system + _tokens(rng, args.question_tokens) for _ in range(args.wave_size)])
    return outs


def multi_turn(args: argparse.Namespace, run: Callable, rng: random.Random) -> list[Any]:
    convs = [_tokens(rng, args.question_tokens) for _ in range(args.conversations)]
    outs: list[Any] = []
    for _turn in range(args.turns):
        results = run(convs)
        outs += results
        convs = [c + r.token_ids + _tokens(rng, args.question_tokens) for c, r in zip(convs, results)]
    return outs


def no_sharing(args: argparse.Namespace, run: Callable, rng: random.Random) -> list[Any]:
    return run([_tokens(rng, args.system_tokens // 2) for _ in range(args.wave_size * 4)])


# name, scenario, leading requests left out of the "after first" figures
SCENARIOS = [
    ("customer-service", customer_service, lambda a: 1),
    ("multi-turn", multi_turn, lambda a: a.conversations),
    ("no-sharing", no_sharing, lambda a: 0),
]


def measure(
    args: argparse.Namespace, name: str, scenario: Callable, skip_first: int, caching: bool
) -> dict[str, Any]:
    """Run one scenario on a fresh engine (warmed up on unrelated tokens), timing only the scenario."""
    llm = _llm(args, caching)
    _run_wave(llm, [[7, 8, 9]], 2)
    before = llm.stats()
    t = time.perf_counter()
    outs = scenario(
        args, lambda prompts: _run_wave(llm, prompts, args.output_tokens), random.Random(args.seed)
    )
    dt = time.perf_counter() - t
    after = llm.stats()
    counters = {
        "engine_prefix_hit_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        "engine_steps": after["num_steps"] - before["num_steps"],
    }
    llm = None  # free the model and KV cache before the next engine is built
    gc.collect()
    return _summarise(name, caching, outs, dt, skip_first=skip_first, counters=counters)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2-0.5b", help="checkpoint dir, 'demo', or a benchmark shape")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--question-tokens", type=int, default=50)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--waves", type=int, default=6, help="customer-service batches after the first request")
    p.add_argument("--wave-size", type=int, default=4)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench-results")


def run(args: argparse.Namespace) -> int:
    from sidecar.bench.models import SHAPES, random_checkpoint
    from sidecar.bench.report import format_table, write_report
    from sidecar.model.loader import resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    args.model_dir = str(
        random_checkpoint(args.model) if args.model in SHAPES else resolve_model_dir(args.model)
    )
    rows = []
    for name, scenario, skip in SCENARIOS:
        for caching in (False, True):
            rows.append(measure(args, name, scenario, skip(args), caching))
            r = rows[-1]
            print(
                f"{r['scenario']:17s} caching {r['prefix_caching']:3s}: {r['seconds']:.1f}s "
                f"cached {r['cached_fraction']:.1%} ttft p50 {r['ttft_p50_ms']:.1f} ms",
                flush=True,
            )
    cols = [
        "scenario",
        "prefix_caching",
        "requests",
        "prompt_tokens",
        "prefill_tokens_computed",
        "cached_fraction_after_first",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "output_tok_s",
    ]
    print(format_table(rows, cols))
    by = {(r["scenario"], r["prefix_caching"]): r for r in rows}
    cs_on, cs_off = by[("customer-service", "on")], by[("customer-service", "off")]
    ns_on, ns_off = by[("no-sharing", "on")], by[("no-sharing", "off")]
    summary = {
        "customer_service_cached_fraction_after_first": cs_on["cached_fraction_after_first"],
        "customer_service_prefill_reduction": 1
        - cs_on["prefill_tokens_computed"] / cs_off["prefill_tokens_computed"],
        "ttft_p50_speedup_warm_vs_cold": cs_off["ttft_p50_ms"] / cs_on["ttft_p50_ms"],
        "no_sharing_throughput_on_vs_off": ns_on["output_tok_s"] / ns_off["output_tok_s"],
        "multi_turn_cached_fraction_after_first_turn": by[("multi-turn", "on")][
            "cached_fraction_after_first"
        ],
    }
    print(format_table([summary], list(summary)))
    jpath, ppath = write_report(
        args.out,
        "prefix",
        {
            "command": "sidecar bench prefix",
            "args": {k: v for k, v in vars(args).items() if k != "_run"},
            "results": rows,
            "summary": summary,
        },
        bars={
            "TTFT p50 (ms)": {
                f"{s} {c}": by[(s, c)]["ttft_p50_ms"]
                for s in ("customer-service", "multi-turn")
                for c in ("off", "on")
            },
            "prefill tokens computed": {
                f"{s} {c}": by[(s, c)]["prefill_tokens_computed"]
                for s in ("customer-service", "multi-turn")
                for c in ("off", "on")
            },
        },
    )
    print(f"wrote {jpath} and {ppath}")
    return 0
