"""Speculative decoding (n-gram prompt lookup or a draft model): batch-1 decode speed on input-grounded
prompts and on open-ended chat, and batch-32 throughput, speculation on vs off in the same run on the
same engine.

One engine with ``speculative="ngram"`` (or ``--speculative draft:<model>``); the "off" side sends the
same requests with ``SamplingParams(speculative=False)``, so weights, KV pool, threads and prefix cache
are shared and only speculation differs. Sides alternate (off, on, off, on, ...) and each reports its
median, so drift on a shared machine hits both equally. Batch-1 decode speed is (output tokens - 1) /
(e2e - ttft) per request, excluding the prompt's prefill; batch 32 reports generated tokens per wall
second of the whole batch.
Greedy outputs are compared token for token between the sides.

Each batch-1 case also reports ``replayed``: the n-gram speedup that the engine's own lookup and
proposal-length choice give on the recorded greedy outputs at the engine's measured step prices
(``spec_decode_step_costs``, or ``--step-costs``), counted in steps instead of seconds. With fixed
``--step-costs`` it does not move with the machine's load, which makes it the figure to judge a proposer or
pricing change by on a shared machine; the timed speedup still says whether the prices hold.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Optional

import torch

ARTICLE = (
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Supporters said "
    "the lanes reduced accidents by twelve percent in the first six months, while shop owners complained "
    "that the loss of forty parking spaces hurt their sales. The council agreed to keep the lanes, add "
    "twenty parking spaces on Oak Avenue, and review the numbers again in March."
)
CODE = (
    "def total_price(items):\n    total = 0\n    for item in items:\n        total = total + item['price'] * "
    "item['qty']\n    return total\n\n\ndef average_price(items):\n    if not items:\n        return 0\n"
    "    return total_price(items) / len(items)\n"
)
EMAIL = (
    "hi team, the quarterly report is due on friday the 14th. please send your section to maria before "
    "thursday noon. the finance numbers come from the new dashboard, not the old spreadsheet. thanks, joe"
)

GROUNDED = [
    f"Summarise this article in three sentences:\n\n{ARTICLE}",
    f"Rewrite this email so it is formal and correctly capitalised:\n\n{EMAIL}",
    f"Extract every number in this text, with what it refers to, as a list:\n\n{ARTICLE}",
    f"Rename the function total_price to order_total everywhere in this code and show the full code:\n\n{CODE}",
    f"Add a docstring to each function of this code and show the full code:\n\n{CODE}",
    f"Repeat this email, fixing only its spelling and punctuation:\n\n{EMAIL}",
    f"Rewrite this article as a bulleted list of facts:\n\n{ARTICLE}",
    f"Convert this code to use a generator expression with sum() and show the full code:\n\n{CODE}",
]
CHAT = [
    "Write a short poem about the sea at night.",
    "What are some good habits for learning a new language?",
    "Tell me a story about a robot who wants to become a chef.",
    "Why is the sky blue? Explain it to a ten year old.",
    "Give me three ideas for a weekend trip in the mountains.",
    "What should I consider when adopting a dog?",
    "Describe your ideal breakfast.",
    "How do I stay motivated when working from home?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the default trained model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    p.add_argument("--quantization", default=None, choices=["int8", "int4"], help="the target's weights")
    p.add_argument("--speculative", default="ngram", help="ngram (default) or draft:<model>")
    p.add_argument(
        "--draft-quantization",
        default=None,
        choices=["int8", "int4"],
        help="the draft model's weights (draft:<model> only)",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--speculative-max-batch", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="alternating runs per side")
    p.add_argument("--batch", type=int, default=32, help="batch size of the throughput case; 0 skips it")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--step-costs",
        type=_step_costs,
        default=None,
        help="step prices of verifying 0..k tokens for the replayed column, comma-separated "
        "(default: the engine's measured spec_decode_step_costs)",
    )
    p.add_argument("--out", default="bench-results")


def _step_costs(text: str) -> list[float]:
    """``--step-costs``: 1 (a plain step) then the price of each further verified token, non-decreasing."""
    try:
        costs = [float(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers, got {text!r}") from None
    if len(costs) < 2 or costs[0] != 1.0 or any(b < a for a, b in zip(costs, costs[1:])):
        raise argparse.ArgumentTypeError(f"1 then non-decreasing prices, got {text!r}")
    return costs


def _replayed(llm: Any, prompts: list[list[int]], outs: list[list[int]], costs: list[float]) -> float:
    """Median over the prompts of the decode speedup the n-gram proposer's replay predicts."""
    replay = llm.engine.spec.proposer.replay
    rates = [(len(o) - 1) / replay(p, o, costs)[2] for p, o in zip(prompts, outs) if len(o) > 1]
    return statistics.median(rates) if rates else 1.0


