"""The llama.cpp baseline is found only where its tools are, and never hides a missing converter."""

import os

import pytest

from sidecar.bench import llamacpp


def _tool(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    os.chmod(path, 0o755)


def test_no_tools_means_no_baseline(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert llamacpp.find_tools(None, None) is None
    assert llamacpp.find_tools(str(tmp_path), None) is None


def test_build_dir_and_source_tree_are_found(tmp_path):
    src = tmp_path / "llama.cpp"
    (src / "convert_hf_to_gguf.py").parent.mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text("")
    for name in ("llama-bench", "llama-server"):
        _tool(src / "build" / "bin" / name)
    tools = llamacpp.find_tools(str(src / "build"), None)
    assert tools["llama-bench"] == (src / "build" / "bin" / "llama-bench").resolve()
    assert tools["src"] == src.resolve()
    assert "llama-quantize" not in tools


def test_missing_converter_is_named(tmp_path):
    for name in ("llama-bench", "llama-server"):
        _tool(tmp_path / "bin" / name)
    with pytest.raises(ValueError, match="llama-cpp-src"):
        llamacpp.find_tools(str(tmp_path / "bin"), str(tmp_path / "nowhere"))


def test_precision_classes_match_llamacpp_types():
    assert llamacpp.OUTTYPES == {
        "float32": "f32",
        "bfloat16": "bf16",
        "float16": "f16",
        "int8": "q8_0",
        "int4": "q4_0",
    }


def test_batch1_speed_is_the_mean_or_the_fastest_run(tmp_path):
    bench = tmp_path / "llama-bench"
    bench.write_text(
        "#!/bin/sh\n"  # llama-bench -o json: a prompt row, then the generation row with its runs
        'echo \'[{"n_prompt": 512, "n_gen": 0, "avg_ts": 900.0, "samples_ts": [900.0]},'
        ' {"n_prompt": 0, "n_gen": 64, "avg_ts": 50.0, "samples_ts": [40.0, 60.0, 50.0]}]\'\n'
    )
    os.chmod(bench, 0o755)
    tools = {"llama-bench": bench}
    r = llamacpp.llama_bench(tools, tmp_path / "m.gguf", 0, 64, 2)
    assert (r["tok_s"], r["best_tok_s"]) == (50.0, 60.0)


def test_llama_bench_reads_the_row_asked_for_and_its_peak_rss(tmp_path):
    bench = tmp_path / "llama-bench"
    bench.write_text(
        "#!/bin/sh\nsleep 0.3\n"
        'echo \'[{"n_prompt": 256, "n_gen": 0, "avg_ts": 400.0, "samples_ts": [380.0, 420.0]}]\'\n'
    )
    os.chmod(bench, 0o755)
    r = llamacpp.llama_bench({"llama-bench": bench}, tmp_path / "m.gguf", 256, 0, 2)
    assert r["tok_s"] == 400.0 and r["best_tok_s"] == 420.0 and r["peak_rss_bytes"] > 0


@pytest.mark.parametrize(
    "script, said",
    [("exit 1", "llama-bench exited with 1"), ("kill -SEGV $$", "llama-bench was killed by SIGSEGV")],
)
def test_a_failing_llama_bench_is_an_error_naming_how_it_failed(tmp_path, script, said):
    bench = tmp_path / "llama-bench"
    bench.write_text(f"#!/bin/sh\n{script}\n")
    os.chmod(bench, 0o755)
    with pytest.raises(RuntimeError, match=said):
        llamacpp.llama_bench({"llama-bench": bench}, tmp_path / "m.gguf", 0, 64, 2)


def test_a_figure_its_defaults_crash_on_is_measured_without_repacking_and_the_crash_kept(tmp_path):
    # llama-bench that crashes on prompt processing unless weights stay in the file's layout (--repack 0),
    # as llama.cpp's repacked Q8_0 prompt path did on a Xeon with AMX; it logs every call's arguments
    from sidecar.bench.quant import _llama_figure

    bench, calls = tmp_path / "llama-bench", tmp_path / "calls"
    bench.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        "case \"$*\" in *'-p 256'*) case \"$*\" in *'--repack 0'*) ;; *) kill -SEGV $$ ;; esac ;; esac\n"
        'echo \'[{"n_prompt": 256, "n_gen": 0, "avg_ts": 300.0, "samples_ts": [300.0]},'
        ' {"n_prompt": 0, "n_gen": 64, "avg_ts": 50.0, "samples_ts": [50.0]}]\'\n'
    )
    os.chmod(bench, 0o755)
    tools, failures = {"llama-bench": bench}, {}
    gguf = tmp_path / "m-q8_0.gguf"
    assert _llama_figure(tools, gguf, 0, 64, 2, failures)["best_tok_s"] == 50.0
    assert failures == {}
    for _ in range(2):  # the second round goes straight to the setting that works
        assert _llama_figure(tools, gguf, 256, 0, 2, failures)["best_tok_s"] == 300.0
    assert (
        list(failures) == ["pp256"] and "SIGSEGV" in failures["pp256"] and "--repack 0" in failures["pp256"]
    )
    lines = calls.read_text().splitlines()
    assert len(lines) == 4 and "--repack" not in lines[0] + lines[1]
    assert lines[2].endswith("--repack 0") and lines[3].endswith("--repack 0")
