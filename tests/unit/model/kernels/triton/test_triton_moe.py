"""The grouped expert GEMM (``triton_moe``) against a torch reference that runs each (token, slot) through its
expert: several expert counts, k and T (T = 1 included), experts no row picks, biases, each activation and the
input-scaled form; its block-aligned layout; its routing layout on the meta device (no host reads); and MoE
checkpoints through the model and the engine with the path forced on against the path off."""

import pytest
import torch
import torch.nn.functional as F

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model.kernels.triton import moe as triton_moe
from sidecar.model.layers import clamped_swiglu
from sidecar.model.loader import load_model
from sidecar.model.moe import SparseMoE
from tests.unit.model.family_checkpoints import build_family_checkpoint
from tests.unit.model.kernels.triton.test_triton_model import _run, _spy

H, INTER = 32, 48
LIMIT, ALPHA = 0.7, 1.702


def _reference(x, weights, ids, ex, act, scale_input=False):
    t, k = ids.shape
    out = torch.zeros(t, k, x.shape[1], dtype=torch.promote_types(x.dtype, weights.dtype))
    for i in range(t):
        for j in range(k):
            e, w = int(ids[i, j]), weights[i, j : j + 1]
            row = x[i : i + 1] * w if scale_input else x[i : i + 1]
            gu = F.linear(row, ex.gate_up[e], None if ex.gate_up_bias is None else ex.gate_up_bias[e])
            if act == triton_moe.CLAMPED_SWIGLU:
                a = clamped_swiglu(gu, LIMIT, ALPHA)
            else:
                gate, up = gu.chunk(2, dim=-1)
                a = (F.silu(gate) if act == triton_moe.SILU else F.gelu(gate, approximate="tanh")) * up
            y = F.linear(a, ex.down[e], None if ex.down_bias is None else ex.down_bias[e])
            out[i, j] = y[0] if scale_input else (y * w)[0]
    return out.sum(dim=1).to(x.dtype)


