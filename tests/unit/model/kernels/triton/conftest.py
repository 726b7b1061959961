"""Triton kernels run in the interpreter on CPU tensors when there is no GPU (``TRITON_INTERPRET``, set by
the root conftest before any kernel module is imported); on a GPU, on the GPU."""

import pytest
import torch

from sidecar.model.kernels.gpu_paths import triton_available

if not triton_available():  # a CPU-only install without Triton: nothing here can run
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
