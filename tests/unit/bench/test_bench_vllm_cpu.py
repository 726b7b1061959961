"""The vLLM-CPU baseline's plumbing: finding the venv, the worker's environment and protocol, errors.

vLLM itself is never a dependency of the project, so the end-to-end tests run the real worker script in
a real subprocess of a real virtual environment whose ``vllm`` package is a small stand-in that
generates the requested number of tokens."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sidecar.bench import vllm_cpu, vllm_cpu_worker

STAND_IN = textwrap.dedent("""
    import os, time
    __version__ = "0.0-stand-in"
    if os.environ.get("STAND_IN_FAIL_LOAD"):
        raise ImportError("no CPU backend in this build")

    class SamplingParams:
        def __init__(self, max_tokens, temperature, ignore_eos, detokenize):
            assert temperature >= 0.0 and ignore_eos
            self.max_tokens, self.temperature = max_tokens, temperature

    class _Completion:
        def __init__(self, ids):
            self.token_ids = ids

    class _Output:
        def __init__(self, ids):
            self.outputs = [_Completion(ids)]

    class LLM:
        def __init__(self, model, dtype, **kw):
            self.kw = kw
            print("INFO stand-in loading", model, dtype, flush=True)  # vLLM's logs go to stdout too

        def generate(self, prompts, params, use_tqdm):
            assert len(prompts) == len(params)
            time.sleep(0.001 * sum(p.max_tokens for p in params))
            # a sampled request (temperature > 0) is marked by one token more than asked for
            return [_Output(list(range(sp.max_tokens + (sp.temperature > 0)))) for p, sp in zip(prompts, params)]
