"""Offline throughput: our engine vs HF generate (static padded batches) vs HF generate_batch.

All three run the same model, dtype and mixed workload (random prompt and
output lengths, fixed seed, EOS ignored so every system produces exactly the
requested tokens). Also measures batch-1 decode speed against the
memory-bandwidth roofline: bytes of weights read per token / measured read
bandwidth, and the prefill speed of one --prefill-tokens prompt. On CPU, llama.cpp
(``--llama-cpp``) and vLLM's CPU backend (``--vllm-cpu VENV``) run the same figures
in the same run. Every system's peak RSS is reported next to its speed.

``--rounds N`` runs N workloads (seeds seed..seed+N-1) through every system in turn, the order rotating from
round to round, with our engine and vLLM-CPU loaded throughout: on a machine whose speed drifts (a shared
host), each round compares the systems on the same work within minutes, and the totals over the rounds are
the figures (each round's ratio reported too).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import time
from typing import Any

import torch

from sidecar.model.attention import sdpa_backends


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"range {text!r}: expected LO:HI with 1 <= LO <= HI")
    return a, b


def make_workload(
    n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, min(vocab, 30000)) for _ in range(rng.randint(*prompt))], rng.randint(*output))
        for _ in range(n)
    ]


def measure_bandwidth(gib: float = 1.0, repeats: int = 5, device: str = "cpu") -> float:
    """Sustained read bandwidth of ``device``'s memory in bytes/s (a sum over a buffer far larger than the
    caches; on CUDA the GPU's HBM, timed after a synchronize)."""
    dev = torch.device(device)
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32, device=dev)
    x.sum()
    _sync(dev)
    t = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    _sync(dev)
    dt = (time.perf_counter() - t) / repeats
    return x.numel() * 4 / dt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes a decode step must read: every module's parameters and buffers once, except the embedding
    table (one row is read); a layer holding its weight packed and plain (or tiled) reads one of them; a sparse
    block's experts (a module with ``experts`` and ``top_k``) count ``top_k`` of them, what a token reads."""
    total, seen, share = 0, set(), {}
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, torch.nn.ModuleList) and getattr(module, "top_k", 0):
            share.update((id(m), module.top_k / len(experts)) for m in experts.modules())
    for module in model.modules():
        if module is model.embed_tokens:
            continue
        weight = getattr(module, "weight", None)
        packed = getattr(module, "packed", None) is not None
        for name, t in list(module.named_parameters(recurse=False)) + list(
            module.named_buffers(recurse=False)
        ):
            if name.startswith("rope_") or id(t) in seen or (packed and (t is weight or name == "tiled")):
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size() * share.get(id(module), 1.0)
    return int(total)


def prefill_prompts(n_tokens: int, vocab: int, seed: int, count: int = 3) -> list[list[int]]:
    """``count`` distinct prompts of ``n_tokens`` for the prefill figure (distinct: no prefix-cache hits)."""
    rng = random.Random(seed + 7919)
    return [[rng.randrange(3, min(vocab, 30000)) for _ in range(n_tokens)] for _ in range(count)]


def load_ours(args: argparse.Namespace, work: list[tuple[list[int], int]]):
    """Our engine loaded as the bench runs it, warmed up on the workload's first prompt."""
    from sidecar import LLM, SamplingParams
    from sidecar.bench.rss import reset_peak

    reset_peak()
    llm = LLM(
        model=args.model_dir,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gb=args.kv_cache_gb,
        device=args.device,
        quantization=getattr(args, "quantization", None),
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pipeline_micro_batches=args.pipeline_micro_batches,
        **({"enforce_eager": True} if args.enforce_eager else {}),
    )
    llm.engine.runner.zeroing.wait()  # the KV pool's background commit ends before any timing
    llm.generate([work[0][0][:16]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    return llm


def ours_workload(llm, args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """One timed run of the workload through ``llm.generate``."""
    from sidecar import SamplingParams

    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=args.temperature) for _, n in work]
    steps, preempted = llm.engine.counters["num_steps"], llm.engine.scheduler.num_preemptions
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=True)
    dt = time.perf_counter() - t
    out_tokens = sum(len(o.token_ids) for o in outs)
    return {
        "system": "llm-sidecar",
        "seconds": dt,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / dt,
        "steps": llm.engine.counters["num_steps"] - steps,
        "preemptions": llm.engine.scheduler.num_preemptions - preempted,
    }


