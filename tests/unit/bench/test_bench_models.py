"""The benchmark shapes are the real models' configs, built with transformers' own classes, and small ones of the
same families load in transformers and in our engine alike, with a tokenizer covering every id."""

import json

import pytest
import torch

from sidecar.bench import models
from sidecar.bench.quant import _parse_modes


def test_qwen3_shape_is_qwen3_0_6b():
    cfg = models.build_config(models.SHAPES["qwen3-0.6b"])
    assert type(cfg).__name__ == "Qwen3Config"
    got = {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
    assert got == {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16}
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (8, 128, 3072)
    assert (cfg.vocab_size, cfg.tie_word_embeddings) == (151936, True)
    assert cfg.rope_parameters["rope_theta"] == 1e6
    assert set(cfg.layer_types) == {"full_attention"}


def test_gemma3_shape_is_gemma_3_1b():
    cfg = models.build_config(models.SHAPES["gemma3-1b"])
    assert type(cfg).__name__ == "Gemma3TextConfig"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (1152, 26, 6912)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 256)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.query_pre_attn_scalar) == (262144, True, 256)
    assert cfg.sliding_window == 512
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23]  # five sliding layers, then a global one
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1e6


def _small(name: str, **extra) -> dict:
    return dict(
        models.SHAPES[name],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        head_dim=24,
        vocab_size=1200,
        max_position_embeddings=512,
        **extra,
    )


@pytest.mark.parametrize(
    "name, extra",
    [
        ("qwen3-0.6b", {"num_key_value_heads": 2}),
        ("gemma3-1b", {"num_key_value_heads": 1, "sliding_window": 8}),
    ],
)
def test_a_small_checkpoint_loads_in_transformers_and_in_our_engine(tmp_path, name, extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sidecar.model.args import ModelArgs
    from sidecar.model.demo import ensure_demo_model

    shape = _small(name, **extra)
    out = models.write_checkpoint(shape, tmp_path / name, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == models.FAMILIES[shape["family"]][1]
    assert next(hf.parameters()).dtype == torch.bfloat16
    assert hf.get_input_embeddings().weight.shape == (1200, 64)
    assert hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()  # tied

    # every id of the model is a token, and the demo tokenizer's text still gives its ids
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(1200))
    tok, demo = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(ensure_demo_model())
    text = "The sidecar keeps the model next to the service."
    assert tok.encode(text) == demo.encode(text)
    assert len(tok) == 1200

    args = ModelArgs.from_hf_config(json.loads((out / "config.json").read_text()))
    assert (args.num_layers, args.head_dim, args.qk_norm) == (6, 24, True)
    if name == "gemma3-1b":
        assert [args.window(i) for i in range(6)] == [8, 8, 8, 8, 8, None]
        assert args.rope_kind(0) != args.rope_kind(5)
        assert args.attn_scale == 256**-0.5
    else:
        assert [args.window(i) for i in range(6)] == [None] * 6


def test_the_checkpoint_is_rebuilt_only_when_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(models.SHAPES, "tiny-qwen3", _small("qwen3-0.6b", num_key_value_heads=2))
    first = models.random_checkpoint("tiny-qwen3", out=tmp_path / "m")
    stamp = (first / "config.json").stat().st_mtime_ns
    again = models.random_checkpoint("tiny-qwen3", out=tmp_path / "m")
    assert again == first and (again / "config.json").stat().st_mtime_ns == stamp


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="unknown benchmark shape 'qwen9'"):
        models.random_checkpoint("qwen9")
    with pytest.raises(ValueError, match="unknown benchmark family 'mamba'"):
        models.build_config(dict(models.SHAPES["small"], family="mamba"))


def test_a_vocabulary_below_the_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 500"):
        models.write_tokenizer(tmp_path, 500)


def test_quant_modes_are_checked():
    assert _parse_modes("bf16, int4") == ["bf16", "int4"]
    for bad in ("", "bf16,bf16", "int3"):
        with pytest.raises(ValueError, match="modes"):
            _parse_modes(bad)


def test_qwen3_5_shape_is_qwen3_5_0_8b_and_loads_as_a_hybrid(tmp_path):
    from sidecar.model.args import ModelArgs

    cfg = models.build_config(models.SHAPES["qwen3.5-0.8b"])
    assert type(cfg).__name__ == "Qwen3_5TextConfig"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (1024, 24, 3584)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 2, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (16, 16)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (128, 128, 4)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [3, 7, 11, 15, 19, 23]
    small = dict(_small("qwen3.5-0.8b"), linear_key_head_dim=8, linear_value_head_dim=12, num_hidden_layers=4)
    out = models.write_checkpoint(small, tmp_path / "q35", seed=1)
    args = ModelArgs.from_hf_config(json.loads((out / "config.json").read_text()))
    assert args.linear_layers == (0, 1, 2) and args.rotary_dim == 6
