"""Optional llama.cpp baseline for the CPU benches (a benchmark tool, never a dependency).

The tools (llama-bench, llama-server, llama-quantize) are found in ``--llama-cpp DIR`` (a build
tree or its bin/ folder), else ``$SIDECAR_LLAMA_CPP``, else on PATH. The checkpoint is converted
with the ``convert_hf_to_gguf.py`` of the same llama.cpp source tree (``--llama-cpp-src`` /
``$SIDECAR_LLAMA_CPP_SRC``, else found above the build folder) at the same precision class:
float32 -> F32, bfloat16 -> BF16, float16 -> F16, int8 -> Q8_0, int4 -> Q4_0 (from BF16 with
llama-quantize). Benchmarks feed token ids, so the pre-tokenizer of the random bench checkpoints'
byte-level tokenizer is irrelevant: the conversion maps it to Qwen2's instead of refusing it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0", "int4": "q4_0"}
_TOOLS = ("llama-bench", "llama-server", "llama-quantize")

# Run inside a fresh interpreter: patches the converter so that a tokenizer it does not know by hash
# is written as a GPT-2-style BPE vocabulary, then runs the converter's own main().
_CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base, qwen
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
qwen.Qwen2Model.set_vocab = base.TextModel._set_vocab_gpt2
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def add_arguments(p) -> None:
    p.add_argument(
        "--llama-cpp",
        default=os.environ.get("SIDECAR_LLAMA_CPP"),
        help="llama.cpp build dir (or its bin/) for the llama.cpp baseline; default $SIDECAR_LLAMA_CPP, "
        "then PATH; the baseline is skipped when its tools are not found",
    )
    p.add_argument(
        "--llama-cpp-src",
        default=os.environ.get("SIDECAR_LLAMA_CPP_SRC"),
        help="llama.cpp source tree holding convert_hf_to_gguf.py (default: above the build dir)",
    )


def find_tools(build: Optional[str], src: Optional[str]) -> Optional[dict[str, Path]]:
    """Paths of the llama.cpp tools and source tree, or None when llama-bench/llama-server are missing."""
    tools: dict[str, Path] = {}
    dirs = [Path(build), Path(build) / "bin", Path(build) / "build" / "bin"] if build else []
    for name in _TOOLS:
        found = next((d / name for d in dirs if (d / name).is_file()), None)
        if found is None and not build:
            which = shutil.which(name)
            found = Path(which) if which else None
        if found is not None:
            tools[name] = found.resolve()
    if "llama-bench" not in tools or "llama-server" not in tools:
        return None
    candidates = [Path(src)] if src else list(tools["llama-bench"].parents)[:4]
    root = next((c for c in candidates if (c / "convert_hf_to_gguf.py").is_file()), None)
    if root is None:
        raise ValueError("llama-cpp-src: no convert_hf_to_gguf.py found; pass the llama.cpp source tree")
    tools["src"] = root
    return tools


def version(tools: dict[str, Path]) -> str:
    out = subprocess.run(
        [str(tools["llama-server"]), "--version"], capture_output=True, text=True, timeout=60
    )
    return " ".join((out.stdout + out.stderr).split())[:200]


def gguf_for(
    tools: dict[str, Path], model_dir: str, precision: str, cache_dir: Path, flags: tuple[str, ...] = ()
) -> Path:
    """The checkpoint as GGUF in ``precision``'s class, converted once and cached next to the bench models;
    ``flags``: more options of the converter (``--no-mtp`` for a Qwen3.5 checkpoint without MTP layers)."""
    outtype = OUTTYPES[precision]
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"{Path(model_dir).name}-{outtype}.gguf"
    if out.exists():
        return out
    direct = outtype if outtype != "q4_0" else "bf16"
    src = out if direct == outtype else cache_dir / f"{Path(model_dir).name}-{direct}.gguf"
    if not src.exists():
        tmp = src.with_suffix(".tmp")
        subprocess.run(
            [
                sys.executable,
                "-c",
                _CONVERT,
                str(tools["src"]),
                model_dir,
                "--outtype",
                direct,
                "--outfile",
                str(tmp),
                *flags,
            ],
            check=True,
            capture_output=True,
        )
        os.replace(tmp, src)
    if not out.exists():
        if "llama-quantize" not in tools:
            raise ValueError("llama-cpp: llama-quantize is needed for the Q4_0 baseline")
        tmp = out.with_suffix(".tmp")
        subprocess.run(
            [str(tools["llama-quantize"]), str(src), str(tmp), outtype.upper()],
            check=True,
            capture_output=True,
        )
        os.replace(tmp, out)
    return out


def llama_bench(
    tools: dict[str, Path],
    gguf: Path,
    n_prompt: int,
    n_gen: int,
    threads: int,
    repeats: int = 3,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One llama-bench test (``-p n_prompt -n n_gen``; one of them 0; ``extra``: more of its options): tokens/s
    as the mean of its ``repeats`` runs (``tok_s``) and the fastest run (``best_tok_s``), and llama-bench's peak
    RSS. RuntimeError naming the exit status (or the signal that killed it) when it fails."""
    from sidecar.bench.rss import run_measured

    cmd = [
        str(tools["llama-bench"]),
        "-m",
        str(gguf),
        "-p",
        str(n_prompt),
        "-n",
        str(n_gen),
        "-t",
        str(threads),
        "-r",
        str(repeats),
        "-o",
        "json",
        *extra,
    ]
    out, rc, peak = run_measured(cmd)
    if rc != 0:
        how = (
            f"was killed by {signal.Signals(-rc).name}"
            if rc < 0 and -rc in signal.valid_signals()
            else f"exited with {rc}"
        )
        raise RuntimeError(f"llama-bench {how}: {' '.join(cmd)}")
    key = "n_gen" if n_gen else "n_prompt"
    row = next(r for r in json.loads(out) if r.get(key))
    samples = row.get("samples_ts") or [row["avg_ts"]]
    return {"tok_s": float(row["avg_ts"]), "best_tok_s": float(max(samples)), "peak_rss_bytes": peak}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def server_workload(
    tools: dict[str, Path],
    gguf: Path,
    work: list[tuple[list[int], int]],
    threads: int,
    parallel: int,
    timeout: float = 3600.0,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """The workload through ``llama-server -np parallel`` (continuous batching), all requests sent at once.

    Each slot gets the context of the longest request; prompts are token ids, EOS ignored, greedy or (at
    ``temperature`` > 0) plain temperature sampling: llama-server's other samplers (top-k 40, top-p 0.95,
    min-p 0.05 by default) turned off.
    ``peak_rss_bytes``: the server's peak RSS, read before it is stopped."""
    from sidecar.bench.rss import peak_rss_bytes

    per_slot = max(len(p) + n for p, n in work) + 16
    port = _free_port()
    cmd = [
        str(tools["llama-server"]),
        "-m",
        str(gguf),
        "-np",
        str(parallel),
        "-c",
        str(per_slot * parallel),
        "-t",
        str(threads),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become healthy within 300 s")
            time.sleep(0.5)
        _post(
            base + "/completion",
            {
                "prompt": work[0][0][:16],
                "n_predict": 2,
                "ignore_eos": True,
                "temperature": 0.0,
                "cache_prompt": False,
            },
            timeout,
        )  # warm-up

        sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}

        def one(item: tuple[list[int], int]) -> int:
            prompt, n = item
            r = _post(
                base + "/completion",
                {"prompt": prompt, "n_predict": n, "ignore_eos": True, "cache_prompt": False, **sampling},
                timeout,
            )
            return int(r.get("tokens_predicted", 0))

        t = time.perf_counter()
        with ThreadPoolExecutor(len(work)) as pool:
            produced = sum(pool.map(one, work))
        dt = time.perf_counter() - t
        peak = peak_rss_bytes(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {
        "system": f"llama.cpp llama-server -np {parallel} ({gguf.name.rsplit('-', 1)[-1][:-5].upper()})",
        "seconds": dt,
        "output_tokens": produced,
        "output_tok_s": produced / dt,
        "peak_rss_bytes": peak,
    }
