"""The decode path through buffers and buckets against HF, the start-up self-check, enforce_eager,
resources after aborts and preemptions, and how the fast paths are reported."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine import self_check
from sidecar.model.kernels.cpu import norm_act
from sidecar.model.kernels.gpu_paths import PATH_NAMES
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy, make_prompts

MAX_NEW = 10


@pytest.fixture(autouse=True)
def _no_triton_interpreter(monkeypatch):
    """These tests stand simulated kernels behind the switches on the CPU code paths; with Triton's
    interpreter on (the root conftest sets it for the session without a GPU), a switched-on path would run the Triton
    kernel on CPU tensors instead of the simulated one."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(7, 900, 3, 40, seed=3)


def _generate(llm, prompts, lens):
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens])
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_padded_buckets_greedy_equals_plain_and_hf(tiny_models, prompts, kind):
    """7 requests finishing at different steps: decode batches of 7..1 rows run in buckets 8, 4, 2, 1
    (padded rows included) and must give HF's tokens, as the unpadded path does."""
    ref = hf_greedy(tiny_models[kind], prompts, MAX_NEW)
    lens = [MAX_NEW - i for i in range(len(prompts))]
    llm = LLM(model=str(tiny_models[kind]), dtype="float32", max_num_seqs=16)
    runner = llm.engine.runner
    buckets_seen = []
    fill = runner.inputs.fill
    runner.inputs.fill = lambda rows, sample, bucket, width: (
        buckets_seen.append((len(rows), bucket)),
        fill(rows, sample, bucket, width),
    )
    plain = _generate(llm, prompts, lens)
    assert all(n == b for n, b in buckets_seen)  # CPU default: exact sizes, no padding
    buckets_seen.clear()
    runner.set_decode_padding(True)
    padded = _generate(llm, prompts, lens)
    assert {(7, 8), (5, 8), (3, 4), (1, 1)} <= set(buckets_seen)
    assert padded == plain == [r[:n] for r, n in zip(ref, lens)]
    assert_pool_whole(llm)


@pytest.fixture()
def demo_llm(demo_dir):
    llm = LLM(model=str(demo_dir), dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=8)
    yield llm
    llm.engine.runner.prepare_fast_paths()  # back to the CPU default


def _break_paths(monkeypatch, model):
    """Simulated kernels behind two switches: the norm one raises, the silu*mul one computes wrong values."""
    fp = model.fast_paths
    add_rms_norm, silu_mul = norm_act.add_rms_norm, norm_act.silu_mul

    def bad_norm(h, delta, weight, eps):
        if fp.norm:
            raise RuntimeError("norm kernel failed to launch")
        return add_rms_norm(h, delta, weight, eps)

    def bad_silu(gu):
        out = silu_mul(gu)
        return out * 1.5 if fp.silu_mul else out

    monkeypatch.setattr(norm_act, "add_rms_norm", bad_norm)
    monkeypatch.setattr(norm_act, "silu_mul", bad_silu)


def test_self_check_turns_off_only_the_failing_paths(demo_llm, monkeypatch):
    eng = demo_llm.engine
    runner = eng.runner
    ps = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [18, 19]]
    before = _generate(demo_llm, ps, [6, 6, 6])
    bits = lambda t: t.view(torch.int32).clone()  # noqa: E731  (bitwise: never-used blocks may hold NaN)
    kv_before = [(bits(k), bits(v)) for k, v in runner.kv_caches]  # cached prefix blocks included
    _break_paths(monkeypatch, runner.model)
    runner.prepare_fast_paths(force_check=True)
    info = runner.fast_path_info()
    assert set(info["fast_path_fallbacks"]) == {"norm", "silu_mul"}
    assert "RuntimeError: norm kernel failed to launch" in info["fast_path_fallbacks"]["norm"]
    assert "differ" in info["fast_path_fallbacks"]["silu_mul"]
    # weight_only: not quantized; device_sampler: the engine hands the runner its check
    assert set(info["fast_paths"]) == {"attention", "rope_kv", "gemv", "cuda_graphs", "device_sampler"}
    assert runner.buckets == [1, 2, 4, 8]  # graphs on: padded buckets (replayed eagerly on CPU)
    assert all(
        torch.equal(bits(k), k0) and torch.equal(bits(v), v0)
        for (k, v), (k0, v0) in zip(runner.kv_caches, kv_before)
    )  # the probe put the pool back
    assert (
        _generate(demo_llm, ps, [6, 6, 6]) == before
    )  # the broken paths stayed off; prefix hits still right
    assert_pool_whole(demo_llm)


def test_self_check_drops_a_path_that_fails_with_the_others(demo_llm, monkeypatch):
    runner = demo_llm.engine.runner
    fp = runner.model.fast_paths
    silu_mul = norm_act.silu_mul
    # wrong only when attention and silu_mul are both on: each passes alone, together they fail
    monkeypatch.setattr(
        norm_act, "silu_mul", lambda gu: silu_mul(gu) * (2.0 if fp.silu_mul and fp.attention else 1.0)
    )
    fallbacks = self_check.run(runner, ["attention", "silu_mul", "norm"])
    assert fp.active() == [] and set(fallbacks) == {"attention", "silu_mul", "norm"}
    assert all("together with" in r for r in fallbacks.values())


