"""GGUF files made by llama.cpp's own converter (llamacpp_converter.py) from tiny checkpoints of the newest
families load into our engine and give greedy float32 output equal to HF transformers on the directory they
came from, token for token; Q8_0 files equal HF on the weights they hold (the pattern of
test_gguf_llamacpp.py).

gpt-oss (``gpt-oss``): experts stored apart and transposed (gguf_gpt_oss.py), F32 experts from a float
checkpoint; from an MXFP4 checkpoint (the published form) the converter writes MXFP4 experts, whose codes come
back as the checkpoint's, equal to ggml's own dequantizer (the ``gguf`` package's) and kept as codes.

Qwen3.5 (``qwen35``): the converter rewrites the checkpoint (gguf_qwen35.py): norms as ``1 + w``,
``A_log`` as ``-exp(A_log)``, and, with fewer key than value heads (the checkpoint here), every value-head
axis of the DeltaNet layers in another order. A checkpoint without multi-token-prediction layers converts with
``--no-mtp``. Qwen3.5-MoE (``qwen35moe``): the same layers with the experts as one 3D tensor per projection,
the router and the gated shared expert; its directory is converted with ``model_type`` ``qwen3_5_text``, as
transformers otherwise reads the test tokenizer as Qwen3.5's own class, whose pre-tokenizer the converter does
not know (a published checkpoint ships Qwen's tokenizer, which it does). Qwen3-Next (``qwen3next``,
gguf_qwen3next.py): Qwen3.5-MoE's rewrites but for the value heads, with the grouped ``in_proj_qkvz`` split in
two; its checkpoint here has every layer sparse and renormalised top-k weights (the converter maps no dense
MLP, and the file cannot say otherwise: llama.cpp's runtime renormalises).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llamacpp_converter import convert
from sidecar import LLM
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint
from tests.unit.model.test_gpt_oss import to_mxfp4
from tests.unit.model.test_gguf_llamacpp import GREEDY, PROMPTS, _q8_0_values, tokenizer_dirs  # noqa: F401

FLAGS = {"qwen3_5": ("--no-mtp",), "gpt_oss": (), "qwen3_5_moe": ("--no-mtp",), "qwen3_next": ("--no-mtp",)}
# ours -> llama.cpp's arch
ARCH = {"qwen3_5": "qwen35", "gpt_oss": "gpt-oss", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
# What a gpt-oss file can say: llama.cpp's clamp limit, and YaRN in the file's ``rope.scaling.*`` keys (as in
# the published files) with the correction range rounded outward as llama.cpp's runtime rounds it (HF's
# ``truncate``; the file has no key for it), from an original length the prompts cross
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0}
OVERRIDES = {
    "gpt_oss": dict(
        swiglu_limit=7.0, rope_parameters=dict(YARN, truncate=True, original_max_position_embeddings=32)
    ),
    # the converter maps no dense MLP (every layer sparse) and the file cannot say norm_topk_prob
    # (llama.cpp's runtime renormalises)
    "qwen3_next": dict(mlp_only_layers=[], norm_topk_prob=True),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_dirs) -> dict[str, tuple[Path, Path]]:  # noqa: F811
    """kind -> (HF directory, the f32 GGUF llama.cpp's converter made of it)."""
    root = tmp_path_factory.mktemp("llamacpp-gguf-new")
    out = {}
    for kind in FLAGS:
        d = build_family_checkpoint(kind, root / kind, tokenizer_dirs["bpe"], **OVERRIDES.get(kind, {}))
        src = d
        if kind == "qwen3_5_moe":  # the tokenizer as its files say (module docstring)
            src = root / f"{kind}-src"
            shutil.copytree(d, src)
            cfg = json.loads((src / "config.json").read_text())
            (src / "config.json").write_text(json.dumps(dict(cfg, model_type="qwen3_5_text")))
        out[kind] = (d, convert(src, root / f"{kind}.gguf", "f32", *FLAGS[kind]))
    return out


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIDECAR_HOME", str(tmp_path / "home"))


def _engine_matches(hf_dir: Path, path: Path, ref: list[list[int]]) -> LLM:
    llm = LLM(model=str(path), dtype="float32", block_size=8, max_num_batched_tokens=16)
    want = json.loads((hf_dir / "config.json").read_text())["architectures"][0]
    assert llm.engine.loaded.args.architecture == want
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert_pool_whole(llm)
    return llm


@pytest.mark.parametrize("kind", FLAGS)
def test_converter_file_matches_hf_on_the_checkpoint_it_came_from(converted, kind):
    import gguf

    hf_dir, path = converted[kind]
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == ARCH[kind]
    ref = hf_greedy(hf_dir, PROMPTS, GREEDY.max_tokens)
    assert_not_degenerate(ref)
    _engine_matches(hf_dir, path, ref)


def test_gpt_oss_mxfp4_experts_come_back_as_the_checkpoints_codes(converted, tmp_path):
    import gguf

    from sidecar.model import gguf_tensors as gt
    from sidecar.model import mxfp4
    from sidecar.model.gguf import model_dir_for

    mx = to_mxfp4(converted["gpt_oss"][0], tmp_path / "mxfp4")
    path = convert(mx, tmp_path / "mxfp4.gguf", "f32")
    experts = [t for t in gguf.GGUFReader(str(path)).tensors if "_exps.weight" in t.name]
    assert experts and {t.tensor_type.name for t in experts} == {"MXFP4"}
    for t in experts:  # our reading of ggml's blocks against ggml's dequantizer
        blocks, scales = gt.mxfp4_codes(t)
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        assert torch.equal(mxfp4.dequantize(blocks, scales, torch.float32), want)
    ours = load_file(str(model_dir_for(path, None, "float32") / "model.safetensors"))
    theirs = load_file(str(mx / "model.safetensors"))
    coded = [n for n in theirs if n.endswith(("_blocks", "_scales"))]
    assert len(coded) == 4 * json.loads((mx / "config.json").read_text())["num_hidden_layers"]
    for name in coded:
        assert torch.equal(ours[name], theirs[name]), name
    ref = hf_greedy(mx, PROMPTS, GREEDY.max_tokens)
    assert_not_degenerate(ref)
    llm = _engine_matches(mx, path, ref)
    kept = [m for m in llm.engine.runner.model.modules() if isinstance(m, mxfp4.Mxfp4Linear)]
    assert (
        len(kept)
        == 2 * (len(experts) // 3) * json.loads((mx / "config.json").read_text())["num_local_experts"]
    )


def _fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each block's per-expert projections as transformers' fused 3D tensors (the form the
    loader reads; moe.expert_weights)."""
    out = {n: w for n, w in state.items() if ".mlp.experts." not in n}
    blocks = sorted({n.split(".experts.")[0] for n in state if ".mlp.experts.0." in n})
    for block in blocks:
        count = sum(1 for n in state if n.startswith(f"{block}.experts.") and n.endswith(".down_proj.weight"))
        stack = {
            p: torch.stack([state[f"{block}.experts.{e}.{p}.weight"] for e in range(count)])
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        out[f"{block}.experts.gate_up_proj"] = torch.cat((stack["gate_proj"], stack["up_proj"]), dim=1)
        out[f"{block}.experts.down_proj"] = stack["down_proj"]
    return out


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_rewritten_tensors_come_back_as_the_checkpoint_holds_them(converted, kind):
    """Every tensor the converter rewrote is back in HF's order (Qwen3.5's value heads; Qwen3-Next's
    ``in_proj_qkvz`` split in two); what it recomputed is what it stores."""
    import gguf

    from sidecar.model.gguf import hf_config
    from sidecar.model.gguf_convert import gguf_state_dict

    hf_dir, path = converted[kind]
    reader = gguf.GGUFReader(str(path))
    cfg = hf_config(reader, str(path))
    assert cfg["linear_num_key_heads"] < cfg["linear_num_value_heads"]  # the reordered case
    ours, theirs = gguf_state_dict(reader, cfg), _fused_experts(load_file(str(hf_dir / "model.safetensors")))
    assert any(n.endswith("in_proj_qkvz.weight") for n in theirs) == (kind == "qwen3_next")
    for name, w in theirs.items():
        if name.endswith(".A_log"):
            assert torch.equal(ours[name.removesuffix("_log")], -w.exp()), name
        elif "norm" in name and ".linear_attn." not in name:
            assert torch.equal(ours[name], w + 1), name
        else:
            assert torch.equal(ours[name], w), name
    assert len(ours) == len(theirs)


def test_qwen3_5_q8_0_file_matches_hf_on_the_weights_it_holds(tokenizer_dirs, tmp_path):  # noqa: F811
    """As many key as value heads: the converter stores HF's order, so the file's Q8_0 values map onto
    the checkpoint's tensors by gguf's own name map."""
    import gguf

    hf_dir = build_family_checkpoint(
        "qwen3_5", tmp_path / "hf", tokenizer_dirs["bpe"], linear_num_value_heads=2, linear_value_head_dim=16
    )
    path = convert(hf_dir, tmp_path / "q8_0.gguf", "q8_0", "--no-mtp")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, 4)
    state = load_file(str(hf_dir / "model.safetensors"))
    held = {}
    for name, w in state.items():
        if w.dim() != 2:  # norms, A_log, dt_bias and the conv taps stay float32
            continue
        t = tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))]
        if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            held[name] = _q8_0_values(t)
            err = (held[name] - w).abs().max().item()
            assert 0 < err <= w.abs().max().item() / 200, name
    assert any(".linear_attn." in n for n in held) and any(".self_attn." in n for n in held)
    ref_dir = tmp_path / "q8_0-values"
    shutil.copytree(hf_dir, ref_dir)
    save_file({**state, **held}, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref = hf_greedy(ref_dir, PROMPTS, GREEDY.max_tokens)
    assert_not_degenerate(ref)
    assert ref != hf_greedy(hf_dir, PROMPTS, GREEDY.max_tokens)  # the engine must follow the file
    _engine_matches(hf_dir, path, ref)
