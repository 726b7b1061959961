"""Multi-LoRA serving: throughput of 32 requests spread evenly over 4 adapters vs the same 32 requests on the
base model alone, in the same run on the same engine, and the per-token cost of one more adapter in a batch.

Adapters are written in the PEFT format (random nonzero A and B, every q/k/v/o and gate/up/down target, rank
``--rank``) for the served base model and registered at start. Each case runs the same prompts with
``ignore_eos`` (every request generates ``--output-tokens``); cases alternate over ``--repeats`` rounds and
each reports its median, so drift on a shared machine hits all of them alike. Throughput is generated
tokens per wall second of the whole batch, and per CPU second of this process (on a machine shared with
other work, wall time also measures the neighbours). The cost of one extra adapter is the slope of wall seconds per
generated token over the number of distinct adapters in the batch (1, 2, 4), least squares.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

PROMPTS = [
    "Write a short poem about the sea at night.",
    "What are some good habits for learning a new language?",
    "Tell me a story about a robot who wants to become a chef.",
    "Why is the sky blue? Explain it simply.",
    "Give me three ideas for a weekend trip in the mountains.",
    "What should I consider when adopting a dog?",
    "Describe your ideal breakfast.",
    "How do I stay motivated when working from home?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="base checkpoint (default: the default trained model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    p.add_argument("--quantization", default=None, choices=["int8", "int4"], help="the base model's weights")
    p.add_argument("--adapters", type=int, default=4, help="distinct adapters in the mixed batch")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rank", type=int, default=8, help="rank of every adapter (also max_lora_rank)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds over the cases")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench-results")


def write_adapter(
    out: Path, shapes: dict[str, list[int]], num_layers: int, rank: int, seed: int, b_std: float = 0.01
) -> Path:
    """A PEFT LoRA adapter directory with random weights for a base of these target shapes (B entries of
    standard deviation ``b_std``: small, as after fine-tuning; larger to change a model's answers)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for name, (fin, fout) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=gen) * fin**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=gen) * b_std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": sorted(shapes),
                "bias": "none",
                "lora_dropout": 0.0,
                "task_type": "CAUSAL_LM",
            }
        )
    )
    return out


def _run_case(
    llm: Any, prompts: list[str], params: Any, loras: list[Optional[str]]
) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds of this process (what the work cost, even when other processes hold
    the cores for part of the wall time) and generated tokens."""
    conv = [[{"role": "user", "content": p}] for p in prompts]
    t, c = time.perf_counter(), time.process_time()
    outs = llm.chat(conv, params, lora=loras)
    return time.perf_counter() - t, time.process_time() - c, sum(len(o.token_ids) for o in outs)


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def run(args: argparse.Namespace) -> int:
    import torch

    from sidecar import LLM, SamplingParams
    from sidecar.bench.report import format_table, write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    probe = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, num_kv_blocks=64)
    info = probe.engine.model_info
    del probe
    tmp = Path(tempfile.mkdtemp(prefix="sidecar-lora-bench-"))
    names = [f"adapter{i}" for i in range(args.adapters)]
    mods = {
        n: str(write_adapter(tmp / n, info["lora_target_shapes"], info["num_layers"], args.rank, i))
        for i, n in enumerate(names)
    }
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        lora_modules=mods,
        max_loras=len(names),
        max_lora_rank=args.rank,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    ks = sorted({1, 2, len(names)})
    cases: dict[str, list[Optional[str]]] = {"base": [None] * len(prompts)}
    cases.update({f"{k} adapters": [names[i % k] for i in range(len(prompts))] for k in ks})
    _run_case(llm, prompts[:4], params, [None, *names[:3]][:4])  # warm-up: allocator, KV first touch
    secs: dict[str, list[float]] = {c: [] for c in cases}
    cpu: dict[str, list[float]] = {c: [] for c in cases}
    tokens = 0
    for _ in range(args.repeats):
        for case, loras in cases.items():
            dt, ct, tokens = _run_case(llm, prompts, params, loras)
            secs[case].append(dt)
            cpu[case].append(ct)
    rows = []
    for case in cases:
        dt, ct = statistics.median(secs[case]), statistics.median(cpu[case])
        rows.append(
            {
                "case": case,
                "requests": len(prompts),
                "tokens": tokens,
                "seconds": dt,
                "tok_s": tokens / dt,
                "cpu_seconds": ct,
                "tok_per_cpu_s": tokens / ct,
                "ms_per_token": 1000 * dt / tokens,
            }
        )
    base, base_cpu = rows[0]["tok_s"], rows[0]["tok_per_cpu_s"]
    for r in rows:
        r["vs_base"] = r["tok_s"] / base
        r["vs_base_cpu"] = r["tok_per_cpu_s"] / base_cpu
    mixed = rows[-1]
    slope_ms = _slope([float(k) for k in ks], [r["ms_per_token"] for r in rows[1:]])
    print(format_table(rows, list(rows[0])))
    print(
        f"\n{len(names)} adapters mixed evenly over {len(prompts)} requests: {mixed['vs_base']:.3f}x the base "
        f"model's throughput (target >= 0.8x); one more adapter in the batch costs {slope_ms * 1000:.1f} us "
        f"per generated token ({100 * slope_ms / rows[0]['ms_per_token']:.1f}% of the base's per-token time); "
        f"the first adapter {1000 * (rows[1]['ms_per_token'] - rows[0]['ms_per_token']):.1f} us per token; "
        f"in CPU time the mixed batch runs at {mixed['vs_base_cpu']:.3f}x the base"
    )
    jpath, ppath = write_report(
        args.out,
        "lora",
        {
            "command": "sidecar bench lora",
            "args": {k: v for k, v in vars(args).items() if k != "_run"},
            "model": info["model"],
            "dtype": info["dtype"],
            "quantization": info["quantization"],
            "loadavg": os.getloadavg(),
            "results": rows,
            "mixed_vs_base": mixed["vs_base"],
            "extra_adapter_ms_per_token": slope_ms,
        },
        bars={"tokens/s": {r["case"]: r["tok_s"] for r in rows}},
    )
    print(f"wrote {jpath} and {ppath}")
    return 0
