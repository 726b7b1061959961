"""dtype="auto" follows what the hardware computes natively; an explicit dtype is always obeyed.

The decision is driven through torch's capability probes, monkeypatched to stand for other machines.
"""

import pytest
import torch

from sidecar.model import hardware
from sidecar.model.kernels.cpu import bf16_gemv
from sidecar.model.loader import pick_dtype, pick_dtype_with_reason

BF16_CKPT = {"torch_dtype": "bfloat16"}
FP16_CKPT = {"torch_dtype": "float16"}
FP32_CKPT = {"torch_dtype": "float32"}
QWEN2_05B = {
    "torch_dtype": "bfloat16",
    "hidden_size": 896,
    "num_attention_heads": 14,
    "intermediate_size": 4864,
}
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_caches():
    yield
    # the ISA report is cached per process; drop what the patched probes put there
    hardware.cpu_isa.cache_clear()


def _cpu(monkeypatch, *, avx2=True, avx512=False, avx512_bf16=False, amx=False):
    probes = {
        "_is_avx2_supported": avx2,
        "_is_avx512_supported": avx512,
        "_is_avx512_bf16_supported": avx512_bf16,
        "_is_amx_tile_supported": amx,
    }
    for name, value in probes.items():
        monkeypatch.setattr(torch.cpu, name, (lambda v=value: v), raising=False)
    hardware.cpu_isa.cache_clear()


def _no_probes(monkeypatch):
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    hardware._measured_bf16_faster.cache_clear()


def _kernel(monkeypatch, isa: str) -> None:
    """Our bf16 kernel's path as a machine of that kind builds it ("" where it is not available)."""
    monkeypatch.setattr(bf16_gemv, "isa", lambda: isa)


def test_avx2_only_cpu_runs_half_checkpoints_in_bf16_through_our_kernel(monkeypatch):
    _cpu(monkeypatch, avx2=True)
    _kernel(monkeypatch, "avx2")
    dtype, why = pick_dtype_with_reason("auto", QWEN2_05B, CPU)
    assert dtype == torch.bfloat16
    assert "neither AVX-512 BF16 nor AMX" in why and "our AVX2 kernel" in why
    assert pick_dtype("auto", FP16_CKPT, CPU) == torch.bfloat16
    assert pick_dtype("auto", FP32_CKPT, CPU) == torch.float32  # a float32 checkpoint keeps its precision


def test_avx2_only_cpu_without_our_kernel_or_with_odd_layers_runs_float32(monkeypatch):
    _cpu(monkeypatch, avx2=True)
    _kernel(monkeypatch, "avx2")
    # a layer whose inputs are not whole 32-value chunks would take torch's emulated bf16 matmul
    dtype, why = pick_dtype_with_reason("auto", {**QWEN2_05B, "intermediate_size": 4860}, CPU)
    assert dtype == torch.float32 and "[4860]" in why and "float32 is faster" in why
    _kernel(monkeypatch, "")  # the kernel could not be built, or CPU kernels are off
    dtype, why = pick_dtype_with_reason("auto", QWEN2_05B, CPU)
    assert dtype == torch.float32
    assert "neither AVX-512 BF16 nor AMX" in why and "not available" in why
    _cpu(monkeypatch, avx2=False)  # not even AVX2
    _kernel(monkeypatch, "avx2")
    assert pick_dtype("auto", QWEN2_05B, CPU) == torch.float32


def test_avx512_without_bf16_is_float32(monkeypatch):
    _cpu(monkeypatch, avx512=True)
    _kernel(monkeypatch, "avx2")  # our AVX2 kernel runs there too, but oneDNN's float32 is twice as wide
    assert pick_dtype("auto", BF16_CKPT, CPU) == torch.float32


def test_avx512_bf16_cpu_runs_bf16(monkeypatch):
    _cpu(monkeypatch, avx512=True, avx512_bf16=True)
    dtype, why = pick_dtype_with_reason("auto", BF16_CKPT, CPU)
    assert dtype == torch.bfloat16 and "AVX-512 BF16" in why
    # fp16 checkpoints compute in the CPU's native half type, bf16
    assert pick_dtype("auto", FP16_CKPT, CPU) == torch.bfloat16


def test_amx_cpu_runs_bf16(monkeypatch):
    _cpu(monkeypatch, avx512=True, amx=True)
    dtype, why = pick_dtype_with_reason("auto", BF16_CKPT, CPU)
    assert dtype == torch.bfloat16 and "AMX" in why


def test_float32_checkpoint_stays_float32(monkeypatch):
    _cpu(monkeypatch, avx512=True, avx512_bf16=True, amx=True)
    assert pick_dtype("auto", FP32_CKPT, CPU) == torch.float32
    assert pick_dtype("auto", {}, CPU) == torch.float32


@pytest.mark.parametrize(
    "requested,expected",
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_explicit_dtype_is_obeyed(monkeypatch, requested, expected):
    _cpu(monkeypatch, avx2=True)  # even where the CPU would not pick it
    dtype, why = pick_dtype_with_reason(requested, BF16_CKPT, CPU)
    assert dtype == expected and why == f"requested {requested}"


@pytest.mark.parametrize(
    "capability,expected",
    [((7, 5), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16), ((6, 1), torch.float16)],
)
def test_cuda_half_dtype_by_compute_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    dtype, why = pick_dtype_with_reason("auto", BF16_CKPT, torch.device("cuda", 0))
    assert dtype == expected
    assert f"sm{capability[0]}{capability[1]}" in why
    assert pick_dtype("auto", FP16_CKPT, torch.device("cuda", 0)) == expected


def test_missing_probes_fall_back_to_one_measurement(monkeypatch):
    _no_probes(monkeypatch)
    calls = []

    def measured():
        calls.append(1)
        return False

    monkeypatch.setattr(hardware, "_measured_bf16_faster", measured)
    dtype, why = pick_dtype_with_reason("auto", BF16_CKPT, CPU)
    assert dtype == torch.float32 and "measured slower" in why and calls == [1]
    monkeypatch.setattr(hardware, "_measured_bf16_faster", lambda: True)
    assert pick_dtype("auto", BF16_CKPT, CPU) == torch.bfloat16


def test_measurement_runs_once_per_process(monkeypatch):
    hardware._measured_bf16_faster.cache_clear()
    first = hardware._measured_bf16_faster()
    assert hardware._measured_bf16_faster() == first
    assert hardware._measured_bf16_faster.cache_info().misses == 1


def test_isa_report_names_extensions(monkeypatch):
    _cpu(monkeypatch, avx2=True, avx512=True, avx512_bf16=True, amx=True)
    isa = hardware.cpu_isa()
    assert isa["avx2"] and isa["avx512"] and isa["avx512_bf16"] and isa["amx"]
    line = hardware.isa_summary(isa)
    assert "AVX2 AVX-512 AVX-512-BF16 AMX" in line and isa["model_name"] in line
    _cpu(monkeypatch, avx2=True)
    assert "AVX2" in hardware.isa_summary() and "AMX" not in hardware.isa_summary()
