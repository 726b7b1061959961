"""Bounded-KV decoding, quality and cost: ``h2o`` and ``streaming`` eviction at budgets of a fraction of
the context, against the full cache, on the same model in the same run.

- Passkey retrieval: a five-digit number hidden at a varying depth of ``--context`` tokens of filler text,
  asked for at the end; accuracy is the share of greedy answers that contain it.
- Perplexity of long natural text (``sidecar/bench/data/heldout_en.txt``, its first ``--context`` tokens)
  from the prompt's log-probabilities (``SamplingParams(prompt_logprobs=0)``): under a budget the prompt is
  computed in chunks that fit it, each chunk attending to the kept KV only.
- KV memory per sequence (the budget in bytes: kept tokens x layers x K and V x KV heads x head size x
  element size) and batch-1 decode speed after the context (tokens per second after the first token, from
  one generation's end-to-end time less its time to first token).
- Decode speed at long contexts (``--speed-contexts``, each capped at the model's context length less the
  generated tokens): the full cache against each policy at ``--speed-budget`` percent of that context,
  after a prompt of filler text. Speeds depend on the machine's load; the load average is reported.

A budget is a percentage of the context (rounded down to whole blocks, at least the smallest budget); 100%
holds the whole context and the generated tokens, so nothing is evicted there.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from pathlib import Path
from typing import Any

from sidecar.bench.report import format_table

TEXT_PATH = Path(__file__).parent / "data" / "heldout_en.txt"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the default trained model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8"],
        help="the KV cache's element type in every case, the full cache included (int8 with a budget: a "
        "bounded cache in 8 bits)",
    )
    p.add_argument("--context", type=int, default=1024, help="tokens of filler / text before the question")
    p.add_argument("--budgets", default="25,50,100", help="comma-separated budgets, %% of the context")
    p.add_argument("--policies", default="h2o,streaming", help="comma-separated eviction policies")
    p.add_argument("--passkeys", type=int, default=5, help="passkey trials per case (depths spread evenly)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens per decode-speed measurement")
    p.add_argument(
        "--speed-contexts",
        default="4096,16384",
        help="comma-separated contexts (tokens) of the long decode-speed comparison, each capped at the "
        "model's context length; empty for none",
    )
    p.add_argument(
        "--speed-budget", type=int, default=50, help="budget of that comparison, %% of its context"
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results")


def _passkey_prompt(tok: Any, context: int, depth: float, key: int) -> list[int]:
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    filler = tok.encode(FILLER * (context // 8), add_special_tokens=False)
    room = context - len(tok.encode(needle + QUESTION, add_special_tokens=False))
    filler = filler[:room]
    cut = int(len(filler) * depth)
    return (
        filler[:cut]
        + tok.encode(needle, add_special_tokens=False)
        + filler[cut:]
        + tok.encode(QUESTION, add_special_tokens=False)
    )


def _case_params(policy: str, budget: int | None, **kw: Any) -> Any:
    from sidecar import SamplingParams

    if budget is None:
        return SamplingParams(**kw)
    return SamplingParams(kv_budget=budget, kv_eviction=policy, **kw)


def _passkey(llm: Any, prompts: list[tuple[list[int], int]], policy: str, budget: int | None) -> float:
    outs = llm.generate([p for p, _ in prompts], _case_params(policy, budget, max_tokens=8))
    return sum(str(key) in o.text for o, (_, key) in zip(outs, prompts)) / len(prompts)


def _perplexity(llm: Any, text: list[int], policy: str, budget: int | None) -> float:
    out = llm.generate([text], _case_params(policy, budget, max_tokens=1, prompt_logprobs=0))[0]
    lps = out.prompt_logprobs[1:]
    return math.exp(-sum(lps) / len(lps))


def _decode_speed(llm: Any, prompt: list[int], policy: str, budget: int | None, n: int) -> float:
    """Tokens per second after the first of ``n`` (``n >= 2``) greedy tokens after ``prompt``."""
    out = llm.generate([prompt], _case_params(policy, budget, max_tokens=n, ignore_eos=True))[0]
    return (len(out.token_ids) - 1) / max(out.e2e_s - out.ttft_s, 1e-9)


def _long_speeds(llm: Any, args: argparse.Namespace, bs: int) -> list[dict[str, Any]]:
    """The full cache against each policy at ``--speed-budget`` of each of ``--speed-contexts``."""
    rows: list[dict[str, Any]] = []
    top = llm.engine.model_info["max_model_len"] - args.decode_tokens - 1
    for asked in (int(c) for c in args.speed_contexts.split(",") if c.strip()):
        context = min(asked, top)
        prompt = llm.tokenizer.encode(FILLER * (context // 8 + 1), add_special_tokens=False)[:context]
        budget = max(3 * bs, context * args.speed_budget // 100 // bs * bs)
        # a first generation at this length, not timed: the full cache's run would otherwise be the one
        # that meets the context's first-time costs (decode plans of wider block tables, pages first touched)
        _decode_speed(llm, prompt, "full", None, 2)
        full = None
        for policy, b in [("full", None)] + [(p, budget) for p in args.policies.split(",")]:
            tok_s = _decode_speed(llm, prompt, policy, b, args.decode_tokens)
            full = full or tok_s
            row = {"context": context, "asked": asked, "policy": policy, "budget_tokens": b or "all"}
            row.update(decode_tok_s=tok_s, vs_full=tok_s / full, loadavg=os.getloadavg()[0])
            rows.append(row)
            print(format_table([row], list(row)), flush=True)
    return rows


def run(args: argparse.Namespace) -> int:
    import torch

    from sidecar import LLM
    from sidecar.bench.report import machine_info, write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(
        model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False
    )
    info, tok = llm.engine.model_info, llm.tokenizer
    bs = info["block_size"]
    # The pool holds block 0 (padding) beside the usable blocks.
    bytes_per_token = info["kv_cache_bytes"] / ((info["num_kv_blocks"] + 1) * bs)
    rng = random.Random(args.seed)
    depths = [(i + 0.5) / args.passkeys for i in range(args.passkeys)]
    keys = [
        (_passkey_prompt(tok, args.context, d, k), k)
        for d, k in ((d, rng.randrange(10000, 99999)) for d in depths)
    ]
    text = tok.encode(TEXT_PATH.read_text(), add_special_tokens=False)[: args.context]
    if len(text) < args.context:
        print(f"the held-out text has {len(text)} tokens; perplexity over those")
    cases: list[tuple[str, int | None, str]] = [("full", None, "100% (no budget)")]
    for pct in (int(b) for b in args.budgets.split(",")):
        if pct >= 100:  # the context and every generated token, in whole blocks: nothing evicted
            budget = -(-(args.context + max(8, args.decode_tokens + 1)) // bs) * bs
        else:
            budget = max(3 * bs, args.context * pct // 100 // bs * bs)
        cases += [(p, budget, f"{pct}%") for p in args.policies.split(",")]
    rows = []
    for policy, budget, label in cases:
        t = time.perf_counter()
        row = {
            "policy": policy,
            "budget": label,
            "budget_tokens": budget or "all",
            "passkey_acc": _passkey(llm, keys, policy, budget),
            "ppl": _perplexity(llm, text, policy, budget),
            "kv_mib_per_seq": (budget or args.context + args.decode_tokens) * bytes_per_token / 2**20,
            "decode_tok_s": _decode_speed(llm, keys[0][0], policy, budget, args.decode_tokens),
        }
        row["seconds"] = time.perf_counter() - t
        rows.append(row)
        print(format_table([row], list(row)), flush=True)
    full = rows[0]
    for r in rows:
        r["ppl_increase_pct"] = 100 * (r["ppl"] / full["ppl"] - 1)
        r["passkey_delta_pts"] = 100 * (r["passkey_acc"] - full["passkey_acc"])
    print()
    print(format_table(rows, list(rows[0])))
    speeds = _long_speeds(llm, args, bs)
    if speeds:
        print()
        print(format_table(speeds, list(speeds[0])))
        capped = sorted({r["asked"] for r in speeds if r["asked"] != r["context"]})
        if capped:
            print(f"contexts {capped} capped at the model's {info['max_model_len']} tokens")
    print(
        f"\ncontext {args.context} tokens, {args.passkeys} passkeys, model {info['model']} ({info['dtype']}); "
        f"load average {os.getloadavg()[0]:.2f} on {machine_info().get('cpu', 'this CPU')}"
    )
    jpath, ppath = write_report(
        args.out,
        "kv-eviction",
        {
            "command": "sidecar bench kv-eviction",
            "args": {k: v for k, v in vars(args).items() if k != "_run"},
            "model": info["model"],
            "dtype": info["dtype"],
            "kv_bytes_per_token": bytes_per_token,
            "loadavg": os.getloadavg(),
            "results": rows,
            "decode_speed": speeds,
        },
        bars={
            "passkey accuracy": {f"{r['policy']} {r['budget']}": r["passkey_acc"] for r in rows},
            "perplexity": {f"{r['policy']} {r['budget']}": r["ppl"] for r in rows},
        },
    )
    print(f"wrote {jpath} and {ppath}")
    return 0
