"""Beam search throughput: ``LLM.beam_search`` against Hugging Face transformers' beam search
(``generate(num_beams=W)``) in the same run, same checkpoint, same dtype, same prompts (for a GGUF file we
quantize on load, such as the default model under ``--dtype auto``, transformers runs its float32 checkpoint).

Every prompt runs ``--output-tokens`` steps of ``--beam-width`` beams (``ignore_eos``; HF without an EOS
id), so both systems do the same number of beam steps. HF gets all prompts in one left-padded batch (its
fastest way to run several prompts); our engine runs every prompt's beams in one continuous batch. The two
cases alternate over ``--repeats`` rounds and each reports its median; throughput is prompts x output
tokens per wall second, and per CPU second of this process (on a machine shared with other work, wall time
also measures the neighbours). The report also counts prompts whose best sequence is the same in both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

PROMPTS = [
    "The history of the printing press begins",
    "A good way to learn to cook is",
    "The three most important things about sleep are",
    "In the middle of the forest there was",
    "Spring Boot applications are configured with",
    "The best advice for a new programmer is",
    "On a cold winter morning the city",
    "To make a cup of tea, first",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the default trained model)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="float32 runs the default model dequantized, the checkpoint transformers loads too",
    )
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1, help="alternating rounds over the two cases")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench-results")


def _ours(llm: Any, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, float, list]:
    from sidecar import BeamSearchParams

    params = BeamSearchParams(
        beam_width=args.beam_width,
        max_tokens=args.output_tokens,
        ignore_eos=True,
        length_penalty=args.length_penalty,
    )
    t, c = time.perf_counter(), time.process_time()
    outs = llm.beam_search(prompts, params)
    return time.perf_counter() - t, time.process_time() - c, [o.sequences[0].token_ids for o in outs]


def _hf(
    model: Any, prompts: list[list[int]], pad: int, args: argparse.Namespace
) -> tuple[float, float, list]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t, c = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            num_beams=args.beam_width,
            num_return_sequences=1,
            do_sample=False,
            early_stopping=False,
            max_new_tokens=args.output_tokens,
            min_new_tokens=args.output_tokens,
            length_penalty=args.length_penalty,
            eos_token_id=None,
            pad_token_id=pad,
        )
    return time.perf_counter() - t, time.process_time() - c, [row[width:].tolist() for row in out]


def _baseline(args: argparse.Namespace, info: dict) -> tuple[Any, str]:
    """(directory, dtype) transformers runs: the engine's own checkpoint in its dtype; where we quantized on
    load (the default model's int4 under ``--dtype auto``), the float32 checkpoint the engine reads for
    ``dtype="float32"``, what a transformers user runs (the report then compares int4 against float32 and
    says so); (None, "") where that is itself quantized (a hub-quantized directory)."""
    if info["quantization"] == "none":
        return info["model_dir"], info["dtype"]
    from sidecar import LLM

    fp = LLM(model=args.model, dtype="float32", num_kv_blocks=4).engine.model_info
    return (fp["model_dir"], "float32") if fp["quantization"] == "none" else (None, "")


def run(args: argparse.Namespace) -> int:
    import torch

    from sidecar import LLM
    from sidecar.bench.report import format_table, machine_info, write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype=args.dtype)
    llm.engine.runner.zeroing.wait()  # the KV pool's background commit ends before any timing
    info = llm.engine.model_info
    prompts = [llm.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)]
    cases: dict[str, Any] = {"sidecar": lambda: _ours(llm, prompts, args)}
    hf_dir, hf_dtype = _baseline(args, info)
    if not args.no_hf and hf_dir is None:
        print(
            f"transformers cannot load the {info['quantization']} checkpoint: no baseline (use --dtype float32)"
        )
    elif not args.no_hf:
        from transformers import AutoModelForCausalLM

        print(f"transformers: {hf_dir} in {hf_dtype}")
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, hf_dtype)).eval()
        pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
        cases["transformers"] = lambda: _hf(hf, prompts, pad, args)
        _hf(hf, prompts[:1], pad, argparse.Namespace(**{**vars(args), "output_tokens": 2}))  # warm-up
    _ours(llm, prompts[:1], argparse.Namespace(**{**vars(args), "output_tokens": 2}))  # warm-up
    secs: dict[str, list[float]] = {c: [] for c in cases}
    cpu: dict[str, list[float]] = {c: [] for c in cases}
    best: dict[str, list] = {}
    for _ in range(args.repeats):
        for case, fn in cases.items():
            dt, ct, best[case] = fn()
            secs[case].append(dt)
            cpu[case].append(ct)
    tokens = args.prompts * args.output_tokens
    rows = []
    for case in cases:
        dt, ct = statistics.median(secs[case]), statistics.median(cpu[case])
        rows.append(
            {
                "system": case,
                "prompts": args.prompts,
                "beam_width": args.beam_width,
                "tokens": tokens,
                "seconds": dt,
                "tok_s": tokens / dt,
                "cpu_seconds": ct,
                "tok_per_cpu_s": tokens / ct,
            }
        )
    print(format_table(rows, list(rows[0])))
    summary: dict[str, Any] = {}
    if len(rows) == 2:
        summary = {
            "speedup_vs_hf": rows[0]["tok_s"] / rows[1]["tok_s"],
            "speedup_vs_hf_cpu": rows[0]["tok_per_cpu_s"] / rows[1]["tok_per_cpu_s"],
            "same_best_sequence": sum(a == b for a, b in zip(best["sidecar"], best["transformers"])),
        }
        print(
            f"\nbeam width {args.beam_width}, {args.prompts} prompts x {args.output_tokens} tokens: "
            f"{summary['speedup_vs_hf']:.2f}x transformers' beam search throughput (target >= 3x), "
            f"{summary['speedup_vs_hf_cpu']:.2f}x per CPU second; same best sequence for "
            f"{summary['same_best_sequence']}/{args.prompts} prompts; load average {os.getloadavg()[0]:.2f} "
            f"on {machine_info().get('cpu', 'this CPU')}"
        )
    jpath, ppath = write_report(
        args.out,
        "beam",
        {
            "command": "sidecar bench beam",
            "args": {k: v for k, v in vars(args).items() if k != "_run"},
            "model": info["model"],
            "dtype": info["dtype"],
            "quantization": info["quantization"],
            "transformers": {"model_dir": str(hf_dir), "dtype": hf_dtype}
            if "transformers" in cases
            else None,
            "loadavg": os.getloadavg(),
            "results": rows,
            **summary,
        },
        bars={"tokens/s": {r["system"]: r["tok_s"] for r in rows}},
    )
    print(f"wrote {jpath} and {ppath}")
    return 0
