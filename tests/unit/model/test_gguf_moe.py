"""GGUF files of Mixtral and Qwen3-MoE, written with gguf.GGUFWriter the way llama.cpp's converter writes them
(Mixtral as the ``llama`` architecture with expert counts and q/k rows interleaved; Qwen3-MoE as ``qwen3moe``
with ``expert_feed_forward_length``; the router as ``ffn_gate_inp`` and each projection of all experts as one
3D ``ffn_*_exps`` tensor; dense layers under their plain names), load into our decoder and give greedy
output equal to HF transformers on the checkpoint they were written from; a Q4_0 file keeps its expert codes
as exact int4 per expert."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from sidecar import LLM, SamplingParams
from sidecar.model.linear import Linear
from sidecar.model.moe import SparseMoE
from sidecar.model.quant import Int4Linear
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import build_family_checkpoint
from tests.unit.model.test_gguf import _permute
from tests.unit.model.test_gguf_families import LAYER, _add_tokenizer

gguf = pytest.importorskip("gguf")  # a declared dependency; fails loudly below if absent
Q = gguf.GGMLQuantizationType
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 16])]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
KINDS = ("mixtral", "qwen3_moe_step")  # llama.cpp's qwen3moe always renormalises the top-k weights
EXPERT_PARTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
EXPERT_PARTS.update(gate_proj="ffn_gate_exps", up_proj="ffn_up_exps", down_proj="ffn_down_exps")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIDECAR_HOME", str(tmp_path / "home"))


def _add(w, name: str, a: np.ndarray, qtype) -> None:
    if qtype == Q.F32 or a.ndim == 1:
        w.add_tensor(name, a)
    else:
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def write_moe_gguf(hf_dir: Path, path: Path, kind: str, linear_type=Q.F32) -> None:
    """``hf_dir``'s checkpoint as llama.cpp's converter writes it (decoder and expert linears in
    ``linear_type``, the router in float32 as llama.cpp keeps it)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    mixtral = kind == "mixtral"
    w = gguf.GGUFWriter(str(path), "llama" if mixtral else "qwen3moe")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if not mixtral:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _add_tokenizer(w, hf_dir)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            mod, kind_ = rest.rsplit(".", 1)
            if ".experts." in mod:  # model.layers.N.<block>.experts.E.<proj>
                _, e, proj = mod.rsplit(".", 2)
                experts.setdefault((idx, EXPERT_PARTS[proj]), {})[int(e)] = a
                continue
            if mod.endswith(".gate"):  # the router
                w.add_tensor(f"blk.{idx}.ffn_gate_inp.weight", a)
                continue
            if mixtral and mod in ("self_attn.q_proj", "self_attn.k_proj"):
                a = _permute(a, cfg["num_attention_heads" if "q_proj" in mod else "num_key_value_heads"])
            _add(w, f"blk.{idx}.{LAYER[mod]}.{kind_}", a, linear_type)
        else:
            top = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
            }
            w.add_tensor(top.get(name, "output.weight"), a)
    for (idx, part), per_expert in experts.items():
        _add(
            w, f"blk.{idx}.{part}.weight", np.stack([per_expert[e] for e in sorted(per_expert)]), linear_type
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("gguf-moe")
    return {k: build_family_checkpoint(k, root / k, demo_dir) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_float_file_matches_hf_on_the_checkpoint_it_came_from(moe_dirs, tmp_path, kind):
    path = tmp_path / f"{kind}.gguf"
    write_moe_gguf(moe_dirs[kind], path, kind)
    llm = LLM(model=str(path), dtype="float32", block_size=8, max_num_batched_tokens=16)
    hf_cfg = json.loads((moe_dirs[kind] / "config.json").read_text())
    args = llm.engine.loaded.args
    assert args.architecture == hf_cfg["architectures"][0]
    assert (args.num_experts, args.experts_per_token) == (
        hf_cfg["num_local_experts"],
        hf_cfg["num_experts_per_tok"],
    )
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in llm.engine.loaded.model.layers]
    assert sparse == ([True] * 3 if kind == "mixtral" else [False, True, False])
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(moe_dirs[kind], PROMPTS, GREEDY.max_tokens)
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_q4_0_experts_take_the_exact_int4_form(moe_dirs, tmp_path, kind):
    path = tmp_path / f"{kind}-q4.gguf"
    write_moe_gguf(moe_dirs[kind], path, kind, Q.Q4_0)
    llm = LLM(model=str(path), dtype="float32", quantization="int4", num_kv_blocks=64)
    assert llm.engine.model_info["quantization"] == "int4"
    for layer in llm.engine.loaded.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            assert type(layer.mlp.gate) is Linear  # the router stays float
            assert all(isinstance(e.gate_up_proj, Int4Linear) for e in layer.mlp.experts)
    fp = LLM(model=str(path), dtype="float32", num_kv_blocks=64)  # the same codes dequantized
    assert fp.engine.model_info["quantization"] == "none"
    a = [o.token_ids[0] for o in llm.generate(PROMPTS, GREEDY)]
    b = [o.token_ids[0] for o in fp.generate(PROMPTS, GREEDY)]
    assert sum(x == y for x, y in zip(a, b)) >= len(PROMPTS) // 2
