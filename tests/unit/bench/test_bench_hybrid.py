"""The hybrid bench on a tiny Qwen3.5 checkpoint: decode figures per context, and cache bytes a token from the
engine's own cache groups -- the attention layers' KV plus the state spread over the context -- against the
same model with every layer a full-attention one."""

from __future__ import annotations

import argparse

from sidecar.bench import hybrid
from tests.unit.model.family_checkpoints import build_family_checkpoint


def test_rows_per_context_and_cache_bytes_against_dense(tmp_path, demo_dir):
    d = build_family_checkpoint("qwen3_5", tmp_path / "qwen3_5", demo_dir)
    args = argparse.Namespace(dtype="float32", tokens=3, threads=None)
    short, long = hybrid._ours(str(d), args, [8, 64])
    assert (short["context"], long["context"]) == (8, 64)
    assert short["b1_decode_tok_s"] > 0 and long["b1_decode_tok_s"] > 0
    # one attention layer of four: 2 (k, v) x 2 KV heads x 16 x 4 bytes a token, the dense model's four times
    assert short["kv_bytes_per_token"] == 2 * 2 * 16 * 4
    assert short["dense_bytes_per_token"] == 4 * short["kv_bytes_per_token"]
    # three DeltaNet layers' state: conv window (3 taps of 2*2*8 + 4*12 channels) and 4 x 8 x 12 matrix
    state = 3 * 4 * ((2 * 2 * 8 + 4 * 12) * 3 + 4 * 8 * 12)
    assert short["state_bytes_per_seq"] == long["state_bytes_per_seq"] == state
    assert long["cache_bytes_per_token"] == long["kv_bytes_per_token"] + state / 64
    assert long["cache_vs_dense"] < short["cache_vs_dense"]
    # the attention layers' share: timed on the cache's shape, and the step's growth less it
    assert 0 < short["attention_ms"] and 0 < long["attention_ms"]
    assert "beyond_attention_ms" not in short
    growth = (long["step_ms"] - short["step_ms"]) - (long["attention_ms"] - short["attention_ms"])
    assert long["beyond_attention_ms"] == growth
