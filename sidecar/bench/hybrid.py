"""Hybrid linear-attention models (Qwen3.5): batch-1 decode tok/s at each context length against llama.cpp on
the same checkpoint, and the cache bytes a token costs against a dense model of the same width.

Decode: one request of ``C`` prompt tokens, then ``--tokens`` generated; tok/s over the generated tokens after
the first (prefill excluded). llama.cpp: ``llama-bench -n TOKENS -d C`` (its decode after a context of C
tokens) on the GGUF its converter makes of the same checkpoint. The load average is recorded next to each
figure: on a shared machine only the ratios of one run compare.

Attention share: the full-attention layers' paged decode attention alone (our kernel, the model's head
counts and cache dtype, the same threads; median of repeated calls over a cache of ``C`` tokens) a token at
each context. A hybrid model's step may grow with the context by that much only (its linear layers keep a
fixed-size state): ``beyond_attention_ms`` is the step's growth from the shortest context less the attention's
growth, about zero when the rest of the step does not depend on the context.

Cache bytes: the engine's own cache groups (``model_info['cache_groups']``): the attention layers' KV bytes a
token, plus the linear-attention state's bytes a sequence spread over its ``C`` tokens; the dense model of the
same width is the same model with every layer a full-attention one (the attention layers' KV bytes a token
scaled to all layers).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from sidecar.bench import llamacpp


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3.5-0.8b", help="checkpoint dir or a random benchmark shape")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32 (llama.cpp: BF16 | F32)")
    p.add_argument("--contexts", default="128,1024", help="comma-separated context lengths (prompt tokens)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per timed request")
    p.add_argument("--threads", type=int, default=None, help="threads of both engines (default: torch's)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp baseline")
    llamacpp.add_arguments(p)
    p.add_argument("--out", default="bench-results", help="output directory for JSON + PNG")


def cache_bytes(llm, context: int) -> dict[str, float]:
    """Cache bytes a token at ``context`` tokens a sequence: ours (the attention layers' KV plus the state
    spread over the context) and the dense model's of the same width (that KV over every layer)."""
    info = llm.engine.model_info
    groups = {g["kind"]: g for g in info["cache_groups"]}
    kv = groups["attention"]
    kv_token = kv["bytes"] / (kv["tokens"] + info["block_size"])  # the pool holds one block past its tokens
    state = groups.get("linear_attention", {}).get("bytes_per_sequence", 0)
    ours = kv_token + state / context
    dense = kv_token * llm.engine.loaded.args.num_layers / kv["layers"]
    return {
        "kv_bytes_per_token": kv_token,
        "state_bytes_per_seq": state,
        "cache_bytes_per_token": ours,
        "dense_bytes_per_token": dense,
        "cache_vs_dense": ours / dense,
    }


def attention_ms(llm, context: int, calls: int = 20) -> float:
    """Milliseconds a token of the attention layers' paged decode attention at ``context`` tokens: one kernel
    call per layer that keeps a cache, over a cache of the engine's block size and dtype, median of
    ``calls`` timed calls (after one warm-up) times the layers."""
    import statistics

    import torch

    from sidecar.model.kernels.cpu import paged_attention

    a = llm.engine.loaded.args
    dtype = llm.engine.runner.kv_dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"attention share: times a float cache, not {dtype}")
    bs = llm.engine.runner.block_size
    shapes = a.kv_shapes()
    nblocks = (context + bs - 1) // bs
    gen = torch.Generator().manual_seed(0)
    table = torch.arange(nblocks, dtype=torch.long).view(1, nblocks)
    ctx = torch.tensor([context], dtype=torch.long)
    total = 0.0
    for (nkv, hd), n in {s: shapes.count(s) for s in shapes}.items():
        k = torch.randn(nblocks, bs, nkv, hd, generator=gen).to(dtype)
        v = torch.randn(nblocks, bs, nkv, hd, generator=gen).to(dtype)
        q = torch.randn(1, a.num_heads, hd, generator=gen).to(dtype)
        args = (q, k, v, table, ctx, hd**-0.5)
        if paged_attention.decode_attention(*args) is None:
            raise RuntimeError("attention share: the paged decode attention kernel refused the model's cache")
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            paged_attention.decode_attention(*args)
            times.append(time.perf_counter() - t)
        total += statistics.median(times) * n
    return total * 1e3


def _ours(model_dir: str, args: argparse.Namespace, contexts: list[int]) -> list[dict[str, Any]]:
    import torch

    from sidecar import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    longest = max(contexts) + args.tokens + 8
    llm = LLM(
        model=model_dir,
        dtype=args.dtype,
        max_num_seqs=1,
        max_model_len=longest,
        kv_cache_memory_gb=0.25 + longest * 65536 / 2**30,
    )
    llm.generate([[5] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    rows = []
    for c in contexts:
        prompt = [3 + (7 * j) % 997 for j in range(c)]
        out = llm.generate([prompt], SamplingParams(max_tokens=args.tokens, ignore_eos=True))[0]
        decode_s = out.e2e_s - out.ttft_s
        row = {"context": c, "b1_decode_tok_s": (args.tokens - 1) / decode_s, "load_avg": os.getloadavg()[0]}
        row["step_ms"] = 1e3 / row["b1_decode_tok_s"]
        row["attention_ms"] = attention_ms(llm, c)
        if rows:  # the growth from the shortest context, less what the attention layers add
            first = rows[0]
            row["beyond_attention_ms"] = (row["step_ms"] - first["step_ms"]) - (
                row["attention_ms"] - first["attention_ms"]
            )
        rows.append(dict(row, **cache_bytes(llm, c)))
    return rows


def run(args: argparse.Namespace) -> int:
    from sidecar.bench.models import SHAPES, bench_cache_dir, random_checkpoint
    from sidecar.bench.report import format_table, write_report

    contexts = sorted(int(c) for c in args.contexts.split(",") if c.strip())
    if not contexts or min(contexts) < 1:
        raise ValueError(f"contexts: {args.contexts!r} must list positive token counts")
    model_dir = str(random_checkpoint(args.model)) if args.model in SHAPES else args.model
    rows = _ours(model_dir, args, contexts)
    tools = None if args.no_llama_cpp else llamacpp.find_tools(args.llama_cpp, args.llama_cpp_src)
    if tools:
        import torch

        threads = args.threads or torch.get_num_threads()
        gguf = llamacpp.gguf_for(tools, model_dir, args.dtype, bench_cache_dir() / "gguf", ("--no-mtp",))
        for row in rows:
            t0 = os.getloadavg()[0]
            res = llamacpp.llama_bench(tools, gguf, 0, args.tokens, threads, 2, ("-d", str(row["context"])))
            row.update(llama_cpp_tok_s=res["tok_s"], llama_cpp_load_avg=(t0 + os.getloadavg()[0]) / 2)
            row["vs_llama_cpp"] = row["b1_decode_tok_s"] / res["tok_s"]
    columns = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "state_bytes_per_seq"]
    print(format_table(rows, columns))
    bars = {"batch-1 decode tok/s": {str(r["context"]): r["b1_decode_tok_s"] for r in rows}}
    meta = {"model": args.model, "dtype": args.dtype, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    json_path, _ = write_report(args.out, "hybrid", dict(meta, rows=rows), bars=bars)
    print(f"report: {json_path}")
    return 0
