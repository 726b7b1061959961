"""KV groups on the device paths: a grouped model's decode step (every group's slots and tables read from the
persistent buffers) runs on the ``meta`` device without host reads, so CUDA graphs can capture it; and with
the device paths chosen by the start-up self-check (the Triton kernels, under the interpreter here) Gemma 2's
sliding group frees the blocks its window passed while greedy float32 output equals HF transformers, freed
blocks overwritten, with preemption and chunked prefill."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine.input_buffers import DecodeInputs, DecodeRow, decode_step
from sidecar.engine.kv_groups import plan_groups
from sidecar.model.kernels.triton import attention as triton_attention
from sidecar.model.loader import load_model
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.engine.test_kv_groups import _scribble_freed
from tests.unit.model.family_checkpoints import build_family_checkpoint
from tests.unit.model.kernels.triton.test_triton_model import _spy

NEW = 16
PROMPTS = [[5 + (11 * i + 5 * j) % 700 for j in range(n)] for i, n in enumerate([37, 52, 23])]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, demo_dir):
    return build_family_checkpoint("gemma2", tmp_path_factory.mktemp("kv_groups_dev") / "gemma2", demo_dir)


def test_a_grouped_decode_step_runs_on_meta_without_host_reads(gemma2_dir):
    loaded = load_model(EngineConfig(model=str(gemma2_dir), dtype="float32", device="cpu"))
    args = loaded.args
    plan, reason = plan_groups(args)
    assert reason is None and plan is not None and len(plan.groups) > 1
    with torch.device("meta"):
        model = type(loaded.model)(args)
    model.init_rope(64, torch.device("meta"), torch.float32)
    shape = (12, 8, args.num_kv_heads, args.head_dim)
    storage = [
        (torch.empty(shape, device="meta"), torch.empty(shape, device="meta")) for _ in range(plan.per_group)
    ]
    kv = [storage[j] for j in plan.storage_of(args.num_layers)]
    inp = DecodeInputs(4, 3, 8, torch.device("meta"), plan.group_of())
    n = inp.num_groups - 1
    rows = [
        DecodeRow(5, 9, 17, 10, [1, 2], group_slots=(41,) * n, group_tables=([0, 5],) * n),
        DecodeRow(6, 3, 27, 4, [3], group_slots=(51,) * n, group_tables=([6],) * n),
    ]
    for on in (False, True):
        model.fast_paths.attention = on
        inp.fill(rows, [0, 1], bucket=4, width=3)
        with torch.inference_mode():
            hidden = decode_step(model, kv, inp, 4)
        assert hidden.device.type == "meta" and hidden.shape == (4, args.hidden_size)


def test_grouped_gemma2_on_the_device_paths_matches_hf(gemma2_dir, monkeypatch):
    llm = LLM(
        model=str(gemma2_dir),
        dtype="float32",
        block_size=8,
        num_kv_blocks=16,
        max_num_batched_tokens=10,  # prompt chunks end inside windows
        enable_prefix_caching=False,
    )
    runner, kv = llm.engine.runner, llm.engine.kv
    assert kv.plan is not None and len(kv.groups) > 1
    runner.fast_paths.attention = True  # the Triton decode attention, as on CUDA
    calls: list = []
    _spy(monkeypatch, triton_attention, "paged_decode_attention", calls)
    scribbled = _scribble_freed(llm)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(gemma2_dir, PROMPTS, NEW)
    assert calls and kv.num_released_blocks > 0 and scribbled
    assert llm.engine.scheduler.num_preemptions > 0
    runner.fast_paths.attention = False
    assert_pool_whole(llm)