def test_device_sampler_checked_only_with_a_check(demo_llm):
    runner = demo_llm.engine.runner
    assert self_check.run(runner, ["device_sampler"]) == {"device_sampler": "no check for the device sampler"}
    seen = []
    assert self_check.run(runner, [], sampler_check=lambda logits: seen.append(logits.shape) or None) == {}
    assert runner.fast_paths.active() == ["device_sampler"] and seen[0][0] == self_check.PROBE_SEQS
    self_check.run(runner, [], sampler_check=lambda logits: "sampled 7, argmax 3")
    assert runner.fast_path_info()["fast_path_fallbacks"] == {"device_sampler": "sampled 7, argmax 3"}


def test_enforce_eager_forces_every_path_off(demo_dir):
    llm = LLM(model=str(demo_dir), dtype="float32", block_size=8, num_kv_blocks=64, enforce_eager=True)
    runner = llm.engine.runner
    assert llm.engine.config.enforce_eager is True
    runner.prepare_fast_paths(force_check=True)  # even when asked, nothing turns on
    assert runner.fast_paths.active() == [] and not runner.graphs.captured
    info = llm.engine.model_info
    assert info["fast_paths"] == []
    assert info["fast_path_fallbacks"] == {name: "enforce_eager" for name in PATH_NAMES}
    assert runner.buckets == list(range(1, runner.inputs.max_batch + 1))
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model=str(demo_dir), enforce_eager="yes")


def test_cli_flag_sets_enforce_eager():
    import argparse

    from sidecar.server.flags import add_config_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_config_arguments(p)
    assert config_from_args(p.parse_args(["--enforce-eager"]), env={}).engine.enforce_eager is True
    assert config_from_args(p.parse_args([]), env={}).engine.enforce_eager is False


def test_cpu_default_reports_no_fast_paths(demo_llm):
    eng = demo_llm.engine
    assert eng.model_info["fast_paths"] == [] and eng.model_info["fast_path_fallbacks"] == {}
    assert eng.stats()["fast_path_active"] == {name: False for name in PATH_NAMES}


def test_pool_whole_after_abort_and_preemption_in_padded_buckets(demo_dir):
    # 12 blocks of 8 tokens for 6 requests growing to ~40 tokens each: preemption is certain
    llm = LLM(model=str(demo_dir), dtype="float32", block_size=8, num_kv_blocks=12, max_num_seqs=6)
    eng = llm.engine
    eng.runner.set_decode_padding(True)
    ps = make_prompts(6, 250, 10, 20, seed=5)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    solo = [llm.generate([p], params)[0].token_ids for p in ps]
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        steps += 1
        if steps == 12:  # mid-run, while the running batch decodes
            eng.abort("r1")
            eng.abort("r4")
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert eng.stats()["num_preemptions"] > 0
    assert done["r1"].finish_reason == "abort" and done["r4"].finish_reason == "abort"
    for i in (0, 2, 3, 5):
        assert done[f"r{i}"].token_ids == solo[i]
    assert_pool_whole(llm)


def test_metrics_gauge_per_fast_path():
    from sidecar.server.metrics import Metrics

    states = {name: name == "cuda_graphs" for name in PATH_NAMES}
    body = Metrics(lambda: {"fast_path_active": states}).render()[0].decode()
    assert 'sidecar_fast_path_active{path="cuda_graphs"} 1.0' in body
    assert 'sidecar_fast_path_active{path="attention"} 0.0' in body


def test_model_info_proto_carries_fast_paths():
    from sidecar.v1 import sidecar_pb2 as pb

    m = pb.ModelInfo(model="m", fast_paths=["cuda_graphs"], fast_path_fallbacks={"attention": "boom"})
    back = pb.ModelInfo.FromString(m.SerializeToString())
    assert list(back.fast_paths) == ["cuda_graphs"] and dict(back.fast_path_fallbacks) == {
        "attention": "boom"
    }


def test_failed_capture_falls_back_to_eager_decode(demo_llm, monkeypatch):
    """A capture that raises (here: CUDA capture asked for on a machine without CUDA) turns the graphs path
    off with its reason; decoding goes on eagerly at exact sizes with the same output."""
    runner = demo_llm.engine.runner
    ps = [[3, 4, 5], [6, 7, 8, 9]]
    before = _generate(demo_llm, ps, [5, 5])
    runner.fast_paths.cuda_graphs = True
    monkeypatch.setattr(runner.graphs, "device", torch.device("cuda"))
    runner.capture_graphs()
    assert not runner.fast_paths.cuda_graphs and not runner.graphs.captured
    assert runner.fast_path_info()["fast_path_fallbacks"]["cuda_graphs"].startswith("capture failed")
    assert runner.buckets == list(range(1, runner.inputs.max_batch + 1))
    monkeypatch.undo()
    assert _generate(demo_llm, ps, [5, 5]) == before
    assert_pool_whole(demo_llm)
