"""Triton kernels run in the interpreter on CPU tensors when there is no GPU.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any test module of
this directory imports a kernel module. It only matters to code that takes a Triton path, and every
``FastPaths`` field is off by default, so setting it for the session changes no other test.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sidecar.model.kernels.gpu_paths import triton_available  # noqa: E402

if not triton_available():  # a CPU-only install without Triton: nothing here can run
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