def _case(num_experts, k, t, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    to = dict(dtype=dtype)
    ex = triton_moe.Experts(
        (torch.randn(num_experts, 2 * INTER, H, generator=g) / H**0.5).to(**to),
        torch.randn(num_experts, 2 * INTER, generator=g).to(**to) if bias else None,
        (torch.randn(num_experts, H, INTER, generator=g) / INTER**0.5).to(**to),
        torch.randn(num_experts, H, generator=g).to(**to) if bias else None,
    )
    x = torch.randn(t, H, generator=g).to(**to)
    # the last expert is never picked: its tiles are empty
    ids = torch.stack([torch.randperm(num_experts - 1, generator=g)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return x, weights, ids, ex


@pytest.mark.parametrize("num_experts,k,t", [(4, 2, 1), (8, 2, 5), (6, 3, 20), (3, 1, 40), (9, 4, 3)])
@pytest.mark.parametrize("act", [triton_moe.SILU, triton_moe.GELU_TANH, triton_moe.CLAMPED_SWIGLU])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_moe_matches_each_slot_through_its_expert(num_experts, k, t, act, bias):
    x, weights, ids, ex = _case(num_experts, k, t, bias, torch.float32, 10 * t + k + act)
    got = triton_moe.grouped_moe(x, weights, ids, ex, act, LIMIT, ALPHA)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, _reference(x, weights, ids, ex, act), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_model_dtype_weights(dtype):
    x, weights, ids, ex = _case(5, 2, 7, True, dtype, 3)
    for w in (weights, weights.to(dtype)):  # float32 weights (Mixtral) and model-dtype ones (Qwen3-MoE)
        got = triton_moe.grouped_moe(x, w, ids, ex, triton_moe.SILU)
        assert got.dtype == dtype
        torch.testing.assert_close(got, _reference(x, w, ids, ex, triton_moe.SILU), atol=2e-2, rtol=2e-2)


def test_input_scaled_experts():
    """Llama 4: the routing weight scales the expert's input, not its output."""
    x, _, ids, ex = _case(4, 1, 6, False, torch.float32, 5)
    weights = torch.sigmoid(torch.randn(6, 1, generator=torch.Generator().manual_seed(6)))  # not 1 at k = 1
    got = triton_moe.grouped_moe(x, weights, ids, ex, triton_moe.SILU, scale_input=True)
    ref = _reference(x, weights, ids, ex, triton_moe.SILU, scale_input=True)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(got, _reference(x, weights, ids, ex, triton_moe.SILU), atol=1e-3)


def test_layout_is_block_aligned_and_holds_every_slot_once():
    ids = torch.tensor([[3, 0], [0, 3], [5, 0], [3, 1], [0, 5]])
    rows, tile_expert = triton_moe.layout(ids, 7, 4)
    assert rows.shape[0] == 4 * tile_expert.shape[0] == 4 * ((10 + 7 * 3) // 4)
    assert tile_expert.tolist()[:5] == [0, 1, 3, 5, -1] and set(tile_expert.tolist()[4:]) == {-1}
    flat = ids.reshape(-1)
    for tile, e in enumerate(tile_expert.tolist()):
        slots = [s for s in rows[4 * tile : 4 * tile + 4].tolist() if s >= 0]
        assert all(int(flat[s]) == e for s in slots) and (e >= 0 or not slots)
    assert sorted(s for s in rows.tolist() if s >= 0) == list(range(10))
    # expert 0's slots in token order fill a tile; expert 1's one slot is padded to the next
    assert rows[:8].tolist() == [1, 2, 5, 8, 7, -1, -1, -1]


def test_layout_makes_no_host_reads():
    """On the meta device any read of a value raises: finishing proves the routing layout can be captured."""
    ids = torch.empty(6, 2, dtype=torch.long, device="meta")
    rows, tile_expert = triton_moe.layout(ids, 8, 16)
    assert rows.device.type == "meta" and rows.shape == (16 * tile_expert.shape[0],)


def test_inputs_it_does_not_take_get_none():
    x, weights, ids, ex = _case(4, 2, 3, False, torch.float32, 1)
    assert triton_moe.grouped_moe(x.to(torch.float64), weights, ids, ex) is None
    assert triton_moe.grouped_moe(x[:, :16], weights, ids, ex) is None


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("moe_triton")
    return {k: build_family_checkpoint(k, root / k, demo_dir) for k in ("mixtral", "qwen3_moe", "gpt_oss")}


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_model_with_the_moe_path_matches_the_path_off(moe_dirs, kind, monkeypatch):
    model = load_model(
        EngineConfig(model=str(moe_dirs[kind]), dtype="float32", device="cpu"), pack=False
    ).model
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert blocks and all(b.stacked is not None for b in blocks)
    assert_moe_path_matches_off(model, len(blocks), monkeypatch)


def assert_moe_path_matches_off(model, num_blocks: int, monkeypatch) -> None:
    """The model's logits over prompt, decode and one-row steps with the ``moe`` path on equal those with it
    off (the same greedy tokens, float32 summation order apart), the grouped kernel taken by every block."""
    ref = _run(model, torch.device("cpu"))
    calls = []
    _spy(monkeypatch, triton_moe, "grouped_moe", calls)
    model.fast_paths.moe = True
    fast = _run(model, torch.device("cpu"))
    assert len(calls) >= num_blocks * 5  # every sparse block, every step (prompt, decode, one row)
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(fast, ref, atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def qwen3_moe_llm(moe_dirs):
    """Qwen3-MoE: dense layers between the sparse ones, routing weights in the model dtype."""
    return LLM(model=str(moe_dirs["qwen3_moe"]), dtype="float32", num_kv_blocks=64, block_size=8)


def test_engine_greedy_tokens_unchanged_with_the_moe_path(qwen3_moe_llm, monkeypatch):
    llm = qwen3_moe_llm
    prompts = [[5, 9, 23, 41], [7 + i % 50 for i in range(19)], [300, 301]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    calls = []
    _spy(monkeypatch, triton_moe, "grouped_moe", calls)
    llm.engine.runner.model.fast_paths.moe = True
    fast = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls and fast == ref and all(len(t) == 5 for t in ref)
    llm.engine.runner.model.fast_paths.moe = False


def test_the_self_check_keeps_a_right_moe_path_and_drops_a_wrong_one(qwen3_moe_llm, monkeypatch):
    from sidecar.engine import self_check

    runner = qwen3_moe_llm.engine.runner
    assert "moe" in self_check.default_paths(runner)
    seen = []
    real = triton_moe.grouped_moe
    fp = runner.fast_paths
    monkeypatch.setattr(
        triton_moe, "grouped_moe", lambda *a, **k: seen.append(fp.cuda_graphs) or real(*a, **k)
    )
    assert self_check.run(runner, ["moe", "cuda_graphs"]) == {}
    assert fp.active() == ["moe", "cuda_graphs"]
    assert True in seen  # the decode-graph probe ran with the grouped experts (the torch ones read the host)
    monkeypatch.setattr(triton_moe, "grouped_moe", lambda *a, **k: real(*a, **k) * 1.5)
    fallbacks = self_check.run(runner, ["moe"])
    assert "differ" in fallbacks["moe"] and fp.active() == []
    runner.graphs.clear()
    runner.set_decode_padding(False)
