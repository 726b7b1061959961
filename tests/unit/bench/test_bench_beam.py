"""``sidecar bench beam`` on a tiny float32 checkpoint: both systems run, and their best sequences agree."""

import json

from sidecar.cli import build_parser


def test_beam_bench_reports_both_systems_with_equal_best_sequences(tiny_models, tmp_path):
    argv = ["bench", "beam", "--model", str(tiny_models["qwen2"]), "--dtype", "float32", "--prompts", "2"]
    argv += ["--output-tokens", "6", "--out", str(tmp_path)]
    args = build_parser(argv).parse_args(argv)
    assert args._run(args) == 0
    report = json.loads((tmp_path / "beam.json").read_text())
    assert [r["system"] for r in report["results"]] == ["sidecar", "transformers"]
    assert all(r["tokens"] == 2 * 6 and r["tok_s"] > 0 for r in report["results"])
    assert report["same_best_sequence"] == 2
    assert report["speedup_vs_hf"] > 0


def test_the_baseline_of_a_gguf_we_quantized_is_its_float32_checkpoint(tiny_models):
    """``--dtype auto`` runs the default model's int4 layers, which transformers cannot load: its baseline is
    the float32 checkpoint the engine reads for ``dtype="float32"``, unquantized."""
    import argparse
    import pathlib

    from sidecar import LLM
    from sidecar.bench.beam import _baseline

    plain = {"quantization": "none", "model_dir": "/m", "dtype": "bfloat16"}
    assert _baseline(argparse.Namespace(model="/m"), plain) == ("/m", "bfloat16")
    int4 = {"quantization": "int4", "model_dir": "/q", "dtype": "float32"}
    hf_dir, dtype = _baseline(argparse.Namespace(model=None), int4)
    assert (
        dtype == "float32" and hf_dir == LLM(dtype="float32", num_kv_blocks=4).engine.model_info["model_dir"]
    )
    config = (pathlib.Path(hf_dir) / "config.json").read_text()
    assert "quantization_config" not in config and hf_dir != LLM().engine.model_info["model_dir"]
