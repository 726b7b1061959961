"""A hub-quantized checkpoint the sidecar cannot serve stops ``sidecar serve`` at start with one line
naming the refused ``quantization_config`` field (exit status 2, no traceback)."""

from __future__ import annotations

import socket
import subprocess
import sys

import torch

from sidecar.bench import hub_pack as H


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_an_unsupported_quantization_config_naming_the_field(tiny_models, tmp_path):
    def layer(name, w):  # a 4-bit file whose config claims 3 bits
        g_idx = torch.arange(w.shape[1]) // 32
        codes, s, z = H.quantize(w, 4, g_idx, w.shape[1] // 32, False, True)
        t = H.pack_gptq(codes, s, z, g_idx, 4, True)
        return t, H.dequant_gptq(t, 4, True)

    out = tmp_path / "q"
    H.write(
        tiny_models["llama"], out, dict(quant_method="gptq", bits=3, group_size=32, desc_act=False), layer
    )
    r = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--model", str(out), "--dtype", "float32"]
        + ["--grpc-port", str(_free_port()), "--http-port", str(_free_port()), "--no-semantic-cache"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "sidecar serve: error: quantization_config.bits: 3 is not supported (one of 4, 8)"
    )