def ours_speed(
    llm, args: argparse.Namespace, work: list[tuple[list[int], int]], prompts: list[list[int]]
) -> dict[str, Any]:
    """Batch-1 decode and prefill: each the fastest of 3 runs."""
    from sidecar import SamplingParams

    # Batch-1 decode speed: one request, decode time only, the fastest of 3 runs (llama-bench's figure
    # below is the fastest of its 3 runs too).
    n = args.b1_tokens
    rates = []
    for _ in range(3):
        o = llm.generate([work[0][0][:32]], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        rates.append((n - 1) / (o.e2e_s - o.ttft_s))
    # Prefill: one request of --prefill-tokens at a time, timed to its first token, the fastest of 3
    # (the vLLM-CPU baseline times the same prompts the same way; prompts new to the prefix cache).
    prefill = []
    for p in prompts:
        t = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=1, ignore_eos=True))
        prefill.append(len(p) / (time.perf_counter() - t))
    return {"b1_decode_tok_s": max(rates), "prefill_tok_s": max(prefill)}


def stub_forward(llm) -> None:
    """Replace the model's forward and head in ``llm``'s engine: every step returns hidden states and one
    fixed logits row per sampled position (token 3 wins) without computing anything, so what a step still
    costs is the host's own work -- scheduling, KV block bookkeeping, input buffers, sampling over the
    vocabulary, detokenizing, the engine's Python. Decode replays and graphs are turned off (they would run
    the real layers)."""
    runner = llm.engine.runner
    model = runner.model
    runner.cpu_plans.disable("forward stubbed (bench throughput --stub-forward)")
    runner.graphs.clear()
    runner.fast_paths.cuda_graphs = False
    runner.set_decode_padding(False)
    vocab, hidden = model.args.vocab_size, model.args.hidden_size
    dev, dtype = runner.device, runner.dtype
    bufs: dict[str, torch.Tensor] = {}

    def rows(name: str, n: int, width: int, dt: torch.dtype) -> torch.Tensor:
        if name not in bufs or bufs[name].shape[0] < n:
            bufs[name] = torch.zeros(max(n, 256), width, device=dev, dtype=dt)
            if name == "logits":
                bufs[name][:, 3] = 1.0
        return bufs[name][:n]

    model.forward = lambda ids, *a, **k: rows("hidden", ids.shape[0], hidden, dtype)
    model.compute_logits = lambda h: rows("logits", h.shape[0], vocab, torch.float32)


def host_steps(llm, args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """The workload through ``llm`` with the forward stubbed (``stub_forward``): wall time of every engine
    step, grouped by how many requests ran in it. ``full_batch_step_ms`` is the median step while
    ``max_num_seqs`` requests decode together: the per-step host time at that batch size."""
    import statistics

    from sidecar import SamplingParams

    stub_forward(llm)
    eng = llm.engine
    times: list[tuple[int, float]] = []
    step = eng.step

    def timed_step():
        n = len(eng.scheduler.running)
        t = time.perf_counter()
        out = step()
        times.append((n, time.perf_counter() - t))
        return out

    eng.step = timed_step
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=args.temperature) for _, n in work]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    wall = time.perf_counter() - t
    eng.step = step
    full = [dt for n, dt in times if n >= args.max_num_seqs]
    return {
        "system": "llm-sidecar, forward stubbed",
        "requests": len(work),
        "max_num_seqs": args.max_num_seqs,
        "steps": len(times),
        "seconds": wall,
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "mean_step_ms": 1e3 * wall / max(len(times), 1),
        "full_batch_steps": len(full),
        "full_batch_step_ms": 1e3 * statistics.median(full) if full else None,
        "full_batch_step_ms_p90": 1e3 * sorted(full)[int(0.9 * (len(full) - 1))] if full else None,
    }


