"""Qwen3, Gemma 2, Gemma 3 and Phi-3 checkpoints (family_checkpoints.py) through the engine: greedy float32
equal to HF transformers ``generate`` token for token with a tight pool (preemption), a small token budget
(chunked prefill) and prefix-cache hits; an int8 KV cache held to the bar of the Llama-family int8 tests;
int8 / int4 weights against our own float path; bf16 on the CPU kernels; the Triton paths (interpreter on
CPU) against the paths off."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model.loader import load_model
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import FAMILIES, assert_not_degenerate, build_family_checkpoint

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
# Windows are 8 tokens and Phi-3's LongRoPE original length 16: prompts below it (whose generation crosses
# it), at it, and past it.
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 40, 14, 22, 16])]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("families")
    return {k: build_family_checkpoint(k, root / k, demo_dir) for k in FAMILIES}


@pytest.fixture(scope="module")
def hf_refs(family_dirs):
    cache: dict[str, list[list[int]]] = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            cache[kind] = hf_greedy(family_dirs[kind], PROMPTS, MAX_NEW)
            assert_not_degenerate(cache[kind])  # else equality would not exercise the layers
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_matches_hf_with_preemption_chunking_and_prefix_hits(family_dirs, hf_refs, kind):
    ref = hf_refs(kind)
    # 13 usable blocks of 8 tokens cannot hold the 7 requests (up to 52 tokens each) at once. Gemma 3's KV
    # groups (engine/kv_groups.py) page one layer a block: 30 such pages are 10 of its three-layer blocks.
    llm = LLM(
        model=str(family_dirs[kind]),
        dtype="float32",
        block_size=8,
        num_kv_blocks=30 if kind == "gemma3" else 14,
        max_num_batched_tokens=16,
    )
    assert llm.engine.loaded.args.architecture == llm.engine.loaded.hf_config["architectures"][0]
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_whole(llm)
    first, again = (llm.generate(PROMPTS[3:4], GREEDY)[0] for _ in range(2))  # again: from the prefix cache
    assert first.token_ids == again.token_ids == ref[3]
    assert again.num_cached_tokens >= 32
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_int8_kv_cache_holds_the_bar_of_the_llama_family(family_dirs, kind):
    from tests.unit.server.test_kv_cache_dtype import (
        assert_int8_changes_top1_no_more_than_float32,
        pool_whole,
        prompts,
        teacher_forced_cases,
    )

    model = str(family_dirs[kind])
    plain = LLM(model=model, dtype="bfloat16")
    cases = teacher_forced_cases(plain, prompts(24, seed=1), SamplingParams(max_tokens=8, ignore_eos=True))
    quant = LLM(model=model, dtype="bfloat16", kv_cache_dtype="int8")
    assert_int8_changes_top1_no_more_than_float32(plain, quant, LLM(model=model, dtype="float32"), cases)
    assert pool_whole(quant)


def _first_tokens(llm: LLM, ps: list[list[int]]) -> list[int]:
    return [o.token_ids[0] for o in llm.generate(ps, SamplingParams(max_tokens=1, ignore_eos=True))]


@pytest.mark.parametrize("kind", ["qwen3_tied", "gemma2", "gemma3", "phi3"])
def test_quantized_weights_load_and_agree_with_the_float_path(family_dirs, kind):
    from tests.unit.server.test_kv_cache_dtype import prompts

    model = str(family_dirs[kind])
    ps = prompts(32, seed=3)
    ref = _first_tokens(LLM(model=model, dtype="float32", num_kv_blocks=64), ps)
    for mode, bar in (("int8", 0.8), ("int4", 0.2)):  # the bars of test_quant_model on random weights
        llm = LLM(model=model, dtype="float32", num_kv_blocks=64, quantization=mode, quant_group_size=32)
        got = _first_tokens(llm, ps)
        assert sum(a == b for a, b in zip(ref, got)) / len(ps) >= bar, mode
        assert llm.engine.model_info["quantization"] == mode


REPLAYED = {"qwen3", "gemma2", "gemma3", "phi3"}


@pytest.mark.parametrize("kind", FAMILIES)
def test_bf16_runs_on_the_cpu_kernels(family_dirs, kind):
    model = str(family_dirs[kind])
    llm = LLM(model=model, dtype="bfloat16")
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == MAX_NEW for o in outs)
    f32 = LLM(model=model, dtype="float32").generate(PROMPTS, GREEDY)
    assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(outs, f32)) >= len(PROMPTS) // 2
    info = llm.engine.model_info
    # Qwen3's q/k norms (in place), Gemma's GeGLU and attention soft-cap, Phi-3's partial rotary run as kernels:
    # those steps replay from C. The others run a torch operator in their decode step: the C replay refuses it
    # and says which, rather than replaying a step it did not record.
    assert info["cpu_decode_replay"] is (kind in REPLAYED), info.get("cpu_decode_replay_reason")
    assert kind in REPLAYED or info["cpu_decode_replay_reason"]
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind", FAMILIES)
def test_triton_paths_match_the_paths_off(family_dirs, kind, monkeypatch):
    from sidecar.model.kernels.triton import gemv as triton_gemv
    from tests.unit.model.kernels.triton.test_triton_model import _run, _set, _spy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(
        EngineConfig(model=str(family_dirs[kind]), dtype="float32", device=device.type), pack=False
    ).model
    ref = _run(model, device)
    calls: list[str] = []
    _spy(monkeypatch, triton_gemv, "norm_matmul", calls)
    _set(model.fast_paths, True)
    fast = _run(model, device)
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))
    # The fused one-row block covers the plain pre-norm silu layer only.
    assert bool(calls) == (not kind.startswith("gemma"))


def test_an_unknown_architecture_is_named_with_the_supported_ones():
    from sidecar.model.args import ModelArgs

    with pytest.raises(ValueError) as exc:
        ModelArgs.from_hf_config({"architectures": ["FalconForCausalLM"], "hidden_size": 8})
    msg = str(exc.value)
    assert "FalconForCausalLM" in msg
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert arch in msg