""")


@pytest.fixture(scope="module")
def stand_in_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python3*")) / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(STAND_IN)
    return root


def test_missing_venv_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"vllm-cpu: .*nowhere is not a directory"):
        vllm_cpu.venv_python(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"vllm-cpu: .* \(no bin/python\)"):
        vllm_cpu.venv_python(str(tmp_path))


def test_venv_without_vllm_is_named(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    with pytest.raises(ValueError, match="vllm-cpu: vLLM is not installed in"):
        vllm_cpu.venv_python(str(tmp_path))


def test_worker_environment_binds_threads_and_keeps_ours_out():
    env = vllm_cpu.environment(2, 2.0, {"PYTHONPATH": "/repo", "GLIBC_TUNABLES": "x", "HOME": "/h"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "PYTHONPATH" not in env and "GLIBC_TUNABLES" not in env and env["HOME"] == "/h"
    assert vllm_cpu.environment(1, 0.2, {})["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert vllm_cpu.environment(1, 0.2, {})["VLLM_CPU_KVCACHE_SPACE"] == "1"
    with pytest.raises(ValueError, match="threads"):
        vllm_cpu.environment(0, 1.0, {})


def test_command_runs_the_worker_script_with_the_spec():
    cmd = vllm_cpu.command(Path("/v/bin/python"), {"model": "/m", "dtype": "bfloat16"})
    assert cmd[0] == "/v/bin/python" and Path(cmd[1]).is_file() and cmd[1].endswith("vllm_cpu_worker.py")
    assert json.loads(cmd[2]) == {"model": "/m", "dtype": "bfloat16"}


def test_answer_lines_are_told_apart_from_logs():
    mark = vllm_cpu_worker.MARK
    assert vllm_cpu.parse_line(f'{mark}RESULT {{"output_tok_s": 12.5}}\n') == (
        "RESULT",
        {"output_tok_s": 12.5},
    )
    assert vllm_cpu.parse_line(f'{mark}ERROR {{"error": "x"}}') == ("ERROR", {"error": "x"})
    assert vllm_cpu.parse_line("INFO 11-24 RESULT {}") is None
    assert vllm_cpu.parse_line(f"{mark}PROGRESS {{}}") is None


def test_b1_rate_excludes_the_first_token():
    assert vllm_cpu_worker.b1_rate(65, 0.5, 2.5) == pytest.approx(32.0)


def test_worker_measures_through_the_protocol(stand_in_venv, tmp_path):
    work = [([5] * 10, 3), ([6] * 20, 5)]
    with vllm_cpu.VllmCpu(str(stand_in_venv), str(tmp_path), "bfloat16", 2, load_timeout=120) as v:
        assert v.version == "0.0-stand-in"
        b1 = v.call("b1", prompt=[1, 2, 3], n=8, repeats=2)
        assert len(b1["b1_by_run"]) == 2 and b1["b1_decode_tok_s"] == max(b1["b1_by_run"]) > 0
        pre = v.call("prefill", prompts=[[1] * 32, [2] * 32])
        assert pre["prefill_tokens"] == 32 and len(pre["prefill_by_run"]) == 2
        row = v.call("workload", work=work)
        assert row["output_tokens"] == 8 and row["output_tok_s"] > 0 and row["peak_rss_bytes"] > 0
        with pytest.raises(RuntimeError, match="op: unknown command 'nope'"):
            v.call("nope")
        assert v.call("workload", work=work)["output_tokens"] == 8  # still serving after an error
        proc = v.proc
    assert proc.returncode == 0


def test_a_failed_load_is_reported_with_its_reason(stand_in_venv, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_FAIL_LOAD", "1")
    with pytest.raises(RuntimeError, match="vLLM failed to load the model: ImportError: no CPU backend"):
        vllm_cpu.VllmCpu(str(stand_in_venv), str(tmp_path), "bfloat16", 1, load_timeout=120)


def test_the_throughput_bench_runs_the_baseline_in_its_own_dtype(stand_in_venv, tmp_path, monkeypatch):
    """``--baseline-dtype`` reaches the vLLM worker (vLLM-CPU in float32 beside our bf16 on an AVX2-only CPU);
    without it the baseline runs ours."""
    import argparse

    from sidecar.bench import throughput

    seen = []
    real_init = vllm_cpu.VllmCpu.__init__

    def spy(self, venv, model_dir, dtype, *a, **kw):
        seen.append(dtype)
        real_init(self, venv, model_dir, dtype, *a, load_timeout=120, **kw)

    monkeypatch.setattr(vllm_cpu.VllmCpu, "__init__", spy)
    work = [([5] * 10, 3), ([6] * 20, 5)]
    for given, expected in ((None, "bfloat16"), ("float32", "float32")):
        parser = argparse.ArgumentParser()
        throughput.add_arguments(parser)
        args = parser.parse_args(
            ["--dtype", "bfloat16", "--vllm-cpu", str(stand_in_venv), "--b1-tokens", "4"]
            + ([] if given is None else ["--baseline-dtype", given])
        )
        args.baseline_dtype = args.baseline_dtype or args.dtype  # as the bench resolves it
        args.model_dir, args.prefill_prompts = str(tmp_path), [[1] * 8, [2] * 8]
        with throughput._open_vllm_cpu(args, [work], [args.prefill_prompts]) as session:
            assert throughput._vllm_cpu_workload(session, work)["output_tokens"] == 8
        assert seen[-1] == expected


def test_the_throughput_bench_samples_the_baselines_workload_at_its_temperature(stand_in_venv, tmp_path):
    """``--temperature`` reaches the vLLM worker's workload requests (the stand-in answers a sampled request
    with one token more); its batch-1 and prefill requests stay greedy (b1 checks the count it asked for)."""
    import argparse

    from sidecar.bench import throughput

    work = [([5] * 10, 3), ([6] * 20, 5)]
    for temperature, tokens in (("0", 8), ("0.7", 10)):
        parser = argparse.ArgumentParser()
        throughput.add_arguments(parser)
        args = parser.parse_args(
            [
                "--dtype",
                "bfloat16",
                "--vllm-cpu",
                str(stand_in_venv),
                "--b1-tokens",
                "4",
                "--temperature",
                temperature,
            ]
        )
        args.baseline_dtype = args.dtype
        args.model_dir, args.prefill_prompts = str(tmp_path), [[1] * 8, [2] * 8]
        with throughput._open_vllm_cpu(args, [work], [args.prefill_prompts]) as session:
            assert throughput._vllm_cpu_workload(session, work)["output_tokens"] == tokens
            assert (
                throughput._vllm_cpu_figures(args, session, work, args.prefill_prompts)["b1_decode_tok_s"] > 0
            )


def test_rounds_take_turns_and_a_failing_baseline_drops_out():
    """``interleave``: in each round every system runs the round's workload, then its figures, the order
    rotating from round to round; a baseline that fails leaves the later rounds and the results; ours failing
    is raised. ``combine_rounds`` sums the workloads, ``best_figures`` keeps each rate's fastest round."""
    from sidecar.bench import throughput

    calls = []

    def system(name, fail_in=None):
        def phase(kind):
            def run(r):
                calls.append((name, kind, r))
                if (kind, r) == fail_in:
                    raise RuntimeError(f"{name} broke")
                if kind == "figures":
                    return {"b1_decode_tok_s": 10.0 + (r == 1), "prefill_tok_s": 100.0 - r, "version": "v"}
                return {"system": name, "seconds": 1.0 + len(calls), "output_tokens": 10, "output_tok_s": 1.0}

            return run

        return name, {"workload": phase("workload"), "figures": phase("figures")}

    got = throughput.interleave(3, [system("ours"), system("a"), system("b")])
    assert calls == [
        ("ours", "workload", 0),
        ("a", "workload", 0),
        ("b", "workload", 0),
        ("ours", "figures", 0),
        ("a", "figures", 0),
        ("b", "figures", 0),
        ("a", "workload", 1),
        ("b", "workload", 1),
        ("ours", "workload", 1),
        ("a", "figures", 1),
        ("b", "figures", 1),
        ("ours", "figures", 1),
        ("b", "workload", 2),
        ("ours", "workload", 2),
        ("a", "workload", 2),
        ("b", "figures", 2),
        ("ours", "figures", 2),
        ("a", "figures", 2),
    ]
    assert [r["seconds"] for r in got["ours"]["workload"]] == [2.0, 10.0, 15.0]
    total = throughput.combine_rounds(got["ours"]["workload"])
    assert (
        total["seconds"] == 27.0
        and total["output_tokens"] == 30
        and total["round_seconds"] == [2.0, 10.0, 15.0]
    )
    assert total["output_tok_s"] == 30 / 27.0
    best = throughput.best_figures(got["ours"]["figures"])
    assert best["b1_decode_tok_s"] == 11.0 and best["prefill_tok_s"] == 100.0 and best["version"] == "v"
    assert best["prefill_tok_s_by_round"] == [100.0, 99.0, 98.0]
    calls.clear()
    got = throughput.interleave(3, [system("ours"), system("a", fail_in=("figures", 1)), system("b")])
    assert set(got) == {"ours", "b"} and len(got["ours"]["workload"]) == len(got["b"]["figures"]) == 3
    assert [c for c in calls if c[0] == "a"] == [
        ("a", "workload", 0),
        ("a", "figures", 0),
        ("a", "workload", 1),
        ("a", "figures", 1),
    ]
    with pytest.raises(RuntimeError, match="ours broke"):
        throughput.interleave(2, [system("ours", fail_in=("workload", 1)), system("a")])


