"""Multi-LoRA serving: PEFT adapters give HF transformers + PEFT's greedy output (merged, float32), a batch
mixing adapters gives every row its solo output, adapters never share prefix-cache blocks, loading and
unloading under load leaves the pool whole, and bad adapters are refused naming the file and field."""

from __future__ import annotations

import json

import pytest

from lora_helpers import ATTN, MLP, hf_peft_greedy, make_adapter
from sidecar import LLM, SamplingParams
from sidecar.engine.lora_manager import AdapterNotFoundError
from sidecar.model.lora import AdapterError

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42, 8, 99, 100], list(range(7, 45)), [600, 3, 3, 81, 200, 14, 15, 16, 17, 18, 400]]
# Three adapters of different shapes: attention only, everything with rsLoRA, MLP only at the maximum rank.
SPECS = {
    "attn": dict(r=4, targets=["q_proj", "v_proj"], seed=1),
    "all": dict(r=8, targets=ATTN + MLP, rslora=True, alpha=8.0, seed=2),
    "mlp": dict(r=16, targets=MLP, seed=3),
}


def assert_pool_whole(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.requests
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks[1:])
    assert not any(eng.lora.pins) and not eng.lora.parked


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        kind: {name: make_adapter(d, root / f"{kind}-{name}", **spec) for name, spec in SPECS.items()}
        for kind, d in tiny_models.items()
    }


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_each_adapter_matches_hf_peft_merged(tiny_models, adapters, kind):
    base = tiny_models[kind]
    llm = LLM(
        model=str(base),
        dtype="float32",
        max_lora_rank=16,
        lora_modules={n: str(p) for n, p in adapters[kind].items()},
    )
    plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert plain == hf_peft_greedy(base, None, PROMPTS, MAX_NEW)
    for name, path in adapters[kind].items():
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora=name)]
        assert got == hf_peft_greedy(base, path, PROMPTS, MAX_NEW), name
        assert got != plain, f"adapter {name} left the output unchanged: the test would prove nothing"
    assert_pool_whole(llm)


@pytest.mark.parametrize("max_loras,overlap", [(4, False), (2, False), (4, True)])
def test_mixed_batch_gives_each_row_its_solo_output(tiny_models, adapters, max_loras, overlap):
    """Three adapters and the base in one batch; with two slots, requests park and adapters are evicted.
    With overlapped steps forced on, a batch with adapter rows is never launched ahead (it runs eagerly
    with its low-rank updates), so each row still gets its adapter's output."""
    llm = LLM(
        model=str(tiny_models["llama"]),
        dtype="float32",
        max_loras=max_loras,
        max_lora_rank=16,
        lora_modules={n: str(p) for n, p in adapters["llama"].items()},
        overlap_steps=overlap,
    )
    names = ["attn", "all", "mlp", None]
    solo = {n: [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora=n)] for n in names}
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    mixed = llm.generate(prompts, GREEDY, lora=loras)
    for i, (p, n, out) in enumerate(zip(prompts, loras, mixed)):
        assert out.token_ids == solo[n][PROMPTS.index(p)], (i, n)
    assert len({tuple(v[1]) for v in solo.values()}) == len(names)  # four different answers
    if max_loras == 2:
        assert llm.stats()["lora_evictions"] > 0
    assert_pool_whole(llm)


def test_prefix_cache_never_crosses_adapters(tiny_models, adapters):
    llm = LLM(
        model=str(tiny_models["llama"]),
        dtype="float32",
        block_size=8,
        max_lora_rank=16,
        lora_modules={n: str(p) for n, p in adapters["llama"].items()},
    )
    prompt = PROMPTS[1]  # 38 tokens: four full blocks
    first = llm.generate([prompt], GREEDY, lora="attn")[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, lora="mlp")[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    again = llm.generate([prompt], GREEDY, lora="attn")[0]
    assert again.num_cached_tokens == 32 and again.token_ids == first.token_ids
    # A re-registered adapter under the same name never reuses its predecessor's blocks.
    llm.unload_lora("attn")
    llm.load_lora("attn", str(adapters["llama"]["mlp"]))
    assert llm.generate([prompt], GREEDY, lora="attn")[0].num_cached_tokens == 0
    assert_pool_whole(llm)


def test_load_and_unload_under_load(tiny_models, adapters):
    llm = LLM(
        model=str(tiny_models["llama"]), dtype="float32", max_loras=2, max_lora_rank=16, enable_lora=True
    )
    eng = llm.engine
    with pytest.raises(AdapterNotFoundError, match="model: 'all'"):
        eng.add_request(None, PROMPTS[0], GREEDY, lora="all")
    llm.load_lora("all", str(adapters["llama"]["all"]))
    solo = llm.generate(PROMPTS, GREEDY, lora="all")
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    base_long = llm.generate([PROMPTS[2]], long)[0].token_ids
    ids = [eng.add_request(None, p, GREEDY, lora="all") for p in PROMPTS] + [
        eng.add_request(None, PROMPTS[2], long)
    ]
    outs = {}
    for _ in range(3):
        outs.update({o.request_id: o for o in eng.step()})
    llm.unload_lora("all")  # running requests keep their adapter until they finish
    llm.load_lora("mlp", str(adapters["llama"]["mlp"]))
    with pytest.raises(AdapterNotFoundError):
        eng.add_request(None, PROMPTS[0], GREEDY, lora="all")
    mlp_id = eng.add_request(None, PROMPTS[0], GREEDY, lora="mlp")
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step()})
    assert [outs[i].token_ids for i in ids[:3]] == [o.token_ids for o in solo]
    assert outs[ids[3]].token_ids == base_long
    assert outs[mlp_id].token_ids == llm.generate([PROMPTS[0]], GREEDY, lora="mlp")[0].token_ids
    assert eng.lora.slot_owner.count(None) == 1  # the unloaded adapter's slot was given back
    assert_pool_whole(llm)


