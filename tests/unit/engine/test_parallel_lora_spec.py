"""LoRA and n-gram speculation on a split model: two tensor-parallel ranks (each holding its slice of every
adapter) and two pipeline stages (each holding its layers' adapter weights) give HF transformers + PEFT's
float32 greedy tokens, in a batch mixing adapters and the base model, with an adapter loaded at runtime into a
slot another one left, and with rank 0's n-gram proposals verified through the split model's logits."""

from __future__ import annotations

import random

import pytest

from sidecar import LLM, SamplingParams
from sidecar.engine.lora_manager import AdapterNotFoundError
from tests.unit.engine.test_engine_vs_hf import hf_greedy
from tests.unit.engine.test_tensor_parallel import _checkpoint
from tests.unit.model.lora_helpers import ATTN, MLP, hf_peft_greedy, make_adapter

MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
SPEC_NEW = 40
# Every target (row-parallel o / down included) at one rank; a subset at another rank.
SPECS = {
    "all": dict(r=8, targets=ATTN + MLP, seed=1),
    "qvd": dict(r=4, targets=["q_proj", "v_proj", "down_proj"], seed=2),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory, demo_dir):
    """Llama with one KV head for two ranks (k/v's B replicated like the head), biases on every projection
    (row-parallel ones added once), 2 layers (one per stage); two adapters; HF + PEFT's tokens for each, and
    for two looping prompts (n-gram lookup finds their continuation in them)."""
    root = tmp_path_factory.mktemp("split-lora")
    path, hf = _checkpoint("llama", root / "llama", demo_dir)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (9, 30, 5, 21)]
    adapters = {name: make_adapter(path, root / name, **spec) for name, spec in SPECS.items()}
    refs = {name: hf_peft_greedy(path, adapters.get(name), prompts, MAX_NEW) for name in (None, *SPECS)}
    # A repeated phrase: n-gram lookup proposes its continuation at once
    loops = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] * 3 for n in (4, 6)]
    spec = [
        hf_peft_greedy(path, adapters.get(name), [p], SPEC_NEW)[0] for p, name in zip(loops, (None, "all"))
    ]
    return path, prompts, adapters, refs, loops, spec


def _pool_whole(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.requests and eng.kv.num_free_blocks() == eng.kv.num_blocks
    assert not any(eng.lora.pins) and not eng.lora.parked


def _check_split_engine(base, **split) -> None:
    path, prompts, adapters, refs, loops, spec = base
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=16,  # prompts arrive in chunks
        max_loras=1,  # two adapters in one batch: the second waits for the first's slot
        max_lora_rank=8,
        lora_modules={"all": str(adapters["all"])},
        speculative="ngram",
        speculative_token_cost=0.0,  # speculate whenever there is a proposal
        **split,
    )
    try:
        # A batch of adapter and base rows, each with its own tokens
        names = [None, "all", None, "all"]
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, lora=names)]
        assert got == [refs[n][i] for i, n in enumerate(names)]
        _pool_whole(llm)
        # Loaded at runtime: it takes the one slot once "all"'s requests finish, then "all" takes it back
        llm.load_lora("qvd", str(adapters["qvd"]))
        names = ["qvd", "all", None, "qvd"]
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, lora=names)]
        assert got == [refs[n][i] for i, n in enumerate(names)]
        assert llm.stats()["lora_evictions"] >= 2
        _pool_whole(llm)
        llm.unload_lora("qvd")
        with pytest.raises(AdapterNotFoundError, match="qvd"):
            llm.generate(prompts[:1], GREEDY, lora="qvd")
        assert [o.token_ids for o in llm.generate(prompts[:2], GREEDY, lora="all")] == refs["all"][:2]
        _pool_whole(llm)
        # Speculation: several logit rows per sequence come back from the split model, base and adapter rows.
        # This checkpoint rarely repeats itself, so most proposals are rejected: the check is that verification
        # rows (and the KV they write, rolled back) give plain greedy decode's tokens.
        before = llm.stats()["spec_decode_proposed_tokens"]
        long = SamplingParams(max_tokens=SPEC_NEW, ignore_eos=True)
        assert [o.token_ids for o in llm.generate(loops, long, lora=[None, "all"])] == spec
        assert llm.stats()["spec_decode_proposed_tokens"] > before
        _pool_whole(llm)
        # The start-up pricing of verification rows runs through the split model too, past the decode buffers
        # (last: it writes the KV of blocks 1.., cached prefixes included)
        rows = llm.engine.runner.inputs.max_batch + 1
        assert all(t > 0 for t in llm.engine.runner.time_decode_rows([2, rows], repeats=1))
    finally:
        llm.engine.tp.close()


def test_two_tensor_parallel_ranks_serve_adapters_like_hf_peft(base):
    _check_split_engine(base, tensor_parallel_size=2)


def test_two_pipeline_stages_serve_adapters_like_hf_peft(base):
    _check_split_engine(base, pipeline_parallel_size=2)


def test_two_tensor_parallel_ranks_accept_ngram_proposals_like_hf(demo_dir):
    """The demo model falls into loops, so many proposals are accepted: the KV the verification rows wrote
    on every rank is then the sequence's own, and the tokens stay HF's."""
    rng = random.Random(11)
    seeds = [[rng.randrange(3, 900) for _ in range(n)] for n in (5, 30)]
    prompts = [s + c for s, c in zip(seeds, hf_greedy(demo_dir, seeds, 16))]  # copyable: its own output
    ref = hf_greedy(demo_dir, prompts, SPEC_NEW)
    llm = LLM(
        model=str(demo_dir),
        dtype="float32",
        tensor_parallel_size=2,
        speculative="ngram",
        speculative_token_cost=0.0,
        block_size=8,
    )
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=SPEC_NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == ref
        assert llm.stats()["spec_decode_accepted_tokens"] > 10
        _pool_whole(llm)
    finally:
        llm.engine.tp.close()
