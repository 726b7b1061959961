"""Device fast paths on every rank of a tensor-parallel group (engine/tp_device.py), on CPU over gloo: the ranks
check and decide together, a rank that fails turns every rank off with its reason, a rank's padded decode step
makes no host reads and the same collectives as its peer's, and the group's tokens stay the eager group's.

On a CPU nothing is captured: ``DecodeGraphs`` runs each padded bucket's step eagerly over the persistent
buffers, on every rank with rank 0's rows (what a replay would read), and Triton's paths are inert here (no
interpreter: their switches run the torch code), so the check exercises the group's protocol end to end."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from sidecar import LLM, SamplingParams
from sidecar.engine import self_check, tp_device
from sidecar.engine.input_buffers import DecodeInputs, DecodeRow, decode_buckets, decode_step
from sidecar.engine.tp import TensorParallel, make_group
from sidecar.model.args import ModelArgs
from sidecar.model.llama import LlamaForCausalLM
from sidecar.model.tp_shard import Comm, Shard
from tests.unit.engine import device_peers
from tests.unit.engine.test_tensor_parallel import _pool_whole, _prompts

GREEDY = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 5, 4, 3, 2)]  # ending a step apart
MAX_SEQS = 6  # padded buckets 1, 2, 4, 6


@pytest.fixture(autouse=True)
def _gloo_without_interpreter(monkeypatch):
    """Every all-reduce over gloo (no shared-memory segment), and Triton's switches inert on CPU tensors."""
    monkeypatch.setenv("SIDECAR_TP_SHM", "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _llm(demo_dir, split: str = "tensor_parallel_size") -> LLM:
    return LLM(
        model=str(demo_dir),
        dtype="float32",
        **{split: 2},
        block_size=8,
        num_kv_blocks=40,
        max_num_seqs=MAX_SEQS,
    )


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY[: len(prompts)])]


def test_every_rank_checks_and_the_group_matches_the_eager_group(demo_dir, monkeypatch):
    llm = _llm(demo_dir)
    tp, runner = llm.engine.tp, llm.engine.runner
    try:
        assert tp.comm.shm is None  # gloo
        assert runner.fast_paths.active() == []  # a CPU group's default: our C kernels, no device path
        prompts = _prompts(llm.engine.vocab_size)[:5]
        want = _tokens(llm, prompts)
        fallbacks = tp_device.check(tp, runner)
        assert tp.device_checks == {0: {}, 1: {}}  # every rank's own self-check passed every path
        active = runner.fast_paths.active()
        assert set(self_check.default_paths(runner)) <= set(active) and "cuda_graphs" in active, fallbacks
        assert runner.buckets == decode_buckets(MAX_SEQS, True) == [1, 2, 4, 6]
        assert isinstance(runner.graphs, tp_device.RankZeroGraphs)
        sent, send = [], tp.send
        monkeypatch.setattr(tp, "send", lambda msg: (sent.append(msg), send(msg))[1])
        assert _tokens(llm, prompts) == want
        # decode batches of 5, 4, 3, 2, 1 rows (the requests end one step apart) ran in buckets 6, 4, 4, 2, 1 on
        # both ranks: each bucket sent to the worker with rank 0's rows, and no decode step left as a forward
        assert [m[1][0] for m in sent if m[0] == "gstep"] == [6, 4, 4, 2, 1]
        assert all(m[1][4] for m in sent if m[0] == "fwd")  # every forward sent carries prompt rows
        _pool_whole(llm)
        runner.graphs.clear()  # every rank's paths off again: eager forwards drive the worker
        assert runner.fast_paths.active() == [] and not isinstance(runner.graphs, tp_device.RankZeroGraphs)
        assert runner.buckets == list(range(1, MAX_SEQS + 1))
        assert _tokens(llm, prompts[:2]) == want[:2]
        _pool_whole(llm)
    finally:
        tp.close()


