"""Guided-decoding overhead: time per output token with a JSON-schema constraint vs unconstrained decoding.

Same engine, model, prompts and token counts in the same run, at each batch size: the unconstrained
runs ignore EOS; the constrained runs use a schema whose array is long enough that every request
runs to max_tokens, so both produce exactly the same number of tokens. Runs alternate (unconstrained,
constrained, ...) and each side reports its median, so drift on a shared machine hits both equally.
Also reports the mask work from the engine's counters: masks computed, time computing them on the
worker thread (overlapped with the forward pass) and time the engine waited for them after it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

# Every item is an object of four typed fields; minItems keeps the array open past max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "orders": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "sku": {"type": "string", "maxLength": 12},
                    "status": {"enum": ["open", "shipped", "returned"]},
                    "gift": {"type": "boolean"},
                },
                "required": ["id", "sku", "status", "gift"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["orders"],
    "additionalProperties": False,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small", help="checkpoint dir, 'demo', or a benchmark shape")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="as the engine: auto picks what the model and the hardware run best",
    )
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="alternating runs per side and batch size")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results")


def _timed(llm: Any, prompts: list[str], params: list[Any]) -> tuple[float, int, dict]:
    before = llm.stats()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    after = llm.stats()
    delta = {
        k: after[k] - before[k]
        for k in ("structured_masks", "structured_mask_s", "structured_mask_wait_s", "num_steps")
    }
    return dt, sum(len(o.token_ids) for o in outs), delta


def run(args: argparse.Namespace) -> int:
    from sidecar import LLM, SamplingParams
    from sidecar.bench.models import SHAPES, random_checkpoint
    from sidecar.bench.report import format_table, write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    model = str(random_checkpoint(args.model)) if args.model in SHAPES else args.model
    llm = LLM(model=model, dtype=args.dtype, seed=args.seed)
    n = args.output_tokens
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = [f"List the open orders of customer {i}:" for i in range(b)]
        free = [
            SamplingParams(max_tokens=n, temperature=args.temperature, seed=args.seed + i, ignore_eos=True)
            for i in range(b)
        ]
        guided = [
            SamplingParams(max_tokens=n, temperature=args.temperature, seed=args.seed + i, structured=SCHEMA)
            for i in range(b)
        ]
        _timed(llm, prompts, free)  # warm-up: kernels, allocator, grammar tokenizer
        _timed(llm, prompts, guided)
        per_tok = {"free": [], "guided": []}
        masks = {"structured_masks": 0, "structured_mask_s": 0.0, "structured_mask_wait_s": 0.0}
        tokens = {}
        for _ in range(args.repeats):
            for side, params in (("free", free), ("guided", guided)):
                dt, ntok, delta = _timed(llm, prompts, params)
                per_tok[side].append(dt / ntok)
                tokens[side] = ntok
                if side == "guided":
                    for k in masks:
                        masks[k] += delta[k]
        f, g = statistics.median(per_tok["free"]), statistics.median(per_tok["guided"])
        rows.append(
            {
                "batch": b,
                "tokens_per_run": tokens["guided"],
                "free_ms_per_token": f * 1e3,
                "guided_ms_per_token": g * 1e3,
                "overhead_pct": (g / f - 1) * 100,
                "mask_us_per_mask": masks["structured_mask_s"] / max(masks["structured_masks"], 1) * 1e6,
                "mask_wait_us_per_step": masks["structured_mask_wait_s"]
                / max(tokens["guided"] / b * args.repeats, 1)
                * 1e6,
            }
        )
        r = rows[-1]
        print(
            f"batch {b}: free {r['free_ms_per_token']:.3f} ms/token, guided {r['guided_ms_per_token']:.3f} "
            f"ms/token, overhead {r['overhead_pct']:+.1f}%, mask {r['mask_us_per_mask']:.0f} us "
            f"(engine waited {r['mask_wait_us_per_step']:.0f} us/step)",
            flush=True,
        )
        if tokens["free"] != tokens["guided"]:
            print(
                f"warning: batch {b}: token counts differ (free {tokens['free']}, guided {tokens['guided']})"
            )
    cols = list(rows[0])
    print(format_table(rows, cols))
    jpath, ppath = write_report(
        args.out,
        "structured",
        {
            "command": "sidecar bench structured",
            "args": {k: v for k, v in vars(args).items() if k != "_run"},
            "vocab_size": llm.engine.vocab_size,
            "schema": SCHEMA,
            "results": rows,
        },
        bars={
            "ms per output token": {
                f"b{r['batch']} {side}": r[f"{side}_ms_per_token"]
                for r in rows
                for side in ("free", "guided")
            }
        },
    )
    print(f"wrote {jpath} and {ppath}")
    return 0
