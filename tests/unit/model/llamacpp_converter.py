"""llama.cpp's own HF -> GGUF converter (``convert_hf_to_gguf.py`` with its ``conversion`` package and its
``gguf-py``), as shipped in the llama-cpp-python source distribution on PyPI.

``converter_dir()`` fetches that sdist once with pip (``pip download``: PyPI only, no model hub) and keeps the
three parts under the sidecar cache dir; later runs are offline. ``make test`` fetches it before the tests
(``python tests/unit/model/llamacpp_converter.py``); a test run without it fetches it itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is the converter used
_ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def _cache_root() -> Path:
    from sidecar.model.demo import sidecar_home

    return sidecar_home() / "llama.cpp" / f"llama-cpp-python-{VERSION}"


def converter_dir() -> Path:
    """The directory holding ``convert_hf_to_gguf.py``, fetched from PyPI on first use."""
    out = _cache_root()
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "-q", "--no-deps"),
                *("--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", tmp),
            ],
            check=True,
        )
        sdist = Path(tmp) / f"llama_cpp_python-{VERSION}.tar.gz"
        staged = Path(tmp) / "tree"
        with tarfile.open(sdist) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(_ROOT) and m.name[len(_ROOT) :].startswith(_PARTS)
            ]
            tar.extractall(staged, members=members, filter="data")
        try:
            os.replace(staged / _ROOT, out)
        except OSError:  # another process put it there first
            if not (out / "convert_hf_to_gguf.py").is_file():
                raise
    return out


def convert(hf_dir: Path, out: Path, outtype: str = "f32", *flags: str) -> Path:
    """``hf_dir`` converted by llama.cpp's converter into ``out`` (``outtype``: f32, f16, bf16, q8_0);
    ``flags`` go to the converter as they are (e.g. ``--no-mtp`` for a Qwen3.5 without MTP layers)."""
    script = converter_dir() / "convert_hf_to_gguf.py"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, str(script), str(hf_dir), "--outfile", str(out), "--outtype", outtype, *flags],
        capture_output=True,
        text=True,
        env=env,
    )
    if run.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{run.stderr[-4000:]}")
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    print(converter_dir())