def _batch1(
    llm: Any, prompts: list[str], params: Any, prompt_ids: Optional[list] = None
) -> tuple[float, list[list[int]], dict]:
    """Median decode tokens/s over the prompts, one request at a time; outputs; spec counter deltas. The
    prompts' token ids go to ``prompt_ids`` when given."""
    before = llm.stats()
    rates, outs = [], []
    for p in prompts:
        o = llm.chat([{"role": "user", "content": p}], params)[0]
        outs.append(o.token_ids)
        if prompt_ids is not None:
            prompt_ids.append(list(o.prompt_token_ids))
        if len(o.token_ids) > 1 and o.e2e_s > o.ttft_s:
            rates.append((len(o.token_ids) - 1) / (o.e2e_s - o.ttft_s))
    after = llm.stats()
    return (
        statistics.median(rates),
        outs,
        {
            k: after[k] - before[k]
            for k in (
                "spec_decode_proposed_tokens",
                "spec_decode_accepted_tokens",
                "spec_decode_verifications",
            )
        },
    )


def _batched(llm: Any, prompts: list[str], params: Any) -> tuple[float, int]:
    conv = [[{"role": "user", "content": p}] for p in prompts]
    t = time.perf_counter()
    outs = llm.chat(conv, params)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    return n / dt, n


def run(args: argparse.Namespace) -> int:
    import os

    from sidecar import LLM, SamplingParams
    from sidecar.bench.report import format_table, write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        speculative=args.speculative,
        speculative_draft_quantization=args.draft_quantization,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_max_batch=args.speculative_max_batch,
    )
    llm.engine.runner.zeroing.wait()  # the KV pool's background commit ends before any timing
    n = args.output_tokens
    sides = {"off": SamplingParams(max_tokens=n, speculative=False), "on": SamplingParams(max_tokens=n)}
    rows = []
    costs = args.step_costs or llm.stats()["spec_decode_step_costs"]
    for name, prompts in (("input-grounded", GROUNDED), ("open-ended chat", CHAT)):
        _batch1(llm, prompts[:2], sides["on"])  # warm-up (allocator, first-touch of the KV pool)
        rates: dict[str, list[float]] = {"off": [], "on": []}
        outs: dict[str, list] = {}
        spec: dict = {}
        prompt_ids: list = []
        for _ in range(args.repeats):
            for side, params in sides.items():
                r, o, d = _batch1(llm, prompts, params, prompt_ids if not prompt_ids else None)
                rates[side].append(r)
                outs[side] = o
                if side == "on":
                    spec = d
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        same = sum(a == b for a, b in zip(outs["off"], outs["on"]))
        rows.append(
            {
                "case": f"batch 1, {name}",
                "off_tok_s": off,
                "on_tok_s": on,
                "speedup": on / off,
                "acceptance": spec["spec_decode_accepted_tokens"]
                / max(spec["spec_decode_proposed_tokens"], 1),
                "tokens_per_verify": 1
                + spec["spec_decode_accepted_tokens"] / max(spec["spec_decode_verifications"], 1),
                "greedy_identical": f"{same}/{len(prompts)}",
                "replayed": _replayed(llm, prompt_ids, outs["off"], costs)
                if args.speculative == "ngram"
                else "",
            }
        )
        print(format_table(rows[-1:], list(rows[-1])), flush=True)
    if args.batch:
        prompts = [(GROUNDED + CHAT)[i % 16] for i in range(args.batch)]
        _batched(llm, prompts, sides["on"])
        tput: dict[str, list[float]] = {"off": [], "on": []}
        before = llm.stats()
        for _ in range(args.repeats):
            for side, params in sides.items():
                tput[side].append(_batched(llm, prompts, params)[0])
        after = llm.stats()
        d = {
            k: after[k] - before[k]
            for k in (
                "spec_decode_proposed_tokens",
                "spec_decode_accepted_tokens",
                "spec_decode_verifications",
            )
        }
        off, on = statistics.median(tput["off"]), statistics.median(tput["on"])
        # Speculation switches off while speculative_max_batch or more requests run: with no verification
        # at all the two sides ran the same code, and their ratio is the machine's noise.
        rows.append(
            {
                "case": f"batch {args.batch}, mixed",
                "off_tok_s": off,
                "on_tok_s": on,
                "speedup": on / off,
                "acceptance": (
                    d["spec_decode_accepted_tokens"] / d["spec_decode_proposed_tokens"]
                    if d["spec_decode_proposed_tokens"]
                    else "no step speculated"
                ),
                "tokens_per_verify": (
                    1 + d["spec_decode_accepted_tokens"] / d["spec_decode_verifications"]
                    if d["spec_decode_verifications"]
                    else ""
                ),
                "greedy_identical": "",
                "replayed": "",
            }
        )
    cols = list(rows[0])
    print(format_table(rows, cols))
    info = llm.engine.model_info
    jpath, ppath = write_report(
        args.out,
        "spec",
        {
            "command": "sidecar bench spec",
            "args": {k: v for k, v in vars(args).items() if k != "_run"},
            "model": info["model"],
            "dtype": info["dtype"],
            "quantization": info["quantization"],
            "speculative": args.speculative,
            "step_costs": costs,
            "loadavg": os.getloadavg(),
            "results": rows,
        },
        bars={
            "tokens/s": {f"{r['case']} {side}": r[f"{side}_tok_s"] for r in rows for side in ("off", "on")}
        },
    )
    print(f"wrote {jpath} and {ppath}")
    return 0