def ours_info(llm) -> dict[str, Any]:
    """Peak RSS and what the engine ran with, after the measurements."""
    from sidecar.bench.rss import peak_rss_bytes

    res: dict[str, Any] = {"peak_rss_bytes": peak_rss_bytes()}
    res["weight_bytes_per_token"] = weight_bytes_per_token(llm.engine.loaded.model)
    # What the weights hold in memory: a layer keeping a plain copy beside its packed one counts both.
    model = llm.engine.loaded.model
    res["weights_held_mib"] = (
        sum(
            t.numel() * t.element_size()
            for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
        )
        / 2**20
    )
    # Which device fast paths served the run (graphs, kernels, sampler) and why any fell back.
    res["fast_paths"] = llm.engine.model_info.get("fast_paths", [])
    res["fast_path_fallbacks"] = llm.engine.model_info.get("fast_path_fallbacks", {})
    # On CPU: whether decode steps were replayed from C (and why not), planned when first seen; how the linear
    # layers held their weights.
    for key in (
        "cpu_decode_replay",
        "cpu_decode_replay_reason",
        "cpu_decode_planned",
        "cpu_decode_planned_reason",
        "cpu_linear_layouts",
    ):
        if key in llm.engine.model_info:
            res[key] = llm.engine.model_info[key]
    return res


def combine_rounds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's workload rows over the rounds as one: seconds and tokens summed (every system ran the same
    workloads), peak RSS the largest, each round's seconds kept (``round_seconds``)."""
    out = dict(rows[0])
    if len(rows) > 1:
        for key in ("seconds", "output_tokens", "steps", "preemptions"):
            if key in out:
                out[key] = sum(r[key] for r in rows)
        out["output_tok_s"] = out["output_tokens"] / out["seconds"]
        if any(r.get("peak_rss_bytes") for r in rows):
            out["peak_rss_bytes"] = max(r.get("peak_rss_bytes") or 0 for r in rows)
    out["round_seconds"] = [r["seconds"] for r in rows]
    return out


