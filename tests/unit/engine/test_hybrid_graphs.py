"""Hybrid models (Qwen3.5, Qwen3-Next: gated DeltaNet layers with per-sequence state slots among attention
layers) on the device fast paths and decode graphs: with the paths the start-up self-check turns on and padded
graph buckets (the CPU form of graphs: the same step over the same persistent buffers, run eagerly), greedy
float32 equals the eager engine and HF transformers over shrinking batches, preemption and a cancelled request,
the state slots and the KV pool whole after; padded rows step the scratch state row, never a sequence's; the
padded step makes no host reads (``meta``); the self-check puts back every state row it touched and compares
the states its probe ends with (a path stepping a wrong slot fails it)."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine import self_check
from sidecar.engine.input_buffers import DecodeInputs, DecodeRow, decode_step
from sidecar.engine.linear_state import LinearStates
from sidecar.model import deltanet
from sidecar.model.loader import load_model
from tests.unit.engine.test_engine_vs_hf import hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint
from tests.unit.model.kernels.deltanet_cases import padded_rows_leave_the_real_rows
from tests.unit.model.test_hybrid_vs_hf import PROMPTS, assert_slots_whole

KINDS = ("qwen3_5", "qwen3_next")
MAX_NEW = 8
LENS = [8, 3, 6, 8, 5, 2]  # the batch shrinks as requests finish: buckets 8, 4, 2, 1 with padded rows


@pytest.fixture(autouse=True)
def _no_triton_interpreter(monkeypatch):
    """The switched-on paths take our CPU kernels (as in test_runner_fast_paths.py), not Triton's interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("hybrid_graphs")
    return {k: build_family_checkpoint(k, root / k, demo_dir) for k in KINDS}


@pytest.fixture(scope="module")
def ref(dirs):
    out = hf_greedy(dirs["qwen3_5"], PROMPTS, MAX_NEW)
    assert_not_degenerate(out)
    return out


def _forced(path, paths=None, **kw) -> LLM:
    """An engine whose device paths the self-check decided (on CPU too: every path, or ``paths`` alone to
    keep a test cheap), graphs on."""
    llm = LLM(model=str(path), dtype="float32", **kw)
    runner = llm.engine.runner
    if paths is None:
        runner.prepare_fast_paths(force_check=True)
    else:
        self_check.run(runner, paths)
        runner.capture_graphs()
    fallbacks = runner.fast_path_info()["fast_path_fallbacks"]
    assert "cuda_graphs" in runner.fast_paths.active(), fallbacks
    assert not any("linear-attention" in why for why in fallbacks.values()), fallbacks
    return llm


def _spy_padding(runner) -> list[tuple[int, int, list[int]]]:
    """(rows, bucket, the padded rows' state slots) of every decode fill."""
    seen, fill = [], runner.inputs.fill

    def spied(rows, sample, bucket, width):
        fill(rows, sample, bucket, width)
        seen.append((len(rows), bucket, runner.inputs.state_slots[len(rows) : bucket].tolist()))

    runner.inputs.fill = spied
    return seen


def _run(llm: LLM, lens) -> list[list[int]]:
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens])
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_padded_graph_buckets_equal_eager_and_hf(dirs, ref, kind):
    # Qwen3.5 with every device path the self-check passes; Qwen3-Next (sparse MLPs too) with the graphs, and
    # against the eager engine alone (whose equality to HF test_hybrid_moe_vs_hf.py shows)
    fast = _forced(dirs[kind], None if kind == "qwen3_5" else ["cuda_graphs"], max_num_seqs=8)
    runner = fast.engine.runner
    assert runner.buckets == [1, 2, 4, 8]
    seen = _spy_padding(runner)
    got = _run(fast, LENS)
    eager = LLM(model=str(dirs[kind]), dtype="float32", max_num_seqs=8, enforce_eager=True)
    assert got == _run(eager, LENS)
    if kind == "qwen3_5":
        assert got == [r[:n] for r, n in zip(ref, LENS)]
    padded = [(n, b, pads) for n, b, pads in seen if b > n]
    assert {(6, 8), (3, 4)} <= {(n, b) for n, b, _ in padded}
    # every padded row stepped the scratch row, which no sequence holds
    assert all(pads == [runner.states.scratch] * (b - n) for n, b, pads in padded)
    for llm in (fast, eager):
        assert_slots_whole(llm)