def test_abort_of_parked_and_running_requests_returns_everything(tiny_models, adapters):
    llm = LLM(
        model=str(tiny_models["llama"]),
        dtype="float32",
        max_loras=1,
        max_lora_rank=16,
        lora_modules={n: str(p) for n, p in adapters["llama"].items()},
    )
    eng = llm.engine
    a = eng.add_request(None, PROMPTS[1], GREEDY, lora="attn")
    b = eng.add_request(None, PROMPTS[1], GREEDY, lora="mlp")  # the one slot is pinned: parked
    assert eng.lora.stats()["lora_parked"] == 1
    eng.step()
    eng.abort(b)
    eng.abort(a)
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_whole(llm)


def test_speculative_ngram_and_int8_keep_each_adapters_output(tiny_models, adapters):
    mods = {n: str(p) for n, p in adapters["llama"].items()}
    ref = LLM(model=str(tiny_models["llama"]), dtype="float32", max_lora_rank=16, lora_modules=mods)
    # Long continuations: the tiny models fall into loops, which the n-gram proposer then predicts.
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    want = [ref.generate(PROMPTS, long, lora=n) for n in ("all", None)]
    spec = LLM(
        model=str(tiny_models["llama"]),
        dtype="float32",
        max_lora_rank=16,
        lora_modules=mods,
        speculative="ngram",
        speculative_token_cost=0.0,
    )
    got = spec.generate(PROMPTS * 2, long, lora=["all"] * 3 + [None] * 3)
    assert [o.token_ids for o in got] == [o.token_ids for w in want for o in w]
    assert spec.stats()["spec_decode_verifications"] > 0
    assert_pool_whole(spec)
    q = LLM(
        model=str(tiny_models["llama"]),
        dtype="float32",
        quantization="int8",
        max_lora_rank=16,
        lora_modules=mods,
    )
    solo = [q.generate(PROMPTS, GREEDY, lora=n) for n in ("all", None)]
    mixed = q.generate(PROMPTS * 2, GREEDY, lora=["all"] * 3 + [None] * 3)
    assert [o.token_ids for o in mixed] == [o.token_ids for s in solo for o in s]
    assert [o.token_ids for o in solo[0]] != [o.token_ids for o in solo[1]]
    assert_pool_whole(q)


def test_unknown_and_bad_names(tiny_models, adapters):
    llm = LLM(
        model=str(tiny_models["llama"]), dtype="float32", lora_modules={"a": str(adapters["llama"]["attn"])}
    )
    with pytest.raises(AdapterNotFoundError, match="model: 'nope'"):
        llm.generate(PROMPTS, GREEDY, lora="nope")
    with pytest.raises(ValueError, match="lora: got 1 adapter names for 3 prompts"):
        llm.generate(PROMPTS, GREEDY, lora=["a"])
    with pytest.raises(ValueError, match="lora_name: adapter 'a' is already loaded"):
        llm.load_lora("a", str(adapters["llama"]["attn"]))
    with pytest.raises(LookupError, match="'zzz' is not loaded"):
        llm.unload_lora("zzz")
    assert_pool_whole(llm)
    off = LLM(model=str(tiny_models["llama"]), dtype="float32")
    with pytest.raises(ValueError, match="lora: adapters are not enabled"):
        off.load_lora("a", str(adapters["llama"]["attn"]))


