"""8-bit HF checkpoints on CUDA: FP8 projections take ``torch._scaled_mm`` where the device has FP8 units and
its self-check passes (else the dequantized weights, with the reason); W8A8 projections give the CPU layer's
results (exact int32 sums, the same float32 scaling)."""

from __future__ import annotations

import torch

from sidecar.config import EngineConfig
from sidecar.model import fp8
from sidecar.model.linear import Linear
from sidecar.model.loader import load_model
from tests.unit.model.hf8bit_checkpoints import SMALL, ct_checkpoint


def test_fp8_projections_take_scaled_mm_where_the_device_can(tmp_path, demo_dir):
    d = ct_checkpoint("llama", "FP8_DYNAMIC", "float-quantized", tmp_path / "fp8", demo_dir, SMALL)
    model = load_model(EngineConfig(model=str(d), dtype="bfloat16", device="cuda")).model
    down = model.layers[0].mlp.down_proj
    reason = fp8.scaled_mm_check(torch.device("cuda", torch.cuda.current_device()))
    if torch.cuda.get_device_capability() >= (8, 9) and not reason:
        assert isinstance(down, fp8.Fp8ScaledLinear)
        x = torch.randn(1, 37, down.in_features, device="cuda", dtype=torch.bfloat16)
        q, sx = fp8.quantize_per_token_e4m3(x.reshape(-1, down.in_features))
        ref = (q.float() * sx) @ (down.weight.float() * down.scales.reshape(-1, 1)).T
        torch.testing.assert_close(down(x).float().reshape(ref.shape), ref, rtol=2e-2, atol=2e-2)
    else:
        assert reason and type(down) is Linear


def test_w8a8_projection_on_cuda_equals_the_cpu_layer(tmp_path, demo_dir):
    d = ct_checkpoint("llama", "W8A8", "int-quantized", tmp_path / "w8a8", demo_dir, SMALL)
    gpu = load_model(EngineConfig(model=str(d), dtype="float32", device="cuda")).model.layers[1].mlp.down_proj
    cpu = load_model(EngineConfig(model=str(d), dtype="float32", device="cpu")).model.layers[1].mlp.down_proj
    x = torch.randn(41, cpu.in_features) * 3
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), rtol=1e-6, atol=1e-6)