def best_figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's speed figures over the rounds: each rate the fastest round's (``<key>_by_round`` keeps them
    all); anything else as the first round gave it."""
    out = dict(rounds[0])
    for key, value in rounds[0].items():
        if key.endswith("_tok_s") and isinstance(value, (int, float)):
            out[key] = max(r[key] for r in rounds)
            out[f"{key}_by_round"] = [r[key] for r in rounds]
    return out


PHASES = ("workload", "figures")


def interleave(rounds: int, systems: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, list]]:
    """``rounds`` rounds of every phase (``PHASES``: the workload, then the batch-1 and prefill figures) through
    every system, back to back, the order rotating from round to round, so that a machine whose speed drifts
    (a shared host) moves every system alike and each round compares them on the same work within minutes.
    ``systems``: (name, {phase: run(round) -> dict}), ours first; a system without a phase skips it. A baseline
    that fails (RuntimeError) is reported and left out of the later rounds and the results; a failure of ours is
    raised. Returns {name: {phase: [one dict a round]}}."""
    got: dict[str, dict[str, list]] = {name: {phase: [] for phase in fns} for name, fns in systems}
    live = list(systems)
    for r in range(rounds):
        order = live[r % len(live) :] + live[: r % len(live)]
        for phase in PHASES:
            for name, fns in order:
                if phase not in fns or name not in got:
                    continue
                try:
                    got[name][phase].append(fns[phase](r))
                except RuntimeError as exc:
                    if name == systems[0][0]:
                        raise
                    print(f"{name} failed in round {r + 1}, reported without it: {exc}", flush=True)
                    live = [s for s in live if s[0] != name]
                    del got[name]
        if rounds > 1:
            print(
                f"round {r + 1}/{rounds}: "
                + ", ".join(
                    f"{name} {got[name]['workload'][-1]['seconds']:.1f} s"
                    for name, _ in live
                    if got[name].get("workload")
                ),
                flush=True,
            )
    return got


def _hf_model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[
        args.baseline_dtype
    ]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    model.to(args.device)
    model.eval()
    return model


def _hf_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """HF generate's settings for the workload's decoding: greedy, or plain temperature sampling (no top-k,
    which HF otherwise applies by default)."""
    if args.temperature <= 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0}


def run_hf_static(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """HF generate over fixed batches in arrival order: left-padded prompts, each batch runs until
    its longest output is done; only the requested tokens count as output."""
    from tqdm.auto import tqdm

    from sidecar.bench.rss import peak_rss_bytes, reset_peak

    reset_peak()
    model = _hf_model(args)
    pad = 0
    useful = 0
    t = time.perf_counter()
    # the attention backends our engine allows on this device (on CUDA no cuDNN SDPA, whose plan build for every
    # new shape would cost HF's growing decode shapes tens of milliseconds a step): like for like
    with torch.inference_mode(), sdpa_backends(torch.device(args.device)):
        for i in tqdm(range(0, len(work), args.hf_batch_size), desc="hf static", unit="batch"):
            batch = work[i : i + args.hf_batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=args.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=args.device)
            max_new = max(n for _, n in batch)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                eos_token_id=None,
                pad_token_id=pad,
                **_hf_sampling(args),
            )
            useful += sum(n for _, n in batch)
    _sync(torch.device(args.device))
    dt = time.perf_counter() - t
    b1 = _hf_b1_decode(model, work[0][0][:32], args.b1_tokens, torch.device(args.device))
    peak = peak_rss_bytes()
    del model
    gc.collect()
    return {
        "system": f"HF generate (static, batch {args.hf_batch_size})",
        "seconds": dt,
        "output_tokens": useful,
        "output_tok_s": useful / dt,
        "peak_rss_bytes": peak,
        "b1_decode_tok_s": b1,
    }


def _hf_b1_decode(model, prompt: list[int], n: int, device: torch.device) -> float:
    """HF generate's batch-1 decode rate on the prompt ours is timed on: (n - 1) tokens over the time of an
    n-token generate minus a 1-token one (its prefill), the fastest of 3, as ours is measured."""
    ids = torch.tensor([prompt], device=device)

    def timed(new: int) -> float:
        t = time.perf_counter()
        with sdpa_backends(device):
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        _sync(device)
        return time.perf_counter() - t

    rates = []
    with torch.inference_mode():
        for _ in range(3):
            first = timed(1)
            rates.append((n - 1) / max(timed(n) - first, 1e-9))
    return max(rates)


def run_hf_generate_batch(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """HF's continuous batching manager (the engine behind generate_batch), with per-request lengths."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    from sidecar.bench.rss import peak_rss_bytes, reset_peak

    reset_peak()
    model = _hf_model(args)
    cfg = GenerationConfig(
        max_new_tokens=max(n for _, n in work), eos_token_id=-1, pad_token_id=0, **_hf_sampling(args)
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p, _ in work),
        max_generated_length=max(n for _, n in work),
        num_requests=len(work),
    )
    t = time.perf_counter()
    done = 0
    produced = 0
    with model.continuous_batching_context_manager(
        generation_config=cfg, block=True, timeout=30, workload_hints=hints
    ) as manager:
        for p, n in work:
            manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
        deadline = time.monotonic() + args.hf_timeout
        while done < len(work) and time.monotonic() < deadline:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                done += 1
                produced += len(r.generated_tokens)
    dt = time.perf_counter() - t
    peak = peak_rss_bytes()
    del model
    gc.collect()
    return {
        "system": "HF generate_batch (continuous)",
        "seconds": dt,
        "output_tokens": produced,
        "output_tok_s": produced / dt,
        "completed": done,
        "peak_rss_bytes": peak,
    }


def _llamacpp_tools(args: argparse.Namespace):
    """(tools, gguf, threads) of the llama.cpp baseline, or None (said so) when its tools are not found."""
    from sidecar.bench import llamacpp
    from sidecar.bench.models import bench_cache_dir

    tools = llamacpp.find_tools(args.llama_cpp, args.llama_cpp_src)
    if tools is None:
        print("llama.cpp baseline skipped: llama-bench/llama-server not found (--llama-cpp DIR or PATH)")
        return None
    threads = torch.get_num_threads()
    # With --quantization the llama.cpp baseline reads the GGUF of the same class (Q8_0 / Q4_0, the head
    # kept at 8 bits by llama-quantize, as ours is by default).
    precision = getattr(args, "quantization", None) or args.baseline_dtype
    gguf = llamacpp.gguf_for(tools, args.model_dir, precision, bench_cache_dir() / "gguf")
    print(f"llama.cpp baseline: {gguf.name}, {threads} threads", flush=True)
    return tools, gguf, threads


