"""LoRA adapters (PEFT) on Gemma 4 (gemma4_checkpoints.py), whose layers differ in head size, KV heads and
MLP width, and whose last layers compute no keys or values: greedy float32 equal to HF transformers + PEFT
with each adapter, adapters mixed in one batch equal to each alone; a LoRA weight on a projection a layer
does not have (a layer reading another's KV has no k_proj) is refused naming it."""

from __future__ import annotations

import pytest

from sidecar import LLM, SamplingParams
from sidecar.model.lora import AdapterError, read_adapter
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole
from tests.unit.model.gemma4_checkpoints import build_gemma4_checkpoint
from tests.unit.model.lora_helpers import ATTN, MLP, hf_peft_greedy, make_adapter

MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 14])]


@pytest.fixture(scope="module")
def base(tmp_path_factory, demo_dir):
    return build_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4-lora") / "dense", demo_dir)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-adapters")
    return {
        "all": make_adapter(base, root / "all", r=4, targets=ATTN + MLP, seed=1, std=0.3),
        "kv": make_adapter(base, root / "kv", r=2, targets=["k_proj", "v_proj"], seed=2, std=0.5),
    }


def test_adapters_match_hf_peft_and_mix_in_one_batch(base, adapters):
    llm = LLM(
        model=str(base),
        dtype="float32",
        block_size=8,
        max_lora_rank=4,
        lora_modules={n: str(p) for n, p in adapters.items()},
    )
    plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    solo = {None: plain}
    for name, path in adapters.items():
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora=name)]
        assert got == hf_peft_greedy(base, path, PROMPTS, MAX_NEW), name
        assert got != plain, f"adapter {name} left the output unchanged: the test would prove nothing"
        solo[name] = got
    names = [None, *adapters]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    for p, n, out in zip(prompts, loras, llm.generate(prompts, GREEDY, lora=loras)):
        assert out.token_ids == solo[n][PROMPTS.index(p)], n
    assert_pool_whole(llm)


def test_a_projection_the_layer_lacks_is_refused_naming_it(base, adapters, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from sidecar.model.args import ModelArgs

    d = shutil.copytree(adapters["kv"], tmp_path / "bad")
    tensors = load_file(str(d / "adapter_model.safetensors"))
    assert not any(".layers.3." in k for k in tensors)  # PEFT found no k / v projections there
    for ab, shape in (("A", (2, 64)), ("B", (32, 2))):
        tensors[f"base_model.model.model.layers.3.self_attn.k_proj.lora_{ab}.weight"] = torch.zeros(shape)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    import json

    args = ModelArgs.from_hf_config(json.loads((base / "config.json").read_text()))
    with pytest.raises(
        AdapterError,
        match="layers.3.self_attn.k_proj.lora_A.weight: layer 3 of Gemma4ForCausalLM has no k_proj",
    ):
        read_adapter(str(d), args, 4)
