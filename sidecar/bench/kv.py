"""KV memory: long-context decode with the int8 KV cache against the plain one, and TTFT of a shared
document whose prefix blocks were evicted, served from the offload tiers against recomputing it.

attention: our CPU decode-attention kernel alone, one step of ``--batch`` rows at ``--context`` tokens over
``--layers`` distinct caches (as many bytes as the model's cache would read), plain cache vs int8.

decode: ``--batch`` requests with distinct ``--context``-token prompts, per KV cache dtype (``--kv-dtypes``)
on fresh engines in one run. Each batch is prefilled once (max_tokens=1), then run again so every full block
is a prefix-cache hit and the step time is the decode of ``--decode-tokens`` tokens over the long contexts:
decode tokens/s (from the moment the last request has its first token), and the pool's capacity in tokens
for the same ``--kv-cache-gb`` budget.

offload: a ``--doc-tokens`` document followed by a short question. TTFT when recomputed (first request),
then after a filler prompt pushed every document block out of the pool: from the host (RAM) tier, from the
disk tier (a second engine with only a disk tier; the files are in the page cache, as on a busy host), and
from the disk tier after a restart (a third engine on the same directory). Every answer is checked
against the recomputed one.
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model (default: the default model, SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (the plain KV cache has it)")
    p.add_argument(
        "--parts",
        default="attention,decode,offload",
        help="comma-separated: attention (the decode attention kernel alone), decode, offload",
    )
    p.add_argument(
        "--heads", default="9,3,64", help="attention: query heads, KV heads, head size (SmolLM2-135M's)"
    )
    p.add_argument("--layers", type=int, default=30, help="attention: layers (distinct caches) per step")
    p.add_argument("--repeats", type=int, default=5, help="attention: steps timed (the fastest is reported)")
    p.add_argument("--kv-dtypes", default="auto,int8", help="KV cache dtypes compared by the decode part")
    p.add_argument("--batch", type=int, default=16, help="decode: concurrent requests")
    p.add_argument("--context", type=int, default=2048, help="decode: prompt tokens per request")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode: tokens generated per request")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="decode: KV budget of every engine")
    p.add_argument("--doc-tokens", type=int, default=4096, help="offload: tokens of the shared document")
    p.add_argument("--offload-gb", type=float, default=2.0, help="offload: host tier size")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default="bench-results", help="output directory for JSON + PNG")


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(100, vocab) for _ in range(n)]


def _decode(args: argparse.Namespace, kv_dtype: str) -> dict[str, Any]:
    from sidecar import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=kv_dtype,
        kv_cache_memory_gb=args.kv_cache_gb,
        max_num_batched_tokens=max(2048, args.context),
        max_num_seqs=max(args.batch, 16),
    )
    vocab = llm.engine.vocab_size
    prompts = [_tokens(args.context, i, vocab) for i in range(args.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))  # prefill; blocks stay cached
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.decode_tokens + 1, ignore_eos=True))
    total = time.perf_counter() - t0
    first = max(o.ttft_s for o in outs)
    decode_s = max(o.e2e_s for o in outs) - first
    s = llm.stats()
    row = {
        "kv_cache_dtype": llm.engine.model_info["kv_cache_dtype"],
        "batch": args.batch,
        "context": args.context,
        "decode_tok_s": args.batch * args.decode_tokens / decode_s,
        "decode_s": decode_s,
        "total_s": total,
        "kv_cache_tokens": s["kv_cache_tokens"],
        "kv_cache_gb": args.kv_cache_gb,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
        "num_preemptions": s["num_preemptions"],
    }
    del llm
    gc.collect()
    return row


def _attention(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The decode attention alone (our CPU kernel), one step over ``--layers`` layers of distinct caches, for
    the plain cache (``--dtype``) and int8: the part of a decode step that reads the KV cache."""
    import torch

    from sidecar.model import kv_quant
    from sidecar.model.kernels.cpu import paged_attention as kernel

    nh, nkv, hd = (int(x) for x in args.heads.split(","))
    bs, b, ctx = 16, args.batch, args.context
    nb = -(-ctx // bs)
    dtype = getattr(torch, args.dtype)
    tables = torch.arange(1, b * nb + 1).view(b, nb)
    lens = torch.full((b,), ctx, dtype=torch.long)
    q = torch.randn(b, nh, hd).to(dtype)
    rows = []
    for kv_dtype in (dtype, torch.int8):
        layers = []
        for _ in range(args.layers):
            cache = kv_quant.allocate(b * nb + 1, bs, nkv, hd, kv_dtype, torch.device("cpu"))
            x = torch.randn(2, (b * nb + 1) * bs, nkv, hd)
            if kv_dtype == torch.int8:
                kv_quant.write(cache, x[0], x[1], torch.arange(x.shape[1]))
            else:
                cache[0].view(-1, nkv, hd).copy_(x[0])
                cache[1].view(-1, nkv, hd).copy_(x[1])
            layers.append(cache)
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for c in layers:
                kernel.decode_attention(q, c[0], c[1], tables, lens, hd**-0.5, None, c[2:] or None)
            best = min(best, time.perf_counter() - t0)
        kv_bytes = sum(t.numel() * t.element_size() for c in layers for t in c)
        rows.append(
            {
                "kv_cache_dtype": kv_quant.kv_dtype_name(kv_dtype),
                "batch": b,
                "context": ctx,
                "layers": args.layers,
                "step_ms": best * 1e3,
                "kv_mib": kv_bytes / 2**20,
            }
        )
        del layers
    for r in rows:
        r["speedup"] = rows[0]["step_ms"] / r["step_ms"]
    return rows


def _ttft(llm, prompt: list[int]) -> tuple[float, Any]:
    from sidecar import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    return time.perf_counter() - t0 if out.ttft_s is None else out.ttft_s, out


def _offload(args: argparse.Namespace) -> list[dict[str, Any]]:
    from sidecar import LLM

    block = 16
    pool_blocks = -(-(args.doc_tokens + 64) // block) + 4  # the document and its answer, little more
    common = dict(
        model=args.model, dtype=args.dtype, num_kv_blocks=pool_blocks + 1, max_num_batched_tokens=2048
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sidecar-kv-bench-") as tier_dir:

        def scenario(name: str, llm, doc: list[int], filler: list[int], q: int, base=None):
            question = _tokens(16, 1000 + q, llm.engine.vocab_size)
            ttft_first, first = _ttft(llm, doc + question)
            if base is None:
                rows.append(
                    {"tier": "recompute", "ttft_s": ttft_first, "cached_tokens": first.num_cached_tokens}
                )
            if filler:
                _ttft(llm, filler)
                ttft, out = _ttft(llm, doc + question)
            else:  # after a restart the first request is the one the disk tier serves
                ttft, out = ttft_first, first
            s = llm.stats()
            rows.append(
                {
                    "tier": name,
                    "ttft_s": ttft,
                    "cached_tokens": out.num_cached_tokens,
                    "loaded_blocks": s["kv_offload_loaded_blocks"],
                    "load_s": s["kv_offload_load_time_s"],
                    "same_tokens": out.token_ids == (base or first).token_ids,
                }
            )
            return first

        llm = LLM(kv_offload_gb=args.offload_gb, **common)
        vocab = llm.engine.vocab_size
        # Warm-up: the prefill shapes of a whole document and of a cached one (kernels are prepared per shape
        # on first use, once per process), so no measured request pays for it.
        warm = _tokens(args.doc_tokens + 16, 99, vocab)
        _ttft(llm, warm)
        _ttft(llm, warm)
        doc = _tokens(args.doc_tokens, 7, vocab)
        filler = _tokens(pool_blocks * block - 32, 8, vocab)
        base = scenario("ram", llm, doc, filler, 1)
        del llm
        gc.collect()
        llm = LLM(kv_offload_dir=tier_dir, **common)
        scenario("disk", llm, doc, filler, 1, base)
        del llm
        gc.collect()
        llm = LLM(kv_offload_dir=tier_dir, **common)  # a restart: only the directory is left
        scenario("disk_after_restart", llm, doc, [], 1, base)
        del llm
        gc.collect()
    recompute = rows[0]["ttft_s"]
    for r in rows:
        r["speedup_vs_recompute"] = recompute / r["ttft_s"]
    return rows


def run(args: argparse.Namespace) -> int:
    import torch

    from sidecar.bench.report import format_table, machine_info, write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"attention", "decode", "offload"}:
        raise ValueError(f"--parts: choose from attention, decode, offload, got {args.parts!r}")
    payload: dict[str, Any] = {
        "benchmark": "kv",
        "model": args.model or "default",
        "dtype": args.dtype,
        "isa": machine_info().get("cpu"),
    }
    bars: dict[str, dict[str, float]] = {}
    if "attention" in parts:
        rows = _attention(args)
        print(
            format_table(
                rows, ["kv_cache_dtype", "batch", "context", "layers", "step_ms", "speedup", "kv_mib"]
            ),
            flush=True,
        )
        payload["attention"] = rows
        bars["decode attention per step (ms)"] = {r["kv_cache_dtype"]: r["step_ms"] for r in rows}
    if "decode" in parts:
        rows = [_decode(args, d.strip()) for d in args.kv_dtypes.split(",") if d.strip()]
        for r in rows:
            r["decode_vs_first"] = r["decode_tok_s"] / rows[0]["decode_tok_s"]
            r["tokens_vs_first"] = r["kv_cache_tokens"] / rows[0]["kv_cache_tokens"]
        print(
            format_table(
                rows,
                [
                    "kv_cache_dtype",
                    "batch",
                    "context",
                    "decode_tok_s",
                    "decode_vs_first",
                    "kv_cache_tokens",
                    "tokens_vs_first",
                    "num_preemptions",
                ],
            ),
            flush=True,
        )
        payload["decode"] = rows
        bars["decode tok/s"] = {r["kv_cache_dtype"]: r["decode_tok_s"] for r in rows}
        bars["KV tokens in the same budget"] = {r["kv_cache_dtype"]: r["kv_cache_tokens"] for r in rows}
    if "offload" in parts:
        rows = _offload(args)
        print(
            format_table(
                rows,
                [
                    "tier",
                    "ttft_s",
                    "speedup_vs_recompute",
                    "cached_tokens",
                    "loaded_blocks",
                    "load_s",
                    "same_tokens",
                ],
            ),
            flush=True,
        )
        payload["offload"] = {"doc_tokens": args.doc_tokens, "rows": rows}
        bars["TTFT of the evicted document (s)"] = {r["tier"]: r["ttft_s"] for r in rows}
    jpath, ppath = write_report(args.out, "kv", payload, bars)
    print(f"wrote {jpath} and {ppath}")
    return 0
