"""``sidecar bench kv-eviction`` on a tiny float32 checkpoint: every case runs, the 100% budget evicts nothing."""

import json

import pytest

from sidecar.cli import build_parser


def test_kv_eviction_bench_reports_every_case(tiny_models, tmp_path):
    argv = ["bench", "kv-eviction", "--model", str(tiny_models["llama"]), "--dtype", "float32"]
    argv += ["--context", "200", "--passkeys", "1", "--decode-tokens", "4", "--out", str(tmp_path)]
    argv += ["--speed-contexts", "300,4096"]
    args = build_parser(argv).parse_args(argv)
    assert args._run(args) == 0
    report = json.loads((tmp_path / "kv-eviction.json").read_text())
    rows = report["results"]
    assert [(r["policy"], r["budget"]) for r in rows] == [
        ("full", "100% (no budget)"),
        ("h2o", "25%"),
        ("streaming", "25%"),
        ("h2o", "50%"),
        ("streaming", "50%"),
        ("h2o", "100%"),
        ("streaming", "100%"),
    ]
    full = rows[0]
    by = {(r["policy"], r["budget"]): r for r in rows}
    # Nothing is evicted at 100%: streaming computes exactly what the full cache does; h2o the same attention
    # through the explicit softmax that sums the weights.
    assert by["streaming", "100%"]["ppl"] == full["ppl"]
    assert by["h2o", "100%"]["ppl"] == pytest.approx(full["ppl"], rel=1e-4)
    # A quarter of the context keeps a quarter of the KV bytes.
    assert by["h2o", "25%"]["budget_tokens"] == 48
    assert by["h2o", "25%"]["kv_mib_per_seq"] < by["h2o", "100%"]["kv_mib_per_seq"] / 3
    assert all(r["ppl"] > 1 and r["decode_tok_s"] > 0 and 0 <= r["passkey_acc"] <= 1 for r in rows)
    # The long decode-speed comparison: 4096 is capped at the model's 512 tokens less the generated ones.
    speeds = report["decode_speed"]
    assert [(r["asked"], r["context"], r["policy"], r["budget_tokens"]) for r in speeds] == [
        (300, 300, "full", "all"),
        (300, 300, "h2o", 144),
        (300, 300, "streaming", 144),
        (4096, 507, "full", "all"),
        (4096, 507, "h2o", 240),
        (4096, 507, "streaming", 240),
    ]
    assert all(r["decode_tok_s"] > 0 for r in speeds)
    assert [r["vs_full"] for r in speeds if r["policy"] == "full"] == [1.0, 1.0]