def test_the_throughput_bench_runs_rounds_against_the_baseline(stand_in_venv, tmp_path, monkeypatch):
    """``sidecar bench throughput --rounds 2``: our engine (the demo model) and the vLLM-CPU worker stay loaded
    and take turns over two workloads; the report holds each round's seconds and ratio, and totals that are
    their sums."""
    import argparse

    from sidecar.bench import throughput

    monkeypatch.setattr(throughput, "_llamacpp_tools", lambda args: None)  # no llama.cpp build in this test
    monkeypatch.setattr(throughput, "measure_bandwidth", lambda device="cpu": 1e10)
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            "demo",
            "--dtype",
            "float32",
            "--num-requests",
            "3",
            "--prompt-len",
            "4:8",
            "--output-len",
            "2:4",
            "--rounds",
            "2",
            "--baselines",
            "",
            "--b1-tokens",
            "4",
            "--prefill-tokens",
            "8",
            "--threads",
            "1",
            "--vllm-cpu",
            str(stand_in_venv),
            "--out",
            str(tmp_path),
        ]
    )
    assert throughput.run(args) == 0
    report = json.loads(next(tmp_path.glob("throughput*.json")).read_text())
    ours, vllm = report["results"]
    assert ours["system"] == "llm-sidecar" and vllm["system"].startswith("vLLM-CPU 0.0-stand-in")
    vocab = json.loads((Path(report["args"]["model_dir"]) / "config.json").read_text())["vocab_size"]
    works = [throughput.make_workload(3, (4, 8), (2, 4), vocab, seed) for seed in (0, 1)]
    assert ours["output_tokens"] == vllm["output_tokens"] == sum(n for w in works for _, n in w)
    for row in (ours, vllm):
        assert len(row["round_seconds"]) == 2 and row["seconds"] == pytest.approx(sum(row["round_seconds"]))
    assert vllm["round_speedups"] == pytest.approx(
        [v / o for v, o in zip(vllm["round_seconds"], ours["round_seconds"])]
    )
    assert report["batch1"]["b1_ratio_vs_vllm_cpu"] > 0
    for row in (ours, report["vllm_cpu"]):  # the figures measured each round, the fastest reported
        assert len(row["prefill_tok_s_by_round"]) == 2 and row["prefill_tok_s"] == max(
            row["prefill_tok_s_by_round"]
        )
    with pytest.raises(ValueError, match="rounds: must be >= 1"):
        throughput.run(parser.parse_args(["--model", "demo", "--rounds", "0", "--baselines", ""]))
