"""The engine runs on an image with torch, transformers, numpy, safetensors and grpcio only (the CUDA
test machine): faiss, llguidance, FastAPI and psutil are imported lazily, where they are used."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_engine_generates_without_optional_packages(demo_dir):
    code = textwrap.dedent(f"""
        import sys
        for name in ("faiss", "llguidance", "fastapi", "uvicorn", "psutil", "sentence_transformers"):
            sys.modules[name] = None  # importing any of them now raises ImportError
        from sidecar import LLM, SamplingParams
        import sidecar.engine.self_check, sidecar.engine.graphs, sidecar.engine.input_buffers
        llm = LLM(model={str(demo_dir)!r}, dtype="float32", num_kv_blocks=32, device="cpu")
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3, out
        print("ok")
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
