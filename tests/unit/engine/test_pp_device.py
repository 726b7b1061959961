"""Device fast paths on every pipeline stage (engine/pp_device.py), on CPU: each stage checks its own layers,
the pipeline takes a path where every stage passed it (a failing stage named), and each stage's plain decode
parts go through its graph step over its buffers, padded to its buckets, giving the eager pipeline's tokens.
(On a CPU nothing is captured: the step runs eagerly over the same buffers; Triton's switches are inert.)"""

from __future__ import annotations

import pytest

from sidecar.engine import pp_device, self_check
from tests.unit.engine.test_tensor_parallel import _pool_whole, _prompts
from tests.unit.engine.test_tp_device import _llm, _tokens


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    """Triton's switches inert on CPU tensors (no interpreter), in every stage's process."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_every_pipeline_stage_checks_and_replays_its_own_graphs(demo_dir, monkeypatch):
    """Pipeline stages (engine/pp_device.py): each stage checks its own layers, the pipeline takes a path where
    every stage passed it (a failing stage named), and each stage's decode parts go through its own graph steps
    over its buffers, padded to its buckets: the eager pipeline's tokens."""
    llm = _llm(demo_dir, "pipeline_parallel_size")
    pp, runner = llm.engine.tp, llm.engine.runner
    try:
        prompts = _prompts(llm.engine.vocab_size)[:5]
        want = _tokens(llm, prompts)
        # stage 0 without Triton (a later stage's answer comes over its pipe alike)
        with monkeypatch.context() as m:
            m.setattr(self_check, "triton_available", lambda: False)
            fallbacks = pp_device.start(pp, runner, force=True)
        triton = [p for p in self_check.default_paths(pp.stage_graphs) if p in self_check.TRITON_PATHS]
        assert triton and all(fallbacks[p] == "stage 0: triton is not installed" for p in triton)
        assert set(pp.device_checks[0]) == set(triton) and pp.device_checks[1] == {}
        assert runner.fast_paths.active() == ["cuda_graphs"]  # stage 0's flags: the pipeline's decision
        assert _tokens(llm, prompts) == want
        fallbacks = pp_device.start(pp, runner, force=True)
        assert pp.device_checks == {0: {}, 1: {}} and "cuda_graphs" in runner.fast_paths.active(), fallbacks
        stage0, seen = pp.stage_graphs, []
        run = stage0.graphs.run
        monkeypatch.setattr(stage0.graphs, "run", lambda b: (seen.append(b), run(b))[1])
        assert _tokens(llm, prompts) == want
        assert seen and set(seen) <= {1, 2, 4, 6} and stage0.buckets == [1, 2, 4, 6]
        _pool_whole(llm)
    finally:
        pp.close()
