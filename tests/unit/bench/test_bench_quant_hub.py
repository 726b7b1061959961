"""``sidecar bench quant``'s hub modes: the bench's own float weights packed as GPTQ, AWQ, W8A8 and FP8
directories, loaded through the loader by their quantization_config and measured in the same run as ours,
with the issue's figures (memory against the file, decode against our int4, prefill against our bf16)."""

from __future__ import annotations

import argparse
import json

import pytest

from sidecar.bench import hub_pack
from sidecar.bench.quant import HUB_MODES, add_arguments, head_precision, run, width


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_hub_modes_are_the_packers_formats_with_our_heads_and_llama_cpp_types():
    assert set(HUB_MODES) == set(hub_pack.FORMATS)
    assert [width(m) for m in HUB_MODES] == ["int4", "int4", "int8", "int8"]
    assert head_precision("gptq-int4", "auto") == "int8" and head_precision("awq-int4", "same") == "int4"
    assert head_precision("w8a8", "none") == "bf16"


def test_hub_modes_load_the_packed_weights_and_report_the_figures(tiny_models, tmp_path, monkeypatch):
    import torch

    from sidecar.bench import quant

    threads = torch.get_num_threads()

    def in_process(spec):  # the measurement as the bench's worker takes it, without a process each
        try:
            return quant._worker(spec)
        finally:
            torch.set_num_threads(threads)

    monkeypatch.setattr(quant, "_run_worker", in_process)
    out = tmp_path / "out"
    argv = ["--model", str(tiny_models["qwen2"]), "--modes", "bf16,int4," + ",".join(HUB_MODES)]
    argv += ["--group-size", "32", "--max-tokens", "3", "--prefill-tokens", "16", "--threads", "1"]
    argv += ["--stream-len", "24", "--llama-cpp", str(tmp_path / "no-llama-cpp"), "--out", str(out)]
    assert run(_args(*argv)) == 0
    rows = {r["mode"]: r for r in json.loads((out / "quant.json").read_text())["runs"]}
    loaded = {m: rows[m]["quantization"] for m in HUB_MODES}
    assert loaded == {
        "gptq-int4": "gptq-int4",
        "awq-int4": "awq-int4",
        "w8a8": "compressed-tensors-w8a8",
        "fp8": "fp8",
    }
    for m in HUB_MODES:
        r = rows[m]
        assert r["lm_head"] == "int8" == r["head"]  # the float head at our default, as under int4
        assert r["file_bytes"] > 0 and r["weight_vs_file"] == r["weight_bytes"] / r["file_bytes"]
        assert r["b1_vs_int4"] == r["decode_tok_s_b1"] / rows["int4"]["decode_tok_s_b1"]
        assert r["prefill_vs_bf16"] == r["prefill_tok_s"] / rows["bf16"]["prefill_tok_s"]
    assert set(json.loads((out / "quant.json").read_text())["quality"]["main"]) == {
        "bf16",
        "int8",
        "int4",
        *HUB_MODES,
    }


def test_paired_rounds_without_a_baseline_pair_our_modes(tiny_models, tmp_path, monkeypatch):
    """``--paired-only`` with neither llama.cpp nor vLLM-CPU runs our modes' rounds against one another."""
    import torch

    from sidecar.bench import quant

    threads = torch.get_num_threads()

    def in_process(spec):
        try:
            return quant._worker(spec)
        finally:
            torch.set_num_threads(threads)

    monkeypatch.setattr(quant, "_run_worker", in_process)
    out = tmp_path / "out"
    argv = ["--model", str(tiny_models["qwen2"]), "--modes", "int4,gptq-int4", "--paired-only"]
    argv += ["--group-size", "32", "--max-tokens", "3", "--prefill-tokens", "16", "--threads", "1"]
    argv += ["--b1-rounds", "2", "--llama-cpp", str(tmp_path / "no-llama-cpp"), "--out", str(out)]
    assert run(_args(*argv)) == 0
    rows = {r["mode"]: r for r in json.loads((out / "quant.json").read_text())["runs"]}
    r = rows["gptq-int4"]
    assert r["b1_paired_vs_int4"] == r["b1_paired_tok_s"] / rows["int4"]["b1_paired_tok_s"]
    assert all(rows[m]["b1_paired_median_tok_s"] > 0 for m in rows)


def test_a_head_mode_the_hub_formats_cannot_take_is_refused():
    with pytest.raises(ValueError, match="quantize-lm-head: int4 does not apply"):
        run(_args("--model", "small", "--modes", "gptq-int4", "--quantize-lm-head", "int4"))
