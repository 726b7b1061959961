"""``sidecar bench throughput --stub-forward``: the workload runs through the real engine with the model's
forward replaced by fixed logits, and every step's host time is counted."""

from __future__ import annotations

import argparse

from sidecar import LLM
from sidecar.bench.throughput import add_arguments, host_steps, make_workload


def test_stubbed_forward_runs_the_workload_without_the_model(demo_dir):
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--stub-forward", "--max-num-seqs", "4"])
    llm = LLM(model=str(demo_dir), dtype="float32", max_num_seqs=4, num_kv_blocks=128, block_size=8)
    model = llm.engine.runner.model
    layer_calls = []
    model.layers[0].register_forward_hook(lambda *a: layer_calls.append(1))
    work = make_workload(10, (5, 20), (3, 9), 200, seed=1)
    row = host_steps(llm, args, work)
    assert layer_calls == []  # no decoder layer ran
    assert row["output_tokens"] == sum(n for _, n in work)  # every request got all its tokens
    assert row["steps"] >= max(n for _, n in work) and row["full_batch_steps"] > 0
    assert row["full_batch_step_ms"] > 0
    out = llm.generate([[5, 6, 7]], None)[0]  # the stub's logits: token 3 wins every step
    assert set(out.token_ids) == {3}
    eng = llm.engine
    assert not eng.requests and eng.kv.num_free_blocks() == eng.kv.num_blocks
