"""Quantized experts: int8 / int4 on load and through ``sidecar quantize`` cover every expert's projections
(the router stays in full precision), and greedy output equals the float model whose weights are the
dequantized codes; LoRA on a mixture of experts is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from sidecar import LLM, SamplingParams
from sidecar.model.linear import Linear
from sidecar.model.moe import SparseMoE
from sidecar.model.quant import Int4Linear, Int8Linear
from sidecar.model.quant_format import dequantize_int4, dequantize_int8, quantize_weight
from tests.unit.model.family_checkpoints import build_family_checkpoint

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPTS = [[5 + (11 * i + 5 * j) % 800 for j in range(n)] for i, n in enumerate([4, 9, 17, 26, 6])]
# The decoder linears quantize-on-load replaces, by their checkpoint names (ours fuse q/k/v and gate/up
# row-wise, so quantizing each part alone gives the same codes and scales).
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, demo_dir):
    return build_family_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moeq") / "qwen3_moe", demo_dir)


def _dequantized_copy(src, out, mode: str, group_size: int):
    """``src`` with every decoder linear's weight replaced by its dequantized int8 / int4 codes."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith(tuple(f".{n}.weight" for n in LINEARS)):
            q = quantize_weight(t, mode, group_size, t.dtype, name)
            w = (
                dequantize_int8(q["qweight"], q["scales"])
                if mode == "int8"
                else dequantize_int4(q["qweight"], q["scales"], q["zeros"], t.shape[1])
            )
            tensors[name] = w.to(t.dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


# The kernels' activations: float32 against int8 codes; rounded to 16 bits against int4 codes.
@pytest.mark.parametrize("mode,group_size,rel", [("int8", 128, 1e-3), ("int4", 32, 2e-2)])
def test_quantized_experts_match_the_dequantized_reference(moe_dir, tmp_path, mode, group_size, rel):
    llm = LLM(
        model=str(moe_dir), dtype="float32", quantization=mode, quant_group_size=group_size, num_kv_blocks=64
    )
    cls = Int8Linear if mode == "int8" else Int4Linear
    blocks = [layer.mlp for layer in llm.engine.loaded.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert len(blocks) == 2
    for moe in blocks:
        assert type(moe.gate) is Linear  # the router is not quantized
        for expert in moe.experts:
            assert isinstance(expert.gate_up_proj, cls) and isinstance(expert.down_proj, cls)
    assert llm.engine.model_info["quantization"] == mode
    ref = LLM(model=str(_dequantized_copy(moe_dir, tmp_path / "deq", mode, group_size)), dtype="float32")
    ref_blocks = [layer.mlp for layer in ref.engine.loaded.model.layers if isinstance(layer.mlp, SparseMoE)]
    x = torch.randn(6, blocks[0].gate.in_features, generator=torch.Generator().manual_seed(0))
    for ours, theirs in zip(blocks, ref_blocks):
        assert torch.equal(ours.route(x)[1], theirs.route(x)[1])
        want = theirs(x)
        assert (ours(x) - want).abs().max() <= rel * want.abs().max()
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    want = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    if mode == "int8":
        assert got == want
    else:  # 16-bit activations may flip a near tie a few tokens in; the first tokens hold
        assert sum(a[0] == b[0] for a, b in zip(got, want)) >= len(PROMPTS) - 1


def test_quantize_command_covers_the_experts(moe_dir, tmp_path, capsys):
    from sidecar.cli import main

    out = tmp_path / "int8"
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--model", str(moe_dir), "--quantization", "int8", "--out", str(out)])
    assert exc.value.code == 0
    modules = json.loads((out / "quantization_config.json").read_text())["modules"]
    assert "layers.1.mlp.experts.7.gate_up_proj" in modules and "layers.3.mlp.experts.0.down_proj" in modules
    assert not any(m.endswith(".gate") for m in modules)
    saved = LLM(model=str(out), dtype="float32", num_kv_blocks=64)
    layer = saved.engine.loaded.model.layers[3].mlp
    assert isinstance(layer.experts[5].down_proj, Int8Linear) and isinstance(layer.gate, nn.Linear)
    on_load = LLM(model=str(moe_dir), dtype="float32", quantization="int8", num_kv_blocks=64)
    assert [o.token_ids for o in saved.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in on_load.generate(PROMPTS, GREEDY)
    ]


def test_lora_on_a_mixture_of_experts_is_refused_by_name(moe_dir):
    with pytest.raises(ValueError, match="lora: Qwen3MoeForCausalLM is a mixture-of-experts model"):
        LLM(model=str(moe_dir), dtype="float32", enable_lora=True, num_kv_blocks=64)
