"""LoRA adapters through a real ``sidecar serve`` (tiny Llama checkpoint, CPU): a request's ``model`` picks
the adapter on the OpenAI API and on gRPC, adapters are listed with their base, loaded and unloaded at run
time by authenticated callers, and unknown or malformed ones are refused naming the field."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit" / "model"))
from lora_helpers import ATTN, MLP, make_adapter  # noqa: E402

from sidecar.v1 import sidecar_pb2 as pb  # noqa: E402
from sidecar.v1 import sidecar_pb2_grpc as pbg  # noqa: E402

KEY = "lora-key"
PROMPT = "the cat sat on the"
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-srv")
    base = tiny_models["llama"]
    return {
        "support": make_adapter(base, root / "support", 8, ATTN + MLP, seed=11),
        "mlp": make_adapter(base, root / "mlp", 4, MLP, seed=12),
    }


@pytest.fixture(scope="module")
def expected(tiny_models, adapters):
    """What the offline engine answers for PROMPT with each adapter and the base model."""
    from sidecar import LLM, SamplingParams

    llm = LLM(
        model=str(tiny_models["llama"]),
        dtype="float32",
        lora_modules={n: str(p) for n, p in adapters.items()},
    )
    sp = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    return {n: llm.generate([PROMPT], sp, lora=n)[0].text for n in ("support", "mlp", None)}


@pytest.fixture(scope="module")
def server(sidecar_launcher, tiny_models, adapters):
    with sidecar_launcher(
        "--model",
        str(tiny_models["llama"]),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--lora",
        f"support={adapters['support']}",
        "--max-loras",
        "2",
        "--api-key",
        KEY,
        "--served-model-name",
        "base",
    ) as sc:
        yield sc


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.http_base}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield pbg.InferenceStub(ch)


AUTH = (("authorization", f"Bearer {KEY}"),)


def complete(client: OpenAI, model: str) -> str:
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert r.model == model
    return r.choices[0].text


def wait_pool_whole(stub) -> None:
    end = time.monotonic() + 30
    while True:
        s = stub.GetStats(pb.GetStatsRequest(), metadata=AUTH)
        if s.num_free_kv_blocks == s.num_kv_blocks and s.num_running == 0 and s.num_waiting == 0:
            return
        assert time.monotonic() < end, s
        time.sleep(0.05)


def test_model_name_picks_the_adapter_on_http_and_grpc(client, stub, expected):
    assert expected["support"] != expected[None]
    assert complete(client, "support") == expected["support"]
    assert complete(client, "base") == expected[None]
    req = pb.GenerateRequest(
        prompt=PROMPT,
        model="support",
        sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
        cache_control=pb.CACHE_CONTROL_SKIP,
    )
    out = stub.Generate(req, metadata=AUTH)
    assert (out.text, out.model) == (expected["support"], "support")
    chat = client.chat.completions.create(
        model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
    )
    assert chat.model == "support" and chat.choices[0].message.content is not None
    wait_pool_whole(stub)


def test_adapters_are_listed_with_their_base(client, stub, adapters):
    models = {m.id: m for m in client.models.list().data}
    assert models["support"].model_extra["parent"] == "base"
    assert models["support"].model_extra["root"] == str(adapters["support"])
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)
    assert [(a.name, a.path, a.base_model) for a in info.lora_adapters] == [
        ("support", str(adapters["support"]), "base")
    ]


def test_unknown_adapter_is_not_found_naming_model(client, stub):
    with pytest.raises(openai.NotFoundError) as err:
        complete(client, "nope")
    assert err.value.body["param"] == "model" and "'nope'" in err.value.body["message"]
    with pytest.raises(grpc.RpcError) as rpc:
        stub.Generate(pb.GenerateRequest(prompt=PROMPT, model="nope"), metadata=AUTH)
    assert rpc.value.code() == grpc.StatusCode.NOT_FOUND and rpc.value.details().startswith("model:")


def test_load_and_unload_at_run_time(server, client, stub, adapters, expected, tmp_path):
    url = server.http_base
    body = {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401  # no key
    auth = {"authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert complete(client, "mlp") == expected["mlp"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64, "lora_alpha": 8}')
    r = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)}, headers=auth
    )
    assert r.status_code == 400 and "adapter_config.json: r: rank 64 is above max_lora_rank 16" in r.text
    assert (
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=auth).status_code
        == 200
    )
    with pytest.raises(openai.NotFoundError):
        complete(client, "mlp")
    assert (
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=auth).status_code
        == 404
    )
    # The same over gRPC.
    stub.LoadLoraAdapter(
        pb.LoadLoraAdapterRequest(lora_name="mlp2", lora_path=str(adapters["mlp"])), metadata=AUTH
    )
    assert complete(client, "mlp2") == expected["mlp"]
    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="mlp2"), metadata=AUTH)
    with pytest.raises(grpc.RpcError) as rpc:
        stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="mlp2"), metadata=AUTH)
    assert rpc.value.code() == grpc.StatusCode.NOT_FOUND and "lora_name" in rpc.value.details()
    with pytest.raises(grpc.RpcError) as rpc:
        stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="x", lora_path=str(tmp_path / "none")))
    assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    wait_pool_whole(stub)
