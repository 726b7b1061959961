"""Every Triton kernel compiles for a Hopper GPU (sm_90, the H100 we deploy on), checked without a GPU.
``python tests/unit/model/kernels/triton/compile_kernels.py 80`` checks Ampere the same way (a few seconds more)."""

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_gpu():
    arch = 90
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # state the default the kernels that care override
    root = Path(__file__).resolve().parents[5]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compile_kernels.py")), str(arch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("every kernel compiles") == 2