def _llamacpp_workload(args: argparse.Namespace, found, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    from sidecar.bench import llamacpp

    tools, gguf, threads = found
    return llamacpp.server_workload(
        tools, gguf, work, threads, args.llama_cpp_parallel, temperature=args.temperature
    )


def _llamacpp_figures(args: argparse.Namespace, found) -> dict[str, Any]:
    """llama-bench's batch-1 decode and prefill in the same precision class."""
    from sidecar.bench import llamacpp

    tools, gguf, threads = found
    res: dict[str, Any] = {"version": llamacpp.version(tools), "gguf": str(gguf), "threads": threads}
    b1 = llamacpp.llama_bench(tools, gguf, 0, args.b1_tokens, threads)
    pre = llamacpp.llama_bench(tools, gguf, args.prefill_tokens, 0, threads)
    res.update(
        b1_decode_tok_s=b1["best_tok_s"],
        b1_peak_rss_bytes=b1["peak_rss_bytes"],
        prefill_tok_s=pre["best_tok_s"],
    )
    return res


def _open_vllm_cpu(
    args: argparse.Namespace, works: list[list[tuple[list[int], int]]], prompts: list[list[list[int]]]
):
    """vLLM's CPU backend loaded for the workloads (``VllmCpu``; close it), or None (said so) when no
    ``--vllm-cpu VENV`` is given; RuntimeError when it fails to load."""
    from sidecar.bench.vllm_cpu import VllmCpu

    if not args.vllm_cpu:
        print("vLLM-CPU baseline skipped: no --vllm-cpu VENV")
        return None
    threads = torch.get_num_threads()
    longest = max(
        [len(p) + n for work in works for p, n in work]
        + [len(p) + 1 for ps in prompts for p in ps]
        + [32 + args.b1_tokens]
    )
    print(f"vLLM-CPU baseline: {args.vllm_cpu}, {threads} threads; loading (not timed) ...", flush=True)
    return VllmCpu(
        args.vllm_cpu,
        args.model_dir,
        args.baseline_dtype,
        threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=longest + 16,
        kv_cache_gb=args.kv_cache_gb,
        temperature=args.temperature,
    )


def _vllm_cpu_workload(vllm, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    return {"system": f"vLLM-CPU {vllm.version}", **vllm.call("workload", work=work)}


def _vllm_cpu_figures(
    args: argparse.Namespace, vllm, work: list[tuple[list[int], int]], prompts: list[list[int]]
) -> dict[str, Any]:
    """vLLM-CPU's batch-1 decode and prefill, measured as ours are."""
    b1 = vllm.call("b1", prompt=work[0][0][:32], n=args.b1_tokens, repeats=3)
    pre = vllm.call("prefill", prompts=prompts)
    return {
        "version": vllm.version,
        "load_s": vllm.load_s,
        "threads": vllm.threads,
        "b1_decode_tok_s": b1["b1_decode_tok_s"],
        "prefill_tok_s": pre["prefill_tok_s"],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="qwen2-0.5b",
        help="checkpoint dir, hub id, 'demo', or a random benchmark shape: qwen2-0.5b | small",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="compute dtype for every system; auto: what the engine picks for this hardware",
    )
    p.add_argument(
        "--baseline-dtype",
        default=None,
        choices=["bfloat16", "float32", "float16"],
        help="another dtype for the baselines (HF, llama.cpp, vLLM-CPU) than ours, e.g. float32 where a "
        "baseline has no fast bf16 path (vLLM-CPU on an AVX2-only CPU): each system at its best "
        "(default: ours)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4"],
        help="our engine's weights quantized on load (the output head at its default precision), and the "
        "llama.cpp baseline on the GGUF of the same class (Q8_0 / Q4_0); the HF and vLLM-CPU baselines run "
        "unquantized, so they are refused with it (pass --baselines=)",
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", default="32:512", help="uniform range LO:HI of prompt tokens")
    p.add_argument("--output-len", default="16:256", help="uniform range LO:HI of generated tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="workloads every system runs in turn (round r: seed + r, the order rotating each round; "
        "our engine and vLLM-CPU stay loaded throughout): the figures are the totals, each round "
        "reported, so that a machine whose speed drifts moves every system alike",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the workload's sampling temperature, every system alike (0: greedy; the batch-1 and "
        "prefill figures stay greedy)",
    )
    p.add_argument("--hf-batch-size", type=int, default=16, help="batch size of the static HF baseline")
    p.add_argument(
        "--hf-timeout", type=float, default=3600.0, help="give up on generate_batch after this long"
    )
    p.add_argument("--b1-tokens", type=int, default=64, help="tokens generated for the batch-1 decode figure")
    p.add_argument("--prefill-tokens", type=int, default=256, help="prompt tokens of the prefill figure")
    p.add_argument(
        "--baselines", default="hf-static,hf-batch", help="comma list of hf-static, hf-batch (empty for none)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda | cuda:N: where our engine and the HF baselines run (the same device)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="our engine without graphs or custom device kernels (the reference path)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="our engine's layers split across this many processes by columns and rows (ranks; each pinned "
        "to its share of the CPUs); the weight bytes reported are rank 0's",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="our engine's layers split over this many processes (stages; each pinned to its share of the "
        "CPUs); the weight bytes reported are stage 0's",
    )
    p.add_argument(
        "--pipeline-micro-batches",
        type=int,
        default=None,
        help="parts each step is cut into so that the stages overlap (default: one per stage; 1: in turn)",
    )
    p.add_argument(
        "--llama-cpp-parallel", type=int, default=32, help="llama-server -np for the llama.cpp baseline"
    )
    from sidecar.bench.llamacpp import add_arguments as add_llamacpp_arguments

    add_llamacpp_arguments(p)
    from sidecar.bench.vllm_cpu import add_arguments as add_vllm_cpu_arguments

    add_vllm_cpu_arguments(p)
    p.add_argument(
        "--stub-forward",
        action="store_true",
        help="measure the per-step host time only: our engine alone runs the workload with the model's "
        "forward replaced by fixed logits (scheduler, sampler, detokenizer and Python remain), e.g. "
        "--num-requests 256 --max-num-seqs 256 for the time of a step at batch 256",
    )
    p.add_argument("--out", default="bench-results")


def run(args: argparse.Namespace) -> int:
    from sidecar.bench.models import SHAPES, random_checkpoint
    from sidecar.bench.report import format_table, write_report
    from sidecar.model.loader import resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    args.model_dir = str(
        random_checkpoint(args.model) if args.model in SHAPES else resolve_model_dir(args.model)
    )
    import json

    from sidecar.model.hardware import isa_summary
    from sidecar.model.loader import pick_dtype_with_reason

    hf_config = json.loads(open(f"{args.model_dir}/config.json").read())
    vocab = hf_config["vocab_size"]
    # Every system runs the dtype the engine resolves, so the comparison stays like for like (unless
    # --baseline-dtype gives the baselines theirs).
    dtype, args.dtype_reason = pick_dtype_with_reason(args.dtype, hf_config, torch.device(args.device))
    args.requested_dtype, args.dtype = args.dtype, str(dtype).replace("torch.", "")
    where = (
        f"gpu: {torch.cuda.get_device_name(torch.device(args.device))}"
        if args.device.startswith("cuda")
        else f"cpu: {isa_summary()}"
    )
    args.baseline_dtype = args.baseline_dtype or args.dtype
    print(
        f"{where}; dtype {args.dtype} ({args.dtype_reason})"
        + ("" if args.baseline_dtype == args.dtype else f"; baselines in {args.baseline_dtype}")
    )
    if args.rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {args.rounds}")
    if args.quantization and ([b for b in args.baselines.split(",") if b] or args.vllm_cpu):
        raise ValueError(
            f"quantization: {args.quantization} applies to our engine and llama.cpp only; the HF and "
            "vLLM-CPU baselines run unquantized (pass --baselines= and no --vllm-cpu)"
        )
    works = [
        make_workload(
            args.num_requests,
            parse_range(args.prompt_len),
            parse_range(args.output_len),
            vocab,
            args.seed + r,
        )
        for r in range(args.rounds)
    ]
    work = works[0]
    if args.prefill_tokens < 1:
        raise ValueError(f"prefill-tokens: must be >= 1, got {args.prefill_tokens}")
    if not 0.0 <= args.temperature <= 100.0:
        raise ValueError(f"temperature: must be in [0, 100], got {args.temperature}")
    # the prefill figure's prompts, new ones each round (nothing for the prefix cache to find)
    prompts = [prefill_prompts(args.prefill_tokens, vocab, args.seed + r) for r in range(args.rounds)]
    if args.vllm_cpu:  # a missing venv fails here, before anything is measured
        from sidecar.bench.vllm_cpu import venv_python

        venv_python(args.vllm_cpu)
    print(
        f"workload: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
        f"{sum(n for _, n in work)} output tokens; model {args.model} ({args.dtype}"
        + (f", {args.quantization} weights" if args.quantization else "")
        + "); "
        f"{torch.get_num_threads()} threads"
        + (f"; sampled at temperature {args.temperature:g}" if args.temperature > 0 else "; greedy")
        + (
            f"; {args.rounds} rounds (seeds {args.seed}..{args.seed + args.rounds - 1}), every system in turn"
            if args.rounds > 1
            else ""
        )
    )
    on_cpu = args.device == "cpu"
    llm = load_ours(args, work)
    if args.stub_forward:
        row = host_steps(llm, args, work)
        print(format_table([row], list(row)))
        jpath, ppath = write_report(
            args.out,
            "throughput-host",
            {
                "command": "sidecar bench throughput --stub-forward",
                "where": where,
                "model": args.model,
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "result": row,
            },
            {"host ms per step": {"mean": row["mean_step_ms"], "full batch": row["full_batch_step_ms"] or 0}},
        )
        print(f"wrote {jpath} and {ppath}")
        return 0
    found = _llamacpp_tools(args) if on_cpu else None
    llama: dict[str, Any] = {}
    vllm: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        session = None
        if on_cpu:
            try:
                session = _open_vllm_cpu(args, works, prompts)
            except RuntimeError as exc:  # the other systems are still measured
                print(f"vLLM-CPU baseline failed, reported without it: {exc}", flush=True)
                vllm = {"error": str(exc)}
            if session is not None:
                stack.enter_context(session)
        systems: list[tuple[str, dict[str, Any]]] = [
            (
                "llm-sidecar",
                {
                    "workload": lambda r: ours_workload(llm, args, works[r]),
                    "figures": lambda r: ours_speed(llm, args, work, prompts[r]),
                },
            )
        ]
        if session is not None:
            systems.append(
                (
                    "vLLM-CPU",
                    {
                        "workload": lambda r: _vllm_cpu_workload(session, works[r]),
                        "figures": lambda r: _vllm_cpu_figures(args, session, work, prompts[r]),
                    },
                )
            )
        if found is not None:
            systems.append(
                (
                    "llama.cpp",
                    {
                        "workload": lambda r: _llamacpp_workload(args, found, works[r]),
                        "figures": lambda r: _llamacpp_figures(args, found),
                    },
                )
            )
        results = interleave(args.rounds, systems)
    if session is not None and "vLLM-CPU" not in results and "error" not in vllm:
        vllm = {"error": "failed during the rounds (see above)"}
    ours = combine_rounds(results["llm-sidecar"]["workload"])
    ours.update(best_figures(results["llm-sidecar"]["figures"]))
    ours.update(ours_info(llm))
    llm = None  # the engine's memory is given back before the baselines load
    gc.collect()
    rows = [ours]
    baselines = [b for b in args.baselines.split(",") if b]
    for b in baselines:
        if b == "hf-static":
            rows.append(run_hf_static(args, work))
        elif b == "hf-batch":
            rows.append(run_hf_generate_batch(args, work))
        else:
            raise ValueError(f"baselines: unknown baseline {b!r}")
    if "llama.cpp" in results:
        llama = best_figures(results["llama.cpp"]["figures"])
        rows.append(combine_rounds(results["llama.cpp"]["workload"]))
    if "vLLM-CPU" in results:
        vllm = best_figures(results["vLLM-CPU"]["figures"])
        rows.append(combine_rounds(results["vLLM-CPU"]["workload"]))
    if args.rounds > 1:  # each round's ratio: the same work, minutes apart
        for r in rows[1:]:
            if "round_seconds" in r:
                r["round_speedups"] = [t / o for t, o in zip(r["round_seconds"], ours["round_seconds"])]
                print(
                    f"ours against {r['system']} by round: "
                    + " ".join(f"{x:.2f}x" for x in r["round_speedups"]),
                    flush=True,
                )
    for r in rows:
        r["speedup_vs"] = ours["output_tok_s"] / r["output_tok_s"] if r is not ours else 1.0
        r["peak_rss_mib"] = r["peak_rss_bytes"] / 2**20 if r.get("peak_rss_bytes") else None
    bw = measure_bandwidth(device=args.device)
    roofline = bw / ours["weight_bytes_per_token"]
    b1 = {
        "b1_decode_tok_s": ours["b1_decode_tok_s"],
        "prefill_tok_s": ours["prefill_tok_s"],
        "peak_rss_mib": ours["peak_rss_bytes"] / 2**20,
        "weights_held_mib": ours["weights_held_mib"],
        "read_bandwidth_gb_s": bw / 1e9,
        "weight_mib_per_token": ours["weight_bytes_per_token"] / 2**20,
        "roofline_tok_s": roofline,
        "fraction_of_roofline": ours["b1_decode_tok_s"] / roofline,
    }
    if "b1_decode_tok_s" in llama:
        b1["llamacpp_b1_decode_tok_s"] = llama["b1_decode_tok_s"]
        b1["b1_ratio_vs_llamacpp"] = ours["b1_decode_tok_s"] / llama["b1_decode_tok_s"]
        b1["llamacpp_prefill_tok_s"] = llama["prefill_tok_s"]
        b1["prefill_ratio_vs_llamacpp"] = ours["prefill_tok_s"] / llama["prefill_tok_s"]
        b1["llamacpp_bench_peak_rss_mib"] = llama["b1_peak_rss_bytes"] / 2**20
    hf = next((r for r in rows if r["system"].startswith("HF generate (static")), None)
    if hf is not None:
        b1["hf_b1_decode_tok_s"] = hf["b1_decode_tok_s"]
        b1["b1_ratio_vs_hf"] = ours["b1_decode_tok_s"] / hf["b1_decode_tok_s"]
    if "b1_decode_tok_s" in vllm:
        b1["vllm_cpu_b1_decode_tok_s"] = vllm["b1_decode_tok_s"]
        b1["b1_ratio_vs_vllm_cpu"] = ours["b1_decode_tok_s"] / vllm["b1_decode_tok_s"]
        b1["vllm_cpu_prefill_tok_s"] = vllm["prefill_tok_s"]
        b1["prefill_ratio_vs_vllm_cpu"] = ours["prefill_tok_s"] / vllm["prefill_tok_s"]
    print(
        format_table(
            rows, ["system", "seconds", "output_tokens", "output_tok_s", "speedup_vs", "peak_rss_mib"]
        )
    )
    if args.device != "cpu":
        print(
            f"fast paths: {', '.join(ours.get('fast_paths') or ['none'])}; "
            f"fallbacks: {ours.get('fast_path_fallbacks') or 'none'}"
        )
    elif "cpu_decode_replay" in ours:
        print(
            "decode steps replayed from C"
            if ours["cpu_decode_replay"]
            else f"decode steps eager: {ours.get('cpu_decode_replay_reason')}"
        )
    print(format_table([b1], list(b1)))
    jpath, ppath = write_report(
        args.out,
        "throughput",
        {
            "command": "sidecar bench throughput",
            "args": {k: v for k, v in vars(args).items() if k != "_run"},
            "results": rows,
            "batch1": b1,
            "llama_cpp": llama,
            "vllm_cpu": vllm,
        },
        bars={
            "output tokens/s (mixed workload)": {r["system"]: r["output_tok_s"] for r in rows},
            "batch-1 decode tokens/s": {
                "llm-sidecar": b1["b1_decode_tok_s"],
                "roofline": roofline,
                **({"llama.cpp": llama["b1_decode_tok_s"]} if "b1_decode_tok_s" in llama else {}),
                **({"vLLM-CPU": vllm["b1_decode_tok_s"]} if "b1_decode_tok_s" in vllm else {}),
                **({"HF generate": b1["hf_b1_decode_tok_s"]} if hf is not None else {}),
            },
        },
    )
    print(f"wrote {jpath} and {ppath}")
    return 0
