"""The output head's precision under quantized weights (``quantize_lm_head``): int8 by default under int8
and int4 weights, as llama.cpp's Q8_0 and Q4_0 keep the head at 8 bits; other choices by setting."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from safetensors import safe_open

from sidecar import LLM
from sidecar.config import EngineConfig, lm_head_quantization
from sidecar.model.linear import Linear
from sidecar.model.loader import load_model
from sidecar.model.quant import Int4Linear, Int8Linear, QuantEmbedding
from sidecar.model.quant_format import quantize_weight


def _head(kind, tiny_models, **kw):
    return load_model(EngineConfig(model=str(tiny_models[kind]), dtype="float32", **kw)).model


@pytest.mark.parametrize(
    "quantization,setting,head_cls",
    [
        ("int4", "auto", Int8Linear),
        ("int8", "auto", Int8Linear),
        ("int4", "none", Linear),
        ("int4", False, Linear),
        ("int4", "same", Int4Linear),
        ("int4", True, Int4Linear),
        ("int8", "int4", Int4Linear),
        ("int4", "int8", Int8Linear),
        (None, "auto", Linear),
        (None, "same", Linear),
    ],
)
def test_head_kernel_per_setting(tiny_models, quantization, setting, head_cls):
    # llama's head is its own tensor; qwen2's is tied to the embedding, which follows the head's mode.
    kw = dict(quantization=quantization, quantize_lm_head=setting, quant_group_size=32)
    untied = _head("llama", tiny_models, **kw)
    assert type(untied.lm_head) is head_cls
    assert isinstance(untied.embed_tokens, nn.Embedding)  # an untied embedding stays as it is
    tied = _head("qwen2", tiny_models, **kw)
    assert type(tied.lm_head) is head_cls
    if head_cls is Linear:
        assert isinstance(tied.embed_tokens, nn.Embedding)
    else:
        assert isinstance(tied.embed_tokens, QuantEmbedding) and tied.embed_tokens.mode == head_cls.mode


def test_int8_head_under_int4_weights_matches_a_dequantized_int8_reference(tiny_models):
    model = _head("llama", tiny_models, quantization="int4", quant_group_size=32)
    assert type(model.lm_head) is Int8Linear and type(model.layers[0].mlp.down_proj) is Int4Linear
    path = tiny_models["llama"] / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        w = f.get_tensor("lm_head.weight").float()
    stored = quantize_weight(w, "int8", 128, torch.float32)
    ref_w = stored["qweight"].float() * stored["scales"].float()[:, None]
    assert (ref_w - w).abs().max() > 0  # the reference really is quantized
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = model.lm_head(x).float()
    ref, full = x @ ref_w.T, x @ w.T
    # The kernel sums in its own order (and may round activations on the way): it must sit on the int8
    # reference, far closer to it than the int8 rounding of the weights moves the product.
    err = (got - ref).abs().max()
    assert err <= 1e-3 * ref.abs().max()
    assert err < 0.2 * (ref - full).abs().max()


def test_resolved_head_mode():
    assert lm_head_quantization("int4", "auto") == "int8"
    assert lm_head_quantization("int8", "same") == "int8"
    assert lm_head_quantization("int4", "none") is None
    assert lm_head_quantization(None, "auto") is None
    assert EngineConfig().quantize_lm_head == "auto"
    assert EngineConfig(quantize_lm_head="TRUE").quantize_lm_head == "same"
    assert EngineConfig(quantize_lm_head="off").quantize_lm_head == "none"


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(quantize_lm_head="bf17", quantization="int8"), "quantize_lm_head: must be one of auto, none"),
        (dict(quantize_lm_head=3), "quantize_lm_head: must be one of"),
        (dict(quantize_lm_head="int8"), "quantize_lm_head: int8 needs quantization int8 or int4"),
    ],
)
def test_bad_head_settings_name_the_field(demo_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)
    with pytest.raises(ValueError, match=match):
        LLM(model=str(demo_dir), **kw)


def _serve_config(argv, env=None):
    import argparse

    from sidecar.server.flags import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv), env=env or {}).engine


def test_serve_flag_and_env_take_every_head_setting():
    assert _serve_config(["--quantization", "int4"]).quantize_lm_head == "auto"  # the LLM() default
    for value in ("none", "int8", "int4", "same"):
        cfg = _serve_config(["--quantization", "int4", "--quantize-lm-head", value])
        assert cfg.quantize_lm_head == value
    assert _serve_config(["--quantize-lm-head", "true"]).quantize_lm_head == "same"
    env = {"SIDECAR_ENGINE_QUANTIZE_LM_HEAD": "none"}
    assert _serve_config(["--quantization", "int8"], env).quantize_lm_head == "none"
    with pytest.raises(ValueError, match="quantize_lm_head: must be one of"):
        _serve_config(["--quantize-lm-head", "fp8"])
