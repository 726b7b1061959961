"""Mixture-of-experts decode: batch-1 tokens/s and the weight bytes a token reads, set against the model's active
parameters (what a token must read) and its total (what reading every expert would cost), per precision, with
the peak RSS of each engine.

Bytes read: during one-row steps, forward hooks on the served model's modules add up the bytes of the weights
each called module holds (packed, tiled or quantized, as held; for a table looked up by token id, the rows
looked up). A picked expert's layers count once per call, an unpicked expert's not at all, so the decoder
layers' bytes per token against their active parameters say whether a token reads only its experts.

Resident expert bytes: what the experts' modules hold (weights and biases, as held). On an MXFP4 checkpoint
(gpt-oss) the ``mxfp4`` row keeps the experts' codes (``mxfp4.Mxfp4Linear``), the ``dequant`` row loads the same
checkpoint with the experts dequantized to bf16 at load, as a device without the MXFP4 kernel holds them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

MXFP4_CODES_ENV = "SIDECAR_MXFP4_CODES"  # 0: the loader dequantizes MXFP4 experts (sidecar.model.mxfp4)
PRECISIONS = {"bf16": None, "int8": "int8", "int4": "int4", "mxfp4": None, "dequant": None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="qwen3-30b-a3b-2l",
        help="checkpoint dir or a random benchmark shape: qwen3-30b-a3b-2l | qwen3-30b-a3b-12l | gpt-oss-20b-2l",
    )
    p.add_argument(
        "--precisions",
        default="bf16,int8,int4",
        help="comma-separated: bf16, int8, int4; on an MXFP4 checkpoint mxfp4 (codes kept), dequant (bf16)",
    )
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per timed request")
    p.add_argument("--group-size", type=int, default=128, help="int4 quantization group size")
    p.add_argument("--count-steps", type=int, default=4, help="one-row steps whose weight reads are counted")
    p.add_argument("--out", default="bench-results", help="output directory for JSON + PNG")


def _own_bytes(module) -> int:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _count_reads(model, vocab: int) -> tuple[dict[str, int], list]:
    """Hooks adding each called module's weight bytes to ``counts['bytes']`` (split into ``layers`` for the
    decoder layers) and the steps (calls of the final norm) to ``counts['steps']``. A sparse block's gate and
    experts count at the block: its gate, and each expert its rows picked once (the grouped expert kernels read
    the weights without calling the experts' modules)."""
    counts = {"bytes": 0, "layers": 0, "steps": 0, "paused": False}
    layer_modules = {id(m) for m in model.layers.modules()}
    sparse = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts")]
    routed = {id(m) for block in sparse for part in (block.experts, block.gate) for m in part.modules()}

    # q/k head norms may run inside their attention's projection rows (a kernel call, not the module's
    # forward): their weights count with the attention module that reads them.
    def head_norms(m) -> list:
        return [n for n in (getattr(m, "q_norm", None), getattr(m, "k_norm", None)) if n is not None]

    folded = {id(n) for m in model.modules() for n in head_norms(m)}
    handles = []
    for module in model.modules():
        if id(module) in folded or id(module) in routed:
            continue
        size = _own_bytes(module) + sum(_own_bytes(n) for n in head_norms(module))
        if not size:
            continue
        in_layers = id(module) in layer_modules

        def hook(m, inputs, output, size=size, in_layers=in_layers) -> None:
            if counts["paused"]:
                return
            x = inputs[0] if inputs else None
            ids = x is not None and not x.is_floating_point()
            read = size * x.numel() // vocab if ids else size  # a table looked up reads its rows
            counts["bytes"] += read
            counts["layers"] += read if in_layers else 0

        handles.append(module.register_forward_hook(hook))
    for block in sparse:
        handles.append(
            block.register_forward_hook(lambda m, inputs, output: _count_block(m, inputs[0], counts))
        )
    handles.append(
        model.norm.register_forward_hook(lambda *_: counts.__setitem__("steps", counts["steps"] + 1))
    )
    return counts, handles


def _count_block(block, x, counts: dict) -> None:
    """A sparse block's reads in one call: its gate, and every expert some row picked, once (the block's own
    router over the same rows, its modules' hooks paused)."""
    counts["paused"] = True
    try:
        ids = block.route_logits(block.gate(x), x.dtype)[1]
    finally:
        counts["paused"] = False
    picked = sorted(set(ids.reshape(-1).tolist()))
    read = _own_bytes(block.gate) + sum(_own_bytes(m) for e in picked for m in block.experts[e].modules())
    counts["bytes"] += read
    counts["layers"] += read


def _expert_bytes(model) -> int:
    """Bytes the experts' modules of every sparse layer hold (parameters and buffers, as held)."""
    sparse = [layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts")]
    return sum(_own_bytes(m) for experts in sparse for m in experts.modules())


def _layer_params(cfg: dict, info: dict) -> tuple[int, int]:
    """(total, active) parameters of the decoder layers: the model's less its embedding, head and final norm."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    outside = v * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
    return info["total_parameters"] - outside, info["active_parameters"] - outside


def _measure(model_dir: str, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    from sidecar import LLM, SamplingParams
    from sidecar.bench.rss import peak_rss_bytes, reset_peak

    reset_peak()
    previous = os.environ.get(MXFP4_CODES_ENV)
    os.environ[MXFP4_CODES_ENV] = "0" if precision == "dequant" else "1"
    try:
        llm = LLM(
            model=model_dir,
            dtype="bfloat16",
            quantization=PRECISIONS[precision],
            quant_group_size=args.group_size,
            max_num_seqs=4,
            kv_cache_memory_gb=0.25,
        )
    finally:
        if previous is None:
            os.environ.pop(MXFP4_CODES_ENV)
        else:
            os.environ[MXFP4_CODES_ENV] = previous
    info = llm.engine.model_info
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    model = llm.engine.loaded.model
    counts, handles = _count_reads(model, info["vocab_size"])
    # a one-token prompt: every counted step, its prefill too, is one row; the steps run eagerly (a replayed
    # step calls no module), then replays come back for the timed run
    plans = llm.engine.runner.cpu_plans
    replays, plans.enabled = plans.enabled, False
    try:
        llm.generate([[11]], SamplingParams(max_tokens=args.count_steps, ignore_eos=True))
    finally:
        plans.enabled = replays
        for h in handles:
            h.remove()
    steps = max(counts["steps"], 1)
    prompt = [3 + j % 200 for j in range(8)]
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    out = llm.generate([prompt], SamplingParams(max_tokens=args.tokens, ignore_eos=True))[0]
    decode_s = out.e2e_s - out.ttft_s
    layer_total, layer_active = _layer_params(cfg, info)
    row = {
        "precision": precision,
        "b1_decode_tok_s": (args.tokens - 1) / decode_s if decode_s > 0 else float("nan"),
        "total_params": info["total_parameters"],
        "active_params": info["active_parameters"],
        "bytes_per_token": counts["bytes"] / steps,
        "layer_bytes_per_token": counts["layers"] / steps,
        "layer_active_params": layer_active,
        "layer_total_params": layer_total,
        "expert_mib": _expert_bytes(model) / 2**20,
        "peak_rss_mib": (peak_rss_bytes() or 0) / 2**20,
        "cpu_decode_replay": info.get("cpu_decode_replay"),
    }
    # bytes a layer weight takes at this precision if nothing but the active parameters were read
    row["layer_bytes_per_active_param"] = row["layer_bytes_per_token"] / layer_active
    row["layer_bytes_per_total_param"] = row["layer_bytes_per_token"] / layer_total
    del llm, model
    gc.collect()
    return row


def run(args: argparse.Namespace) -> int:
    from sidecar.bench.models import SHAPES, random_checkpoint
    from sidecar.bench.report import format_table, write_report

    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for p in precisions:
        if p not in PRECISIONS:
            raise ValueError(f"precisions: {p!r} is not one of {', '.join(PRECISIONS)}")
    t0 = time.perf_counter()
    model_dir = str(random_checkpoint(args.model)) if args.model in SHAPES else args.model
    print(f"checkpoint: {model_dir} ({time.perf_counter() - t0:.0f}s)", flush=True)
    rows = []
    for p in precisions:
        rows.append(_measure(model_dir, p, args))
        print(format_table(rows[-1:], list(rows[-1])), flush=True)
    columns = [
        "precision",
        "b1_decode_tok_s",
        "layer_bytes_per_token",
        "layer_bytes_per_active_param",
        "layer_bytes_per_total_param",
        "bytes_per_token",
        "expert_mib",
        "peak_rss_mib",
    ]
    print(format_table(rows, columns))
    bars = {
        "batch-1 decode tok/s": {r["precision"]: r["b1_decode_tok_s"] for r in rows},
        "layer bytes per active parameter": {r["precision"]: r["layer_bytes_per_active_param"] for r in rows},
    }
    json_path, _ = write_report(args.out, "moe", {"model": args.model, "rows": rows}, bars=bars)
    print(f"report: {json_path}")
    return 0
