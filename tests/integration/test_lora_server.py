"""LoRA adapters through a real ``sidecar serve`` (tiny Llama checkpoint, CPU): a request's ``model`` picks
the adapter on the OpenAI API and on gRPC, adapters are listed with their base, loaded and unloaded at run
time by operator keys only and from under --lora-root only, for every tenant or for one, and unknown or
malformed ones are refused naming the field. Operator actions are audited and refusals counted."""

from __future__ import annotations

import re
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

KEY = "lora-key"  # tenant-a
KEY_B = "lora-key-b"  # tenant-b
ADMIN = "lora-admin"
PROMPT = "the cat sat on the"
MAX_NEW = 8


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-srv")


@pytest.fixture(scope="module")
def adapters(tiny_models, lora_root):
    root = lora_root
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
def server(sidecar_launcher, tiny_models, adapters, lora_root):
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
        f"{KEY}:tenant-a",
        "--api-key",
        f"{KEY_B}:tenant-b",
        "--admin-key",
        ADMIN,
        "--lora-root",
        str(lora_root),
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
AUTH_B = (("authorization", f"Bearer {KEY_B}"),)
ADMIN_AUTH = (("authorization", f"Bearer {ADMIN}"),)


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


def test_load_and_unload_at_run_time(server, client, stub, adapters, expected, lora_root):
    url = server.http_base
    body = {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401  # no key
    auth = {"authorization": f"Bearer {ADMIN}"}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert complete(client, "mlp") == expected["mlp"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    bad = lora_root / "bad"
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
        pb.LoadLoraAdapterRequest(lora_name="mlp2", lora_path=str(adapters["mlp"])), metadata=ADMIN_AUTH
    )
    assert complete(client, "mlp2") == expected["mlp"]
    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="mlp2"), metadata=ADMIN_AUTH)
    with pytest.raises(grpc.RpcError) as rpc:
        stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="mlp2"), metadata=ADMIN_AUTH)
    assert rpc.value.code() == grpc.StatusCode.NOT_FOUND and "lora_name" in rpc.value.details()
    with pytest.raises(grpc.RpcError) as rpc:
        stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="x", lora_path=str(lora_root / "none")))
    assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    wait_pool_whole(stub)


def test_tenant_keys_are_refused_every_operator_action_and_startup_adapters_survive(
    server, client, stub, adapters, expected
):
    url = server.http_base
    for key in (KEY, KEY_B):
        auth = {"authorization": f"Bearer {key}"}
        for route, body in (
            ("load_lora_adapter", {"lora_name": "mine", "lora_path": str(adapters["mlp"])}),
            ("unload_lora_adapter", {"lora_name": "support"}),
        ):
            r = httpx.post(f"{url}/v1/{route}", json=body, headers=auth)
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert err["code"] == "permission_denied" and route in err["message"]
        md = (("authorization", f"Bearer {key}"),)
        for call, req, action in (
            (
                stub.LoadLoraAdapter,
                pb.LoadLoraAdapterRequest(lora_name="mine", lora_path=str(adapters["mlp"])),
                "load_lora_adapter",
            ),
            (stub.UnloadLoraAdapter, pb.UnloadLoraAdapterRequest(lora_name="support"), "unload_lora_adapter"),
        ):
            with pytest.raises(grpc.RpcError) as rpc:
                call(req, metadata=md)
            assert rpc.value.code() == grpc.StatusCode.PERMISSION_DENIED and action in rpc.value.details()
    assert complete(client, "support") == expected["support"]
    assert "mine" not in {m.id for m in client.models.list().data}