def _copy(src, dst, edit_config=None, edit_tensors=None):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        edit_config(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        t = load_file(str(dst / "adapter_model.safetensors"))
        edit_tensors(t)
        save_file(t, str(dst / "adapter_model.safetensors"))
    return dst


def test_malformed_adapters_are_refused_naming_file_and_field(tiny_models, adapters, tmp_path):
    import torch

    good = adapters["llama"]["all"]
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", max_lora_rank=8, enable_lora=True)
    big = adapters["llama"]["mlp"]  # rank 16
    cases = {
        "rank": (big, r"adapter_config.json: r: rank 16 is above max_lora_rank 8"),
        "missing": (tmp_path / "none", r"none: not a directory"),
        "target": (
            _copy(good, tmp_path / "t", lambda c: c.update(target_modules=["q_proj", "lm_head"])),
            r"adapter_config.json: target_modules: lm_head not supported",
        ),
        "dora": (
            _copy(good, tmp_path / "d", lambda c: c.update(use_dora=True)),
            r"adapter_config.json: use_dora",
        ),
        "shape": (
            _copy(
                good,
                tmp_path / "s",
                edit_tensors=lambda t: t.update(
                    {k: torch.zeros(v.shape[0], v.shape[1] + 1) for k, v in t.items() if "q_proj.lora_A" in k}
                ),
            ),
            r"adapter_model.safetensors: .*q_proj.lora_A.weight: shape \(8, 65\) does not fit",
        ),
        "layer": (
            _copy(
                good,
                tmp_path / "l",
                edit_tensors=lambda t: t.update(
                    {
                        k.replace("layers.0.", "layers.7."): v.clone()
                        for k, v in list(t.items())
                        if "layers.0." in k
                    }
                ),
            ),
            r"layers.7.*layer 7 does not exist",
        ),
        "json": (_copy(good, tmp_path / "j"), r"adapter_config.json: not valid JSON"),
    }
    (tmp_path / "j" / "adapter_config.json").write_text("{nope")
    for case, (path, msg) in cases.items():
        with pytest.raises(AdapterError, match=msg):
            llm.load_lora(case, str(path))
    assert llm.engine.lora.names() == {}
    llm.load_lora("ok", str(good))
    assert llm.generate(PROMPTS[:1], GREEDY, lora="ok")[0].finish_reason == "length"
    assert_pool_whole(llm)


def test_structured_output_holds_for_adapter_rows_mixed_with_the_base(tiny_models, adapters):
    import re

    llm = LLM(
        model=str(tiny_models["llama"]),
        dtype="float32",
        max_lora_rank=16,
        lora_modules={n: str(p) for n, p in adapters["llama"].items()},
    )
    params = SamplingParams(max_tokens=12, structured=r"[0-9]{3}-[a-z]{2}")
    solo = [llm.generate(PROMPTS[:1], params, lora=n)[0].text for n in ("all", "mlp", None)]
    mixed = [o.text for o in llm.generate(PROMPTS[:1] * 3, params, lora=["all", "mlp", None])]
    assert mixed == solo
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) for t in mixed), mixed
    assert_pool_whole(llm)


def test_parked_requests_count_toward_the_waiting_queue_bound(tiny_models, adapters):
    from sidecar.engine.request import QueueFullError

    llm = LLM(
        model=str(tiny_models["llama"]),
        dtype="float32",
        max_loras=1,
        max_lora_rank=16,
        max_waiting_requests=2,
        lora_modules={n: str(p) for n, p in adapters["llama"].items()},
    )
    eng = llm.engine
    eng.add_request(None, PROMPTS[0], GREEDY, lora="attn")  # pins the only slot
    eng.add_request(None, PROMPTS[0], GREEDY, lora="mlp")  # parked
    with pytest.raises(QueueFullError):
        eng.add_request(None, PROMPTS[0], GREEDY, lora="all")
    assert eng.lora.stats()["lora_parked"] == 1
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_whole(llm)


def test_a_parked_request_past_its_deadline_is_aborted(tiny_models, adapters):
    import time

    llm = LLM(
        model=str(tiny_models["llama"]),
        dtype="float32",
        max_loras=1,
        max_lora_rank=16,
        lora_modules={n: str(p) for n, p in adapters["llama"].items()},
    )
    eng = llm.engine
    a = eng.add_request(None, PROMPTS[0], GREEDY, lora="attn")
    b = eng.add_request(None, PROMPTS[0], GREEDY, lora="mlp", deadline=time.monotonic() - 1)
    outs = {o.request_id: o for o in eng.step()}
    assert outs[b].finish_reason == "abort" and outs[b].abort_reason == "deadline"
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step()})
    assert outs[a].finish_reason == "length"
    assert_pool_whole(llm)
