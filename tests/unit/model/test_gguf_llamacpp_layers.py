"""GGUF files made by llama.cpp's own converter (llamacpp_converter.py) from tiny checkpoints of the families
whose layers differ from one another load into our engine and give greedy float32 output equal to HF
transformers on the directory they came from, token for token; Q8_0 files equal HF on the weights they hold;
the tokenizer is the one the file's metadata describes (the pattern of test_gguf_llamacpp_hybrid.py).

Llama 4 (``llama4``, gguf_llama4.py): the file carries no chunk size, NoPE pattern or attention temperature,
so the checkpoint here has what llama.cpp's runtime assumes for them (chunks of 8192, every fourth layer
NoPE, floor scale 8192 and scale 0.1, q/k norms); its dense and sparse layers, shared expert and interleaved
rope come from the file.

DeepSeek V3 (``deepseek2``, gguf_deepseek.py): the converter splits ``kv_b_proj`` into ``attn_k_b`` (the key
part transposed) and ``attn_v_b``, joined back exactly. Its checkpoint here carries what a published
DeepSeek V3 config.json says and transformers' config class leaves out: ``scoring_func: sigmoid`` (else
the file says nothing and llama.cpp scores by a softmax) and ``num_key_value_heads`` equal to the heads
(the converter splits ``kv_b_proj`` by it).

Gemma 4 (``gemma4``, gguf_gemma4.py): per-layer head sizes and KV heads, values from the key projection,
KV-sharing layers with double-wide MLPs, per-layer inputs and the proportional rope (as frequency factors)
come from the file; its mixture-of-experts form (``gemma4_moe``) adds the router with its scales and the
fused experts, as HF holds them. The converter reads a Llama-style ``tokenizer.json`` (BPE with byte
fallback): the SentencePiece tokenizer here, saved as one. The file says not to add a space prefix (Gemma 4's
own tokenizer does not); this one adds it, so text is compared with the space written out.

Mistral 4 (``mistral4``, gguf_mistral4.py): the converter reads only the published form
(``Mistral3ForConditionalGeneration`` around a ``mistral4`` text config without architectures of its own;
``Mistral4ForCausalLM`` it refuses), so the ``Mistral4ForCausalLM`` checkpoint is wrapped into that form for
it and HF runs the checkpoint itself. The file carries no query position scaling (the converter drops
``llama_4_scaling_beta``) and llama.cpp turns interleaved rope pairs, so the checkpoint here has a beta of 0
and ``rope_interleave``; like DeepSeek V3's, ``num_key_value_heads`` equals the heads.
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
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_generate
from tests.unit.model.family_checkpoints import assert_not_degenerate
from tests.unit.model.gemma4_checkpoints import build_gemma4_checkpoint
from tests.unit.model.latent_checkpoints import (
    _config as latent_config,
    build_latent_checkpoint,
    build_mistral4_vl_checkpoint,
)
from tests.unit.model.llama4_checkpoints import build_llama4_checkpoint
from tests.unit.model.test_gguf_llamacpp import GREEDY, PROMPTS, tokenizer_dirs  # noqa: F401

# ours -> llama.cpp's arch
ARCH = {
    "llama4": "llama4",
    "deepseek_v3": "deepseek2",
    "gemma4": "gemma4",
    "gemma4_moe": "gemma4",
    "mistral4": "mistral4",
}
# llama.cpp's runtime constants for a Llama 4 file (gguf_llama4.py); the rest as the engine's tests have it
_LLAMA4 = dict(
    attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, no_rope_layers=None, use_qk_norm=True
)


def _checkpoint(kind: str, out: Path, tokenizers: dict[str, Path]) -> tuple[Path, Path]:
    """(the HF directory, the directory the converter reads: the published form where it reads only that)."""
    if kind == "llama4":
        d = build_llama4_checkpoint("llama4", out, tokenizers["bpe"], **_LLAMA4)
        return d, d
    if kind.startswith("gemma4"):
        from transformers import AutoTokenizer

        spm_json = out.parent / "spm-json"
        AutoTokenizer.from_pretrained(str(tokenizers["spm"])).save_pretrained(str(spm_json))
        d = build_gemma4_checkpoint(out, spm_json, moe=kind == "gemma4_moe")
        return d, d
    if kind == "mistral4":  # module docstring
        rope = dict(latent_config(kind, 16)[0].rope_parameters, llama_4_scaling_beta=0.0)
        d = build_latent_checkpoint(
            kind, out, tokenizers["bpe"], num_key_value_heads=4, rope_interleave=True, rope_parameters=rope
        )
        return d, build_mistral4_vl_checkpoint(d, out.parent / f"{kind}-vl")
    d = build_latent_checkpoint(
        kind, out, tokenizers["bpe"], scoring_func="sigmoid", topk_method="noaux_tc", num_key_value_heads=4
    )
    return d, d


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_dirs) -> dict[str, tuple[Path, Path, Path]]:  # noqa: F811
    """kind -> (HF directory, the f32 GGUF llama.cpp's converter made of it, the directory it read)."""
    root = tmp_path_factory.mktemp("llamacpp-gguf-layers")
    out = {}
    for kind in ARCH:
        d, src = _checkpoint(kind, root / kind, tokenizer_dirs)
        out[kind] = (d, convert(src, root / f"{kind}.gguf", "f32"), src)
    return out


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Converted checkpoints in a home of the test's own; the CPU kernels, keyed by their sources and
    flags, shared with the usual home (built once, not once a test)."""
    from sidecar.model.demo import sidecar_home

    kernels = sidecar_home() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("SIDECAR_HOME", str(home))


def _engine_matches(hf_dir: Path, path: Path, ref: list[list[int]]) -> LLM:
    llm = LLM(model=str(path), dtype="float32", block_size=8, max_num_batched_tokens=16)
    want = json.loads((hf_dir / "config.json").read_text())["architectures"][0]
    assert llm.engine.loaded.args.architecture == want
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert_pool_whole(llm)
    return llm


def _hf_greedy(hf_dir: Path) -> list[list[int]]:
    """HF's greedy continuations of PROMPTS on ``hf_dir`` (by the class its config names: transformers'
    auto classes do not map every family here)."""
    import transformers as tf

    cls = getattr(tf, json.loads((hf_dir / "config.json").read_text())["architectures"][0])
    hf = cls.from_pretrained(str(hf_dir), dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # compare full-length continuations
    return hf_generate(hf, PROMPTS, GREEDY.max_tokens)


def _state(path: Path) -> dict[str, torch.Tensor]:
    import gguf

    from sidecar.model.gguf import hf_config
    from sidecar.model.gguf_convert import gguf_state_dict

    reader = gguf.GGUFReader(str(path))
    return gguf_state_dict(reader, hf_config(reader, str(path)))


@pytest.mark.parametrize("kind", ARCH)
def test_converter_file_matches_hf_on_the_checkpoint_it_came_from(converted, kind):
    import gguf
    from transformers import AutoTokenizer

    hf_dir, path, _ = converted[kind]
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == ARCH[kind]
    theirs = load_file(str(hf_dir / "model.safetensors"))
    ours = _state(path)
    assert sorted(ours) == sorted(theirs)
    for name, w in theirs.items():
        assert torch.equal(ours[name], w), name
    ref = _hf_greedy(hf_dir)
    assert_not_degenerate(ref)
    llm = _engine_matches(hf_dir, path, ref)
    # the tokenizer is the file's: the source directory's encoding and chat template
    source = AutoTokenizer.from_pretrained(str(hf_dir))
    text = "The quick brown fox, 42 times: done."
    spaced = " " + text if kind.startswith("gemma4") else text  # module docstring
    assert (
        llm.tokenizer(spaced, add_special_tokens=False).input_ids
        == source(text, add_special_tokens=False).input_ids
    )
    ids = list(range(len(source)))
    assert llm.tokenizer.convert_ids_to_tokens(ids) == source.convert_ids_to_tokens(ids)
    assert llm.tokenizer.eos_token_id == source.eos_token_id
    assert llm.tokenizer.chat_template == source.chat_template


@pytest.mark.parametrize("kind", ARCH)
def test_q8_0_file_matches_hf_on_the_weights_it_holds(converted, tmp_path, kind):
    """The file's matrices are quantizations of the checkpoint's (within half a step of each Q8_0 block's
    scale; vectors stay float32, and so do the matrices the converter keeps float: routers, rows too
    short for a block), and the engine follows those values, not the checkpoint's."""
    hf_dir, _, src = converted[kind]
    path = convert(src, tmp_path / f"{kind}-q8_0.gguf", "q8_0")
    theirs = load_file(str(hf_dir / "model.safetensors"))
    held = _state(path)
    assert sorted(held) == sorted(theirs)
    quantized = 0
    for name, w in theirs.items():
        err = (held[name] - w).abs().max().item()
        if w.dim() == 1:
            assert err == 0, name
        assert err <= w.abs().max().item() / 200, name
        quantized += err > 0
    assert quantized > len(theirs) // 3
    ref_dir = tmp_path / f"{kind}-q8_0-values"
    shutil.copytree(hf_dir, ref_dir)
    save_file(held, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref = _hf_greedy(ref_dir)
    assert_not_degenerate(ref)
    assert ref != _hf_greedy(hf_dir)  # the engine must follow the file
    _engine_matches(hf_dir, path, ref)


def _file_with(path: Path, arch: str, keys: dict, tensors: tuple[str, ...] = ()) -> Path:
    """A GGUF file of ``arch`` holding the base shape keys, ``keys`` and zero ``tensors``: enough for the
    loader to read its metadata and refuse it."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_vocab_size(16)
    for key, value in keys.items():
        if isinstance(value, bool):
            w.add_bool(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    for name in ("token_embd.weight", *tensors):
        w.add_tensor(name, np.zeros((16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "arch,keys,tensors,error",
    [
        (
            "llama4",
            {"expert_count": 4, "expert_feed_forward_length": 32},
            ("rope_freqs.weight",),
            "rope_freqs",
        ),
        ("llama4", {}, (), "llama4.expert_count"),
        ("deepseek2", {"expert_count": 4}, (), "deepseek2.expert_gating_func"),
        ("mistral4", {"expert_count": 4, "expert_gating_func": 2}, (), "mistral4.expert_gating_func"),
        ("mistral4", {"expert_count": 4}, ("blk.0.exp_probs_b.bias",), "blk.0.exp_probs_b.bias"),
        ("mistral4", {"attention.temperature_scale": 1}, (), "mistral4.attention.temperature_scale"),
        ("gemma4", {"expert_count": 4}, (), "blk.0.ffn_gate_inp.weight is missing"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_naming_the_key(tmp_path, arch, keys, tensors, error):
    path = _file_with(tmp_path / f"{arch}.gguf", arch, keys, tensors)
    with pytest.raises(ValueError, match=error.replace(".", r"\.")):
        LLM(model=str(path))


def test_gemma4_split_expert_projections_are_joined_back(converted):
    """llama.cpp also reads Gemma 4's experts as separate gate and up tensors (``ffn_gate_exps``,
    ``ffn_up_exps``); such a file's tensors come back as the fused ``gate_up_proj`` HF holds."""
    from sidecar.model import gguf_gemma4
    from sidecar.model.gguf_tensors import hf_name

    hf_dir = converted["gemma4_moe"][0]
    fused = load_file(str(hf_dir / "model.safetensors"))["model.layers.2.experts.gate_up_proj"]
    gate, up = fused.chunk(2, dim=1)
    split = {
        hf_name(f"blk.2.{n}.weight", "gemma4"): w for n, w in (("ffn_gate_exps", gate), ("ffn_up_exps", up))
    }
    assert sorted(split) == [
        "model.layers.2.experts.gate_proj.weight",
        "model.layers.2.experts.up_proj.weight",
    ]
    joined = gguf_gemma4.fix_state(split, {})
    assert list(joined) == ["model.layers.2.experts.gate_up_proj"]
    assert torch.equal(joined["model.layers.2.experts.gate_up_proj"], fused)