def test_paths_outside_the_root_are_refused_with_one_message(server, stub, adapters, lora_root, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(adapters["mlp"], copy)  # a real adapter, outside the root
    link = lora_root / "link-out"
    link.symlink_to(copy)
    auth = {"authorization": f"Bearer {ADMIN}"}
    messages = set()
    for path in ("/etc", "/nonexistent/dir", str(copy), f"{lora_root}/../{copy.parent.name}/copy", str(link)):
        r = httpx.post(
            f"{server.http_base}/v1/load_lora_adapter",
            json={"lora_name": "x", "lora_path": path},
            headers=auth,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        messages.add(r.json()["error"]["message"])
        with pytest.raises(grpc.RpcError) as rpc:
            stub.LoadLoraAdapter(
                pb.LoadLoraAdapterRequest(lora_name="x", lora_path=path), metadata=ADMIN_AUTH
            )
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        messages.add(rpc.value.details())
    assert len(messages) == 1, messages
    (message,) = messages
    assert message.startswith("lora_path:") and "--lora-root" in message
    assert "etc" not in message and "not found" not in message
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=ADMIN_AUTH).lora_adapters[0].name == "support"


def test_a_tenant_scoped_adapter_serves_its_tenant_alone(server, client, stub, adapters, expected):
    stub.LoadLoraAdapter(
        pb.LoadLoraAdapterRequest(lora_name="mlp-a", lora_path=str(adapters["mlp"]), tenant="tenant-a"),
        metadata=ADMIN_AUTH,
    )
    client_b = OpenAI(base_url=f"{server.http_base}/v1", api_key=KEY_B, max_retries=0, timeout=120)
    assert "mlp-a" in {m.id for m in client.models.list().data}
    assert "mlp-a" not in {m.id for m in client_b.models.list().data}
    names = {
        k: [a.name for a in stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md).lora_adapters]
        for k, md in (("a", AUTH), ("b", AUTH_B))
    }
    assert names == {"a": ["mlp-a", "support"], "b": ["support"]}
    assert complete(client, "mlp-a") == expected["mlp"]
    errors = []
    for name in ("mlp-a", "never-loaded"):
        with pytest.raises(openai.NotFoundError) as err:
            complete(client_b, name)
        errors.append(err.value.body["message"].replace(repr(name), "NAME"))
        with pytest.raises(grpc.RpcError) as rpc:
            stub.Generate(pb.GenerateRequest(prompt=PROMPT, model=name), metadata=AUTH_B)
        assert rpc.value.code() == grpc.StatusCode.NOT_FOUND
        errors.append(rpc.value.details().replace(repr(name), "NAME"))
    assert errors[0] == errors[2] and errors[1] == errors[3]  # the same answers as for a name never loaded
    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="mlp-a"), metadata=ADMIN_AUTH)
    wait_pool_whole(stub)


def refused(server, action: str, reason: str) -> float:
    text = httpx.get(f"{server.http_base}/metrics").text
    prefix = f'sidecar_operator_actions_refused_total{{action="{action}",reason="{reason}"}} '
    return next((float(ln[len(prefix) :]) for ln in text.splitlines() if ln.startswith(prefix)), 0.0)


def test_operator_actions_are_audited_once_and_refusals_counted(server, adapters):
    import hashlib

    def audit_lines() -> list[str]:
        return [ln for ln in server.log().splitlines() if "sidecar.audit: operator action" in ln]

    before = len(audit_lines())
    counts = {r: refused(server, "load_lora_adapter", r) for r in ("permission", "lora_root")}
    body = {"lora_name": "audited", "lora_path": str(adapters["mlp"])}
    url = f"{server.http_base}/v1"
    assert (
        httpx.post(
            f"{url}/load_lora_adapter", json=body, headers={"authorization": f"Bearer {KEY_B}"}
        ).status_code
        == 403
    )
    admin = {"authorization": f"Bearer {ADMIN}"}
    assert httpx.post(f"{url}/load_lora_adapter", json=body, headers=admin).status_code == 200
    assert (
        httpx.post(f"{url}/load_lora_adapter", json={**body, "lora_path": "/etc"}, headers=admin).status_code
        == 400
    )
    assert (
        httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "audited"}, headers=admin).status_code
        == 200
    )
    end = time.monotonic() + 10
    while len(audit_lines()) < before + 4 and time.monotonic() < end:
        time.sleep(0.05)  # the log reaches the file through the child's stderr
    lines = audit_lines()[before:]
    admin_id = "key-" + hashlib.sha256(ADMIN.encode()).hexdigest()[:12]
    b_id = "key-" + hashlib.sha256(KEY_B.encode()).hexdigest()[:12]
    heads = [re.search(r"key_id=.* result=\S+", ln).group(0) for ln in lines]
    assert heads == [
        f"key_id={b_id} role=tenant tenant=tenant-b action=load_lora_adapter result=permission_denied",
        f"key_id={admin_id} role=operator tenant={admin_id} action=load_lora_adapter result=ok",
        f"key_id={admin_id} role=operator tenant={admin_id} action=load_lora_adapter result=invalid_argument",
        f"key_id={admin_id} role=operator tenant={admin_id} action=unload_lora_adapter result=ok",
    ]
    assert all(key not in server.log() for key in (KEY_B, ADMIN))
    assert refused(server, "load_lora_adapter", "permission") == counts["permission"] + 1
    assert refused(server, "load_lora_adapter", "lora_root") == counts["lora_root"] + 1


def test_a_lora_root_alone_enables_run_time_adapters(
    sidecar_launcher, tiny_models, adapters, lora_root, expected
):
    """No --lora at start and no keys (open: every caller is an operator): --lora-root gives the engine its
    adapter slots, so an adapter from under the root loads and serves."""
    with sidecar_launcher(
        "--model",
        str(tiny_models["llama"]),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "32",
        "--lora-root",
        str(lora_root),
    ) as sc:
        url = sc.http_base
        r = httpx.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])}
        )
        assert r.status_code == 200, r.text
        c = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert complete(c, "mlp") == expected["mlp"]
        assert "result=ok" in sc.log() and "key_id=anonymous role=operator" in sc.log()
