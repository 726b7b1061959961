"""Gemma 4 (gemma4_checkpoints.py) with int8 / int4 weights: quantized on load, every linear of its layers
(q/k/v/o, the GeGLU MLP, the experts, the per-layer input gate and projection) and the per-layer model
projection become int8 / int4 layers, the head in its own mode (the tied embedding with it), the router and
the per-layer embedding table staying in full precision; greedy output equals the float model whose weights
are the dequantized codes; and a ``sidecar quantize`` directory loads back to the very buffers and tokens."""

from __future__ import annotations

import json

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model.linear import Linear
from sidecar.model.quant import Int4Linear, Int8Linear, QuantEmbedding
from sidecar.model.quant_format import dequantize_int4, dequantize_int8, quantize_weight
from tests.unit.model.gemma4_checkpoints import build_gemma4_checkpoint

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 1, 30, 17])]
# The checkpoint's linears quantize-on-load replaces, by their HF names (ours fuse gate/up row-wise, so
# quantizing each part alone gives the same codes and scales; the experts are [E, out, in] stacks).
LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "per_layer_input_gate",
    "per_layer_projection",
    "per_layer_model_projection",
)
EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("gemma4q")
    return {
        "dense": build_gemma4_checkpoint(root / "dense", demo_dir),
        "moe": build_gemma4_checkpoint(root / "moe", demo_dir, moe=True),
    }


def _dequantized(t: torch.Tensor, mode: str, group_size: int, name: str) -> torch.Tensor:
    if t.dim() == 3:  # an expert stack: each expert's projection on its own
        return torch.stack([_dequantized(e, mode, group_size, name) for e in t])
    q = quantize_weight(t, mode, group_size, t.dtype, name)
    if mode == "int8":
        w = dequantize_int8(q["qweight"], q["scales"])[:, : t.shape[1]]
    else:
        w = dequantize_int4(q["qweight"], q["scales"], q["zeros"], t.shape[1])
    return w.to(t.dtype).contiguous()


def _dequantized_copy(src, out, mode: str, group_size: int):
    """``src`` with every quantized linear's weight replaced by its dequantized codes, and the tied
    embedding by its int8 ones (the head's default mode)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(tuple(f".{n}.weight" for n in LINEARS) + EXPERTS):
            tensors[name] = _dequantized(t, mode, group_size, name)
    if "lm_head.weight" not in tensors:
        name = "model.embed_tokens.weight"
        tensors[name] = _dequantized(tensors[name], "int8", 128, name)
    else:
        tensors["lm_head.weight"] = _dequantized(tensors["lm_head.weight"], "int8", 128, "lm_head")
    save_file(tensors, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_same_greedy(got, want, tol: float) -> None:
    """``got`` continues each prompt as ``want`` does, each step's log-probability within ``tol`` of
    ``want``'s, up to where ``want`` stood at a near tie (its top two within ``tol``): there ``got`` may take
    the other token, and the rest of that sequence is not compared. The random checkpoints' distributions are
    nearly flat, so the kernels' other rounding may flip such a tie."""
    for a, b in zip(got, want):
        assert a.prompt_token_ids == b.prompt_token_ids
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            if x.token_id != y.token_id:
                close = dict(y.top).get(x.token_id)
                assert close is not None and close >= y.logprob - tol, (step, x, y)
                break
            assert abs(x.logprob - y.logprob) <= tol, (step, x, y)


@pytest.mark.parametrize(
    "kind,mode,group_size", [("dense", "int8", 128), ("dense", "int4", 32), ("moe", "int8", 128)]
)
def test_quantized_gemma4_matches_the_dequantized_reference(dirs, tmp_path, kind, mode, group_size):
    kw = dict(dtype="float32", block_size=8, num_kv_blocks=64)
    llm = LLM(model=str(dirs[kind]), quantization=mode, quant_group_size=group_size, **kw)
    model = llm.engine.loaded.model
    cls = Int8Linear if mode == "int8" else Int4Linear
    for layer in model.layers:
        attn = layer.self_attn
        mine = [attn.q_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        mine += [layer.per_layer_input_gate, layer.per_layer_projection]
        mine += [attn.k_proj] if attn.owns_kv else []
        if layer.experts is not None:
            assert type(layer.experts.gate) is Linear  # the router stays in full precision
            mine += [m for e in layer.experts.experts for m in (e.gate_up_proj, e.down_proj)]
        assert all(isinstance(m, cls) for m in mine)
    assert isinstance(model.per_layer_model_projection, cls)
    assert isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.embed_tokens, QuantEmbedding if kind == "dense" else torch.nn.Embedding)
    assert type(model.embed_tokens_per_layer) is torch.nn.Embedding
    assert llm.engine.model_info["quantization"] == mode
    ref = LLM(model=str(_dequantized_copy(dirs[kind], tmp_path / "deq", mode, group_size)), **kw)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    got, want = llm.generate(PROMPTS, params), ref.generate(PROMPTS, params)
    assert_same_greedy(got, want, 1e-2 if mode == "int8" else 0.1)


def test_quantize_command_output_loads_back_to_the_same_model(dirs, tmp_path, capsys):
    from sidecar.cli import main

    mode, out = "int4", tmp_path / "int4"
    argv = ["quantize", "--model", str(dirs["dense"]), "--quantization", mode, "--group-size", "32"]
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--out", str(out)])
    assert exc.value.code == 0
    saved = json.loads((out / "quantization_config.json").read_text())
    assert (
        "layers.3.per_layer_projection" in saved["modules"]
        and "per_layer_model_projection" in saved["modules"]
    )
    assert "layers.3.self_attn.k_proj" not in saved["modules"]  # a layer reading layer 2's KV has none
    assert saved["tied_embedding"] == "embed_tokens" and saved["lm_head_mode"] == "int8"
    kw = dict(dtype="float32", block_size=8, num_kv_blocks=64)
    back = LLM(model=str(out), **kw)
    on_load = LLM(model=str(dirs["dense"]), quantization=mode, quant_group_size=32, **kw)
    assert back.engine.loaded.quantization == mode
    a, b = back.engine.loaded.model.state_dict(), on_load.engine.loaded.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _tokens(back) == _tokens(on_load)


def test_a_checkpoint_quantized_by_another_tool_is_refused_naming_the_field(dirs, tmp_path):
    import shutil

    d = shutil.copytree(dirs["dense"], tmp_path / "gptq")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match="quantization_config: Gemma4ForCausalLM is read in our formats only"
    ):
        LLM(model=str(d), dtype="float32")