def test_a_failing_rank_turns_every_rank_off_with_its_reason(demo_dir, monkeypatch):
    monkeypatch.setattr(TensorParallel, "worker_main", property(lambda self: device_peers.failing_worker))
    llm = _llm(demo_dir)
    tp, runner = llm.engine.tp, llm.engine.runner
    try:
        prompts = _prompts(llm.engine.vocab_size)[:3]
        want = _tokens(llm, prompts)
        fallbacks = tp_device.check(tp, runner)
        paths = self_check.default_paths(runner)
        triton = [p for p in paths if p in self_check.TRITON_PATHS]
        assert tp.device_checks[0] == {}  # rank 0 could take every path
        assert tp.device_checks[1] == {
            **{p: "triton is not installed" for p in triton},
            "cuda_graphs": "refused on this rank",
        }
        for p in triton:  # no rank probed them: the group's reason names the rank
            assert fallbacks[p] == "rank 1: triton is not installed"
        assert fallbacks["cuda_graphs"] == "rank 1: refused on this rank"
        assert runner.fast_path_info()["fast_path_fallbacks"]["cuda_graphs"] == "rank 1: refused on this rank"
        # the worker reported holding rank 0's paths (check fails the group otherwise): none of the model's
        assert set(runner.fast_paths.active()) <= {"device_sampler"}
        assert runner.buckets == list(range(1, MAX_SEQS + 1)) and not runner.graphs.captured
        assert _tokens(llm, prompts) == want
        _pool_whole(llm)
    finally:
        tp.close()


class _MetaGroup:
    """A NCCL-like group for meta tensors: a collective is a device operation with no host side; each is noted."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def allreduce(self, tensors):
        self.calls.append(("all_reduce", tuple(tensors[0].shape), tensors[0].dtype))
        return self

    def allgather(self, outs, ins):
        self.calls.append(("all_gather", tuple(ins[0].shape), ins[0].dtype))
        return self

    def wait(self) -> None:
        pass


def test_a_rank_padded_decode_step_makes_no_host_reads_and_pairs_its_collectives(demo_dir):
    """Each rank's padded-bucket decode step (the one its graph captures) on the meta device: any host read
    there raises, so finishing proves the step is capturable; both ranks make the same collectives in the same
    order, whatever rows the bucket holds, so their steps pair call for call."""
    args = ModelArgs.from_hf_config(json.loads((demo_dir / "config.json").read_text()))
    calls = {}
    for rank in (0, 1):
        group = _MetaGroup()
        shard = Shard(rank, 2, Comm(group, rank, 2))
        local = shard.local_args(args)
        with torch.device("meta"):
            model = LlamaForCausalLM(local)
        shard.wrap(model, args)
        model.init_rope(64, torch.device("meta"), torch.float32)
        shape = (6, 8, local.num_kv_heads, local.head_dim)
        kv = [
            (torch.empty(shape, device="meta"), torch.empty(shape, device="meta"))
            for _ in range(args.num_layers)
        ]
        inp = DecodeInputs(max_batch=4, max_blocks=3, block_size=8, device=torch.device("meta"))
        for on in (False, True):  # the int32 tables too
            model.fast_paths.attention = on
            rows = [DecodeRow(5, 9, 17, 10, [1, 2]), DecodeRow(6, 3, 27, 4, [3])][: 1 + rank]
            inp.fill(
                rows, [0], bucket=4, width=3
            )  # one real row on rank 0's call, two on rank 1's: same bucket
            with torch.inference_mode():
                hidden = decode_step(model, kv, inp, 4)
                logits = model.logits_at(hidden, inp.sample_rows[:1])
            assert hidden.shape == (4, args.hidden_size) and logits.shape == (1, args.vocab_size)
        calls[rank] = group.calls
    per_step = (
        1 + 2 * args.num_layers + 1
    )  # the embedding, o_proj and down_proj of each layer; the head's gather
    assert len(calls[0]) == 2 * per_step and calls[0] == calls[1]


def test_capture_is_refused_by_name_where_the_all_reduce_is_no_nccl_kernel():
    group = make_group("gloo", dist.HashStore(), 0, 1, 5.0)
    comm = Comm(group, 0, 1)
    cuda = torch.device("cuda")  # only its type is read: no device needed
    assert "ProcessGroupGloo" in tp_device.capture_refusal(comm, cuda)
    comm.shm = object()
    assert "shared memory" in tp_device.capture_refusal(comm, cuda)
    assert tp_device.capture_refusal(comm, torch.device("cpu")) is None  # nothing is captured there
    comm.shm = None
    assert tp_device.failing_ranks(comm, True, torch.device("cpu")) == [0]
    assert tp_device.failing_ranks(comm, False, torch.device("cpu")) == []
    assert tp_device.compose({2: "b", 0: "a", 1: "a"}) == "ranks 0, 1: a; rank 2: b"
