"""LoRA on the Qwen3, Gemma 2, Gemma 3 and Phi-3 families: PEFT adapters give HF transformers + PEFT's greedy
float32 output (merged) token for token; Phi-3's adapters, trained on its fused ``qkv_proj`` and
``gate_up_proj``, map onto our per-part slots exactly; a batch mixing adapters and the base gives every row
its solo output, on the per-row kernel (float32 CPU) and on the masked GEMMs (bf16); adapters that cannot be
mapped onto the base are refused naming the module."""

from __future__ import annotations

import json
import shutil

import pytest

from lora_helpers import ATTN, MLP, hf_peft_greedy, make_adapter
from sidecar import LLM, SamplingParams
from sidecar.model.kernels.cpu import lora_bgmv
from sidecar.model.lora import AdapterError
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole
from tests.unit.model.family_checkpoints import build_family_checkpoint

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
# Longer than the 8-token windows; Phi-3's LongRoPE original length (16) crossed while generating and exceeded.
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([6, 12, 30])]
KINDS = ("qwen3", "gemma2", "gemma3", "phi3")
PHI3_ATTN, PHI3_MLP = ["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"]


def _specs(kind: str) -> dict[str, dict]:
    attn, mlp = (PHI3_ATTN, PHI3_MLP) if kind == "phi3" else (ATTN, MLP)
    return {
        "attn": dict(r=4, targets=attn[:1] + attn[-1:], seed=1),
        "all": dict(r=8, targets=attn + mlp, rslora=True, alpha=8.0, seed=2),
        "mlp": dict(r=6, targets=mlp[:1], seed=3, std=0.3),
    }


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("lora-families")
    # Gemma 2's tiny tied head mostly echoes the last token (its sqrt(hidden)-scaled embedding dominates the
    # stream): an untied head lets an adapter's change show in the output.
    return {
        k: build_family_checkpoint(
            k, root / k, demo_dir, **({"tie_word_embeddings": False} if k == "gemma2" else {})
        )
        for k in KINDS
    }


@pytest.fixture(scope="module")
def adapters(family_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-family-adapters")
    return {
        kind: {n: make_adapter(d, root / f"{kind}-{n}", **spec) for n, spec in _specs(kind).items()}
        for kind, d in family_dirs.items()
    }


def _mixed_equals_solo(llm: LLM, names: list) -> dict:
    solo = {n: [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora=n)] for n in names}
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    for i, (p, n, out) in enumerate(zip(prompts, loras, llm.generate(prompts, GREEDY, lora=loras))):
        assert out.token_ids == solo[n][PROMPTS.index(p)], (i, n)
    return solo


@pytest.mark.parametrize("kind", KINDS)
def test_adapters_match_hf_peft_and_mix_in_one_batch(family_dirs, adapters, kind):
    base = family_dirs[kind]
    llm = LLM(
        model=str(base),
        dtype="float32",
        block_size=8,
        max_lora_rank=8,
        lora_modules={n: str(p) for n, p in adapters[kind].items()},
    )
    assert llm.engine.lora.layers._bgmv == lora_bgmv.available()  # float32 CPU: the per-row kernel
    plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert plain == hf_peft_greedy(base, None, PROMPTS, MAX_NEW)
    for name, path in adapters[kind].items():
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora=name)]
        assert got == hf_peft_greedy(base, path, PROMPTS, MAX_NEW), name
        assert got != plain, f"adapter {name} left the output unchanged: the test would prove nothing"
    solo = _mixed_equals_solo(llm, [*adapters[kind], None])
    assert len({tuple(map(tuple, v)) for v in solo.values()}) == len(solo)
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind", ["gemma2", "phi3"])
def test_masked_gemm_path_mixes_adapters_in_bf16(family_dirs, adapters, kind):
    llm = LLM(
        model=str(family_dirs[kind]),
        dtype="bfloat16",
        max_loras=2,
        max_lora_rank=8,
        lora_modules={n: str(p) for n, p in adapters[kind].items()},
    )
    assert not llm.engine.lora.layers._bgmv
    solo = _mixed_equals_solo(llm, ["all", "mlp", None])
    assert solo["all"] != solo[None]
    assert_pool_whole(llm)


def test_phi3_fused_adapter_splits_b_and_shares_a(family_dirs, adapters):
    from sidecar.model.lora import read_adapter

    llm_args = LLM(model=str(family_dirs["phi3"]), dtype="float32").engine.loaded.args
    ad = read_adapter(str(adapters["phi3"]["all"]), llm_args, 8)
    q, kv = llm_args.num_heads * llm_args.head_dim, llm_args.num_kv_heads * llm_args.head_dim
    a_q, b_q = ad.weights[(0, "q_proj")]
    a_k, b_k = ad.weights[(0, "k_proj")]
    a_v, b_v = ad.weights[(0, "v_proj")]
    assert a_q is a_k is a_v
    assert (b_q.shape[0], b_k.shape[0], b_v.shape[0]) == (q, kv, kv)
    assert ad.weights[(1, "gate_proj")][1].shape[0] == ad.weights[(1, "up_proj")][1].shape[0]
    assert not any(name in ("qkv_proj", "gate_up_proj") for _, name in ad.weights)


def _retarget(src, dst, edit) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    edit(cfg)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_adapters_that_cannot_be_mapped_are_refused(family_dirs, adapters, tmp_path):
    phi3 = LLM(model=str(family_dirs["phi3"]), dtype="float32", enable_lora=True, max_lora_rank=8)
    qwen3 = LLM(model=str(family_dirs["qwen3"]), dtype="float32", enable_lora=True, max_lora_rank=8)
    # Per-part targets on a fused base, and fused targets on a base that stores its parts apart.
    with pytest.raises(AdapterError, match=r"target_modules: .*q_proj.* not supported on Phi3ForCausalLM"):
        phi3.load_lora("q", str(adapters["qwen3"]["attn"]))
    with pytest.raises(AdapterError, match=r"target_modules: qkv_proj.* not supported on Qwen3ForCausalLM"):
        qwen3.load_lora("qkv", str(adapters["phi3"]["attn"]))
    # Without target_modules to go by, the tensor names say it.
    bare = _retarget(adapters["phi3"]["mlp"], tmp_path / "bare", lambda c: c.pop("target_modules"))
    with pytest.raises(
        AdapterError, match=r"gate_up_proj.lora_A.weight: not a LoRA weight of a module Qwen3"
    ):
        qwen3.load_lora("bare", bare)
    # An adapter of another Phi-3 shape: the fused B's rows are not the base's q + k + v.
    other = build_family_checkpoint("phi3", tmp_path / "phi3-mha", family_dirs["phi3"], num_key_value_heads=4)
    wrong = make_adapter(other, tmp_path / "wrong", r=4, targets=["qkv_proj"])
    with pytest.raises(AdapterError, match=r"qkv_proj.lora_B.weight: shape \(192, 4\) does not fit"):
        phi3.load_lora("wrong", str(wrong))
    assert not phi3.engine.lora.registry and not qwen3.engine.lora.registry
