"""Command line: ``sidecar serve | demo-model | bench ... | quantize``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so
``sidecar --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional

# glibc's malloc asks the kernel for transparent huge pages for its large chunks (the weights, the KV
# cache) with this tunable, which it reads only when a process starts.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"

COMMANDS = {
    "serve": ("sidecar.server.app", "run the gRPC + OpenAI HTTP sidecar"),
    "demo-model": (
        "sidecar.model.demo",
        "build the offline demo model (random weights, byte-level tokenizer)",
    ),
    "quantize": ("sidecar.model.quantize_cli", "write an int8/int4 quantized checkpoint"),
}

BENCHMARKS = {
    "throughput": (
        "sidecar.bench.throughput",
        "offline throughput vs HF generate / generate_batch, roofline",
    ),
    "prefix": ("sidecar.bench.prefix", "prefix caching: shared system prompt and multi-turn scenarios"),
    "spec": (
        "sidecar.bench.spec",
        "speculative decoding (n-gram or draft model): batch-1 decode and batch-32 throughput, on vs off",
    ),
    "structured": (
        "sidecar.bench.structured",
        "guided decoding (JSON schema) overhead per output token vs free text",
    ),
    "quant": ("sidecar.bench.quant", "bf16 vs int8 vs int4: memory, load time, speed, quality"),
    "kv": (
        "sidecar.bench.kv",
        "KV memory: long-context decode int8 vs plain KV cache; TTFT from the offload tiers",
    ),
    "quality": (
        "sidecar.bench.quality",
        "perplexity, top-1 agreement and KL vs full precision; decode speed",
    ),
    "serve": ("sidecar.bench.serve", "load generator over gRPC or the OpenAI HTTP API"),
    "soak": (
        "sidecar.bench.soak",
        "memory soak: N mixed requests against a real server, RSS sampled and plotted",
    ),
    "grammar-stall": (
        "sidecar.bench.grammar_stall",
        "heavy output constraints from one tenant vs /health and another tenant's small request",
    ),
    "semantic-cache": ("sidecar.bench.semantic_cache", "semantic cache precision/recall and latency"),
    "fleet": (
        "sidecar.bench.fleet",
        "multi-turn conversations over N replicas: cached prompt share with session "
        "affinity vs round-robin vs one replica",
    ),
    "beam": (
        "sidecar.bench.beam",
        "beam search (width 4) throughput vs transformers' beam search in the same run",
    ),
    "kv-eviction": (
        "sidecar.bench.kv_eviction",
        "bounded KV: passkey accuracy, perplexity, KV memory and decode speed of h2o and streaming "
        "eviction at 25/50/100%% budgets against the full cache",
    ),
    "lora": (
        "sidecar.bench.lora",
        "multi-LoRA: 4 adapters mixed in one batch vs the base model alone; "
        "per-token cost of one more adapter",
    ),
    "moe": (
        "sidecar.bench.moe",
        "mixture of experts: batch-1 decode and weight bytes per token vs active parameters, per precision",
    ),
    "hybrid": (
        "sidecar.bench.hybrid",
        "linear-attention hybrids (Qwen3.5): batch-1 decode vs llama.cpp per context; cache bytes vs dense",
    ),
}


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_text: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            return  # command not part of this build
        raise
    p = sub.add_parser(
        name,
        help=help_text,
        description=(mod.__doc__ or help_text).strip().splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sidecar", description="LLM inference sidecar")
    from sidecar import __version__

    parser.add_argument("--version", action="version", version=f"llm-sidecar {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Import only the module of the command being run (the others just get a stub entry).
    wanted = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        if wanted == name:
            _add(sub, name, module, help_text)
        else:
            sub.add_parser(name, help=help_text)
    bench = sub.add_parser("bench", help="benchmarks (write JSON + PNG reports)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK")
    wanted_bench = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, (module, help_text) in BENCHMARKS.items():
        if wanted_bench == name:
            _add(bench_sub, name, module, help_text)
        else:
            bench_sub.add_parser(name, help=help_text)
    return parser


def reexec_with_huge_pages() -> None:
    """Run this command again, once, with ``HUGE_PAGES_TUNABLE`` set (Linux). A decode step reads every
    weight once; in 2 MiB pages instead of 4 KiB ones the TLB stops missing every few kilobytes (the gain:
    docs/perf/code-notes.md). Kernels where transparent huge pages are off ignore it. Left alone when
    ``GLIBC_TUNABLES`` is already set (by the user, or by the first run) or ``SIDECAR_HUGE_PAGES=0``."""
    if (
        sys.platform != "linux"
        or "GLIBC_TUNABLES" in os.environ
        or os.environ.get("SIDECAR_HUGE_PAGES", "1").strip().lower() in ("0", "false", "no", "off")
    ):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, dict(os.environ, GLIBC_TUNABLES=HUGE_PAGES_TUNABLE))


def main(argv: Optional[list[str]] = None) -> None:
    if argv is None:  # the command line itself (not a call from Python): restart with huge pages first
        reexec_with_huge_pages()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        if args.command == "bench":
            parser.parse_args(["bench", "--help"])
        parser.print_help()
        sys.exit(2)
    try:
        sys.exit(run(args) or 0)
    except ValueError as exc:  # configuration errors name the field; no traceback for the user
        print(f"sidecar {args.command}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
