"""Quality of the served model per compute mode: perplexity, top-1 agreement and KL vs full precision.

The reference is the model in float32 (a GGUF file dequantized exactly). Every
other mode -- bf16, int8 (per-channel, requantized), int4 (for a Q4_0/Q4_1
GGUF: the file's own codes, loaded exactly; otherwise quantized on load), int4
with float32 around the kernels, bf16 with the int8 KV cache (``--modes bf16,bf16+kv-int8`` puts it
against the bf16 KV cache; ``--window 2048`` scores long contexts) -- is scored on the same held-out English text
(``sidecar/bench/data/heldout_en.txt``, written for this benchmark, never
published before, so no model trained on it): teacher-forced perplexity over
windows of ``--window`` tokens, and at every position the top-1 agreement and
KL(reference || mode) of the next-token distributions. Batch-1 greedy decode
speed is measured per mode through ``LLM.generate`` (EOS ignored, best of
``--repeats``), so quality and speed of each default candidate sit side by side.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

TEXT_PATH = Path(__file__).parent / "data" / "heldout_en.txt"
# label -> (dtype, quantization, KV cache dtype); the first is the reference.
MODES = {
    "fp32": ("float32", None, "auto"),
    "bf16": ("bfloat16", None, "auto"),
    "int8": ("bfloat16", "int8", "auto"),
    "int4": ("bfloat16", "int4", "auto"),
    "int4+fp32": ("float32", "int4", "auto"),
    "bf16+kv-int8": ("bfloat16", None, "int8"),  # bf16 weights, int8 KV cache (compare with bf16)
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model (default: the default model, SmolLM2-135M-Instruct)")
    p.add_argument(
        "--modes",
        default=",".join(m for m in MODES if m != "bf16+kv-int8"),
        help=f"comma-separated subset of {', '.join(MODES)}",
    )
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument(
        "--max-windows", type=int, default=0, help="limit the number of windows (0 = the whole text)"
    )
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens per batch-1 decode measurement")
    p.add_argument("--repeats", type=int, default=3, help="decode measurements per mode (best is reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default="bench-results", help="output directory for JSON + PNG")


def _windows(ids: list[int], window: int, limit: int) -> list[list[int]]:
    wins = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    wins = [w for w in wins if len(w) >= 2]
    return wins[:limit] if limit else wins


def _decode_tok_s(llm, n: int, repeats: int) -> float:
    from sidecar import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate(["Warm-up."], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.generate(["The history of the lighthouse begins"], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0 - (out.ttft_s or 0.0)
        best = max(best, (len(out.token_ids) - 1) / dt)
    return best


def run(args: argparse.Namespace) -> int:
    import torch

    from sidecar import LLM
    from sidecar.bench.quant import sequence_logits
    from sidecar.bench.report import format_table, machine_info, write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    text = TEXT_PATH.read_text(encoding="utf-8")
    ref = None
    rows: list[dict[str, Any]] = []
    for label in modes:
        dtype, quant, kv_dtype = MODES[label]
        t0 = time.perf_counter()
        llm = LLM(
            model=args.model,
            dtype=dtype,
            quantization=quant,
            device="cpu",
            kv_cache_memory_gb=0.25,
            kv_cache_dtype=kv_dtype,
        )
        load_s = time.perf_counter() - t0
        loaded = llm.engine.loaded
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        wins = _windows(ids, args.window, args.max_windows)
        nll_sum, count, lps = 0.0, 0, []
        for w in wins:
            lp = sequence_logits(loaded, w, kv_dtype).log_softmax(-1)[:-1]
            nll_sum += float(-lp.gather(1, torch.tensor(w[1:])[:, None]).sum())
            count += len(w) - 1
            lps.append(lp)
        lp = torch.cat(lps)
        row: dict[str, Any] = {
            "mode": label,
            "dtype": dtype,
            "quantization": loaded.quantization or "none",
            "kv_cache_dtype": llm.engine.model_info["kv_cache_dtype"],
            "perplexity": float(torch.tensor(nll_sum / count).exp()),
            "tokens": count,
            "load_s": load_s,
        }
        if ref is None:
            ref = lp
        else:
            row["kl_vs_ref"] = float((ref.exp() * (ref - lp)).sum(-1).mean())
            row["top1_agree_vs_ref"] = float((ref.argmax(-1) == lp.argmax(-1)).float().mean())
        row["decode_tok_s_b1"] = _decode_tok_s(llm, args.decode_tokens, args.repeats)
        rows.append(row)
        print(format_table([row], list(row)), flush=True)
        del llm, loaded, lps, lp
    base = rows[0]["perplexity"]
    for r in rows:
        r["ppl_vs_ref"] = r["perplexity"] / base
    cols = [
        "mode",
        "quantization",
        "kv_cache_dtype",
        "perplexity",
        "ppl_vs_ref",
        "top1_agree_vs_ref",
        "kl_vs_ref",
        "decode_tok_s_b1",
    ]
    print(format_table(rows, cols))
    payload = {
        "benchmark": "quality",
        "model": args.model or "default",
        "text": str(TEXT_PATH.name),
        "window": args.window,
        "rows": rows,
        "reference": modes[0],
        "isa": machine_info().get("cpu"),
    }
    bars = {
        "perplexity (lower is better)": {r["mode"]: r["perplexity"] for r in rows},
        "top-1 agreement vs reference": {r["mode"]: r.get("top1_agree_vs_ref", 1.0) for r in rows},
        "batch-1 decode (tok/s)": {r["mode"]: r["decode_tok_s_b1"] for r in rows},
    }
    jpath, ppath = write_report(args.out, "quality", payload, bars)
    print(f"wrote {jpath} and {ppath}")
    return 0