def test_preemption_and_a_cancel_in_padded_buckets_leave_slots_whole(dirs, ref):
    # 11 usable blocks of 8 tokens: bytes for three state slots, too few blocks for the requests at once
    # (preemption); 16 tokens a step chunk the longer prompts
    llm = _forced(
        dirs["qwen3_5"],
        ["cuda_graphs"],
        block_size=8,
        num_kv_blocks=12,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    eng = llm.engine
    assert eng.runner.states.slots == 3 and eng.runner.buckets == [1, 2, 4]
    seen = _spy_padding(eng.runner)
    greedy = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    ids = [eng.add_request(None, p, greedy) for p in PROMPTS]
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        steps += 1
        if steps == 8:
            eng.abort(ids[2])
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert eng.scheduler.num_preemptions > 0
    assert done[ids[2]].finish_reason == "abort"
    assert [done[i].token_ids for i in ids if i != ids[2]] == [r for j, r in enumerate(ref) if j != 2]
    assert (3, 4, [eng.runner.states.scratch]) in seen  # three rows and a padded one
    assert_slots_whole(llm)


def test_a_padded_hybrid_step_runs_on_meta_without_host_reads(dirs):
    loaded = load_model(EngineConfig(model=str(dirs["qwen3_5"]), dtype="float32", device="cpu"))
    args = loaded.args
    with torch.device("meta"):
        model = type(loaded.model)(args)
    model.init_rope(64, torch.device("meta"), torch.float32)
    shape = (6, 8, args.num_kv_heads, args.head_dim)
    kv = [
        (torch.empty(shape, device="meta"), torch.empty(shape, device="meta")) for _ in args.attention_layers
    ]
    states = LinearStates(args, 3, torch.float32, torch.device("meta"), checkpoints=2)
    caches = states.layer_caches(args, kv)
    rows = [DecodeRow(5, 9, 17, 10, [1, 2], state_slot=2), DecodeRow(6, 3, 27, 4, [3], state_slot=0)]
    inp = DecodeInputs(4, 3, 8, torch.device("meta"), None, states.slots)
    for on in (False, True):
        model.fast_paths.attention = on
        inp.fill(rows, [0, 1], bucket=4, width=3)
        with torch.inference_mode():
            hidden = decode_step(model, caches, inp, 4)
            logits = model.compute_logits(hidden.index_select(0, inp.sample_rows[:2]))
        assert hidden.device.type == "meta" and hidden.shape == (4, args.hidden_size)
        assert logits.shape == (2, args.vocab_size)
    # the padded rows name the scratch row (right after the slots, before the checkpoints)
    host = DecodeInputs(4, 3, 8, torch.device("cpu"), None, states.slots)
    host.fill(rows, [0, 1], bucket=4, width=3)
    assert states.scratch == 3 and host.state_slots[:4].tolist() == [2, 0, 3, 3]


def test_the_self_check_puts_back_the_states_and_compares_them(dirs, monkeypatch):
    llm = LLM(model=str(dirs["qwen3_5"]), dtype="float32", block_size=8, max_num_seqs=4)
    runner = llm.engine.runner
    states, fp = runner.states, runner.fast_paths
    gen = torch.Generator().manual_seed(3)
    for t in states.conv + states.recurrent:  # every row: slots, the scratch row, checkpoints
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in states.conv + states.recurrent]
    bits = lambda t: t.view(torch.int32).clone()  # noqa: E731  (bitwise: unwritten blocks may hold NaN)
    kv_before = [[bits(t) for t in layer] for layer in runner.kv_caches]
    kernel_step = deltanet.kernel_step

    def wrong_slot(m, proj, b, a, state, slots, step=None):
        out = kernel_step(m, proj, b, a, state, slots, step)
        if fp.silu_mul and proj.shape[0] == 1:  # the probe's last step (its first sequence alone) also
            state[1][1].add_(0.5)  # writes the second sequence's slot, which no later logit reads
        return out

    monkeypatch.setattr(deltanet, "kernel_step", wrong_slot)
    fallbacks = self_check.run(runner, ["silu_mul", "cuda_graphs"])
    assert "linear-attention recurrent states after the probe differ" in fallbacks["silu_mul"]
    assert fp.active() == ["cuda_graphs"] and set(fallbacks) == {"silu_mul"}
    assert all(map(torch.equal, states.conv + states.recurrent, before))
    kv_after = [[bits(t) for t in layer] for layer in runner.kv_caches]
    assert all(map(torch.equal, sum(kv_after, []), sum(kv_before, [])))


def _torch_step(m, proj, b, a, state, slots):
    return deltanet.decode_reference(m, proj, b, a, state, slots)


def _c_step(m, proj, b, a, state, slots):
    assert deltanet.kernel_ready()
    return deltanet.kernel_step(m, proj, b, a, state, slots)


@pytest.mark.parametrize("step", [_torch_step, _c_step], ids=["torch", "c"])
def test_padded_rows_on_the_scratch_row_leave_the_real_rows(step):
    padded_rows_leave_the_real_rows(step)
