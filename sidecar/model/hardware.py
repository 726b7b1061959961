"""What the device computes natively, and the compute dtype ``dtype="auto"`` picks from it.

On x86 CPUs torch runs bf16 matmuls through oneDNN's native kernels only when the CPU has
AVX-512 BF16 or AMX; elsewhere (AVX2-only machines such as AMD Zen 2/3 or older Intel) torch's bf16 is
emulated by converting to float32 and is several times slower than plain float32. There our own bf16
kernel (``kernels/cpu/bf16_gemv``, AVX2 + FMA) takes every bf16 layer instead, and bf16 is the faster choice
(``avx2_bf16_kernel``). On CUDA, bf16 tensor cores exist from compute capability 8.0 (Ampere); older
GPUs run fp16 natively.

The answer comes from torch's own capability reporting. Only when that reporting is missing (an
older or unusual torch build) is a short matmul timed once per process to decide.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable, Iterable, Optional

import torch

log = logging.getLogger("sidecar.model")

_HALF = (torch.float16, torch.bfloat16)


def _probe(name: str) -> Optional[bool]:
    """torch.cpu.<name>() when this torch build has it, else None (unknown)."""
    fn: Optional[Callable[[], bool]] = getattr(torch.cpu, name, None)
    if fn is None:
        return None
    try:
        return bool(fn())
    except Exception:  # a probe that cannot run reports "unknown", never fails the load
        return None


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


@functools.lru_cache(maxsize=1)
def cpu_isa() -> dict:
    """The CPU's model name and the x86 vector/matrix extensions torch can use (None: unknown)."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:
        capability = "unknown"
    return {
        "model_name": _cpu_model_name(),
        "num_threads": torch.get_num_threads(),
        "avx2": _probe("_is_avx2_supported"),
        "avx512": _probe("_is_avx512_supported"),
        "avx512_bf16": _probe("_is_avx512_bf16_supported"),
        "amx": _probe("_is_amx_tile_supported"),
        "torch_capability": capability,
    }


def isa_summary(isa: Optional[dict] = None) -> str:
    """One line such as ``Intel Xeon: AVX2 AVX-512 AVX-512-BF16 AMX (torch AVX512, 2 threads)``."""
    isa = isa or cpu_isa()
    names = [
        label
        for key, label in (
            ("avx2", "AVX2"),
            ("avx512", "AVX-512"),
            ("avx512_bf16", "AVX-512-BF16"),
            ("amx", "AMX"),
        )
        if isa.get(key)
    ]
    return (
        f"{isa['model_name']}: {' '.join(names) or 'no AVX2'} "
        f"(torch {isa['torch_capability']}, {isa['num_threads']} threads)"
    )


@functools.lru_cache(maxsize=1)
def _measured_bf16_faster() -> bool:
    """Time one decode-sized matmul in bf16 and float32; native bf16 is not slower than float32."""
    x = torch.randn(32, 896)
    w = torch.randn(2048, 896)

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        torch.nn.functional.linear(a, b)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            torch.nn.functional.linear(a, b)
            times.append(time.perf_counter() - t0)
        return min(times)

    fp32 = best(x, w)
    bf16 = best(x.bfloat16(), w.bfloat16())
    return bf16 <= fp32


def cpu_native_bf16() -> tuple[bool, str]:
    """(True, why) when torch's bf16 matmul runs natively on this CPU, else (False, why)."""
    amx, avx512_bf16 = _probe("_is_amx_tile_supported"), _probe("_is_avx512_bf16_supported")
    if amx:
        return True, "CPU has AMX (native bf16 matmul)"
    if avx512_bf16:
        return True, "CPU has AVX-512 BF16 (native bf16 matmul)"
    if amx is False and avx512_bf16 is False:
        return False, "CPU has neither AVX-512 BF16 nor AMX (bf16 matmul would be emulated)"
    if _measured_bf16_faster():
        return True, "torch reports no CPU capabilities; a bf16 matmul measured as fast as float32"
    return False, "torch reports no CPU capabilities; a bf16 matmul measured slower than float32"


def avx2_bf16_kernel(in_features: Iterable[int] = ()) -> tuple[bool, str]:
    """(True, why) when a CPU without native bf16 runs bf16 layers fast through our own kernel: an AVX2 + FMA CPU
    without AVX-512, where ``bf16_gemv`` widens bf16 weights to float32 in registers (so a bf16 weight streams half
    the bytes of a float32 one) and every layer's inputs are whole 32-value chunks (``in_features``; another layer
    would go to torch's emulated bf16 matmul). Against float32 through oneDNN, bf16 there decodes faster at batch
    1 and holds less memory at about the same batch throughput (docs/PERFORMANCE.md, Zen 3, A7). Where AVX-512
    exists without BF16, oneDNN's float32 GEMM has twice the AVX2 kernel's width: it stays float32 there."""
    from sidecar.model.kernels.cpu import bf16_gemv

    if (
        _probe("_is_avx512_supported") is not False
        or not _probe("_is_avx2_supported")
        or _probe("_is_avx512_bf16_supported") is not False
        or _probe("_is_amx_tile_supported") is not False
    ):
        return False, "not an AVX2 CPU known to lack AVX-512"
    if bf16_gemv.isa() != "avx2":
        return False, "our AVX2 bf16 kernel is not available"
    odd = sorted({n for n in in_features if n % 32})
    if odd:
        return False, f"layer inputs of {odd} values are not whole 32-value chunks for our bf16 kernel"
    return True, "bf16 layers through our AVX2 kernel (half the bytes of float32 a token)"


def cuda_half_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """bf16 on compute capability 8.0+ (native bf16 tensor cores), fp16 below."""
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return torch.bfloat16, f"CUDA sm{major}{minor} has native bf16"
    return torch.float16, f"CUDA sm{major}{minor} has no native bf16, fp16 instead"


def auto_dtype(
    checkpoint_dtype: torch.dtype, device: torch.device, in_features: Iterable[int] = ()
) -> tuple[torch.dtype, str]:
    """The compute dtype for ``dtype="auto"`` and the reason, for the start-up line.

    A float32 checkpoint stays float32 (its published precision). A half-precision checkpoint runs
    in the half dtype the device computes natively, or in bf16 through our AVX2 kernel where that is
    faster (``avx2_bf16_kernel``: ``in_features`` are the inputs of the model's layers); another CPU runs
    it in float32, which there is several times faster than emulated bf16 and loses nothing.
    """
    if checkpoint_dtype not in _HALF:
        return checkpoint_dtype, f"auto: checkpoint is {str(checkpoint_dtype).replace('torch.', '')}"
    if device.type == "cuda":
        dtype, why = cuda_half_dtype(device)
        return dtype, f"auto: half-precision checkpoint; {why}"
    native, why = cpu_native_bf16()
    if native:
        return torch.bfloat16, f"auto: half-precision checkpoint; {why}"
    kernel, kernel_why = avx2_bf16_kernel(in_features)
    if kernel:  # (torch's bf16 matmul would be emulated, but no layer runs it)
        return torch.bfloat16, (
            f"auto: half-precision checkpoint; CPU has neither AVX-512 BF16 nor AMX: {kernel_why}"
        )
    return torch.float32, f"auto: {why}; {kernel_why}; float32 is faster"
