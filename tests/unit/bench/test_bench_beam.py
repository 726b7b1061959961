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
