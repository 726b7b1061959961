"""``sidecar bench throughput --quantization``: our engine quantized on load, the llama.cpp baseline on the
GGUF of the same class, and the unquantized baselines refused by name."""

from __future__ import annotations

import argparse

import pytest

from sidecar.bench import llamacpp, throughput


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    throughput.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("extra", [[], ["--baselines=", "--vllm-cpu", "/nowhere"]])
def test_unquantized_baselines_are_refused_by_name(demo_dir, extra):
    args = _args("--model", str(demo_dir), "--quantization", "int4", *extra)
    with pytest.raises(ValueError, match="quantization: int4 applies to our engine and llama.cpp only"):
        throughput.run(args)


def test_our_engine_loads_the_weights_quantized(demo_dir):
    args = _args(
        "--model", str(demo_dir), "--quantization", "int8", "--dtype", "float32", "--max-num-seqs", "2"
    )
    args.model_dir = str(demo_dir)
    work = throughput.make_workload(2, (20, 24), (2, 3), 200, seed=0)
    llm = throughput.load_ours(args, work)
    assert llm.engine.model_info["quantization"] == "int8"
    row = throughput.ours_workload(llm, args, work)
    assert row["output_tokens"] == sum(n for _, n in work)


def test_the_llama_cpp_baseline_reads_the_gguf_of_the_same_class(demo_dir, tmp_path, monkeypatch):
    picked = []
    monkeypatch.setattr(llamacpp, "find_tools", lambda *a: {"llama-server": tmp_path / "x"})

    def gguf_for(tools, model_dir, precision, cache_dir):
        picked.append(precision)
        return tmp_path / f"m-{llamacpp.OUTTYPES[precision]}.gguf"

    monkeypatch.setattr(llamacpp, "gguf_for", gguf_for)
    for argv, want in ((["--quantization", "int4"], "int4"), ([], "bfloat16")):
        args = _args("--model", str(demo_dir), "--baselines=", *argv)
        args.model_dir, args.baseline_dtype = str(demo_dir), "bfloat16"
        _, gguf, _ = throughput._llamacpp_tools(args)
        assert picked[-1] == want and gguf.name == f"m-{llamacpp.OUTTYPES[want]}.gguf"
    assert llamacpp.OUTTYPES["int4"] == "q4_0" and llamacpp.OUTTYPES["int8"] == "q8_0"
