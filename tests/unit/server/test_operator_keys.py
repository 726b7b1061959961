"""Operator keys: adapters are loaded and unloaded by operator keys only (HTTP 403 / gRPC PERMISSION_DENIED
naming the action for a tenant key), from under the --lora-root directories only (one message for every
refused path), for every tenant or for one; an adapter in use is not unloaded; every operator action is
audited once and every refused one counted. The service is the real one, over an engine that keeps its
adapters in a dict (AsyncEngine's adapter surface)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Optional

import grpc
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from sidecar.config import SidecarConfig
from sidecar.engine.request import SamplingParams
from sidecar.server.admin import NO_ROOTS, REFUSED_PATH, LoraRoots
from sidecar.server.openai.api import HttpSettings, create_app
from sidecar.server.security import load_api_keys
from sidecar.server.service import Caller, GenerationRequest, InferenceService, ServiceError
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg
from test_service import Limiter, ScriptedEngine

ADMIN, KEY_A, KEY_B = "admin-secret", "key-a-secret", "key-b-secret"


class AdapterEngine(ScriptedEngine):
    """ScriptedEngine with AsyncEngine's adapter calls; ``support`` is loaded at start-up."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loras = {"support": "/startup/support"}
        self.used: list[Optional[str]] = []

    def lora_adapters(self) -> dict[str, str]:
        return dict(self.loras)

    async def load_lora(self, name: str, path: str) -> None:
        if name in self.loras:
            raise ValueError(f"lora_name: adapter {name!r} is already loaded (unload it first)")
        self.loras[name] = path

    async def unload_lora(self, name: str) -> None:
        if self.loras.pop(name, None) is None:
            raise LookupError(f"lora_name: adapter {name!r} is not loaded")

    async def generate(self, prompt, params, **kwargs):
        self.used.append(kwargs.get("lora"))
        async for out in super().generate(prompt, params, **kwargs):
            yield out


@pytest.fixture
def roots(tmp_path):
    """An allowed root holding adapter directories, and a directory outside it."""
    root, outside = tmp_path / "adapters", tmp_path / "outside"
    (root / "mlp").mkdir(parents=True)
    outside.mkdir()
    return root, outside


def make_service(root, keys: bool = True, script: Optional[list[int]] = None) -> InferenceService:
    cfg = SidecarConfig()
    if keys:
        cfg.server.api_keys = [f"{KEY_A}:tenant-a", f"{KEY_B}:tenant-b"]
        cfg.server.admin_keys = [f"{ADMIN}:ops"]
    cfg.server.lora_roots = [str(root)] if root is not None else []
    svc = InferenceService(cfg)
    svc.limiter = Limiter()
    svc.attach(AdapterEngine(script or [4, 5]))  # type: ignore[arg-type]
    return svc


def who(svc: InferenceService, key: Optional[str]) -> Caller:
    return svc.authenticate(f"Bearer {key}" if key else None)


async def run(svc: InferenceService, caller: Caller, model: str) -> str:
    agen = svc.generate(
        caller, GenerationRequest(prompt="hi", params=SamplingParams(max_tokens=2), model=model)
    )
    try:
        return [ev async for ev in agen][-1].finish_reason
    finally:
        await agen.aclose()


def refused_total(svc: InferenceService) -> dict[tuple[str, str], float]:
    out = {}
    for metric in svc.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "sidecar_operator_actions_refused_total":
                out[(s.labels["action"], s.labels["reason"])] = s.value
    return out


# -- keys and roles -------------------------------------------------------------------------------------


def test_admin_keys_come_from_flags_and_file_and_carry_the_operator_role(tmp_path):
    f = tmp_path / "admins"
    f.write_text("# operators\nfile-admin\n")
    keys = load_api_keys(["t1:tenant"], None, ["a1:ops"], str(f))
    assert (keys["t1"].operator, keys["a1"].operator, keys["file-admin"].operator) == (False, True, True)
    assert keys["a1"].tenant == "ops" and keys["file-admin"].tenant == keys["file-admin"].key_id
    with pytest.raises(ValueError, match=r"^admin_keys: key key-\w+ is also listed as a tenant key"):
        load_api_keys(["same:t"], None, ["same:t"])
    f.write_text("ok\n:broken\n")
    with pytest.raises(ValueError, match=r"^admin_keys_file:2: "):
        load_api_keys([], None, [], str(f))
    with pytest.raises(ValueError, match=r"^admin_keys_file: cannot read"):
        load_api_keys([], None, [], str(tmp_path / "none"))


def test_flags_and_env_name_admin_keys_and_lora_roots(tmp_path):
    import argparse

    from sidecar.server.flags import add_config_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_config_arguments(p)
    args = p.parse_args(
        ["--admin-key", "a", "--admin-key", "b:ops", "--admin-keys-file", "/k", "--lora-root", "/x"]
        + ["--lora-root", "/y"]
    )
    s = config_from_args(args, env={}).server
    assert (s.admin_keys, s.admin_keys_file, s.lora_roots) == (["a", "b:ops"], "/k", ["/x", "/y"])
    env = {"SIDECAR_SERVER_ADMIN_KEYS": "e1,e2:ops", "SIDECAR_SERVER_LORA_ROOTS": "/r1,/r2"}
    s = config_from_args(p.parse_args([]), env=env).server
    assert (s.admin_keys, s.lora_roots) == (["e1", "e2:ops"], ["/r1", "/r2"])
    assert not s.serves_docs  # only admin keys configured: the API's shape is not public either


def test_only_admin_keys_still_require_a_key(roots):
    cfg = SidecarConfig()
    cfg.server.admin_keys = [ADMIN]
    svc = InferenceService(cfg)
    with pytest.raises(ServiceError) as err:
        svc.authenticate(None)
    assert err.value.code == "unauthenticated"
    assert svc.authenticate(f"Bearer {ADMIN}").operator


# -- adapter sources ------------------------------------------------------------------------------------


def test_paths_outside_the_roots_get_one_message_that_reveals_nothing(roots, tmp_path):
    root, outside = roots
    (outside / "adapter").mkdir()
    (root / "link-out").symlink_to(outside / "adapter")
    (root / "mlp-linked-file").mkdir()
    (outside / "adapter_config.json").write_text("{}")
    (root / "mlp-linked-file" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    lr = LoraRoots([str(root)])
    for path in (
        "/etc",
        "/nonexistent/dir",
        str(outside / "adapter"),
        f"{root}/../outside/adapter",
        f"{root}/mlp/../../outside",
        str(root / "link-out"),
        str(root / "mlp-linked-file"),
        "relative/dir",
        f"{root}/mlp\x00",
    ):
        with pytest.raises(ServiceError) as err:
            lr.resolve(path)
        assert (err.value.code, err.value.field, err.value.message) == (
            "invalid_argument",
            "lora_path",
            REFUSED_PATH,
        )
    (root / "link-in").symlink_to(root / "mlp")
    assert lr.resolve(str(root / "link-in")) == os.path.realpath(root / "mlp")
    assert lr.resolve(f"{root}/x/../mlp") == os.path.realpath(root / "mlp")
    assert lr.resolve(str(root / "not-yet")) == os.path.realpath(
        root / "not-yet"
    )  # the engine says it is missing
    with pytest.raises(ServiceError) as err:
        LoraRoots([]).resolve(str(root / "mlp"))
    assert err.value.message == NO_ROOTS and "--lora-root" in NO_ROOTS
    with pytest.raises(ValueError, match="^lora_roots: .* is not a directory"):
        LoraRoots([str(tmp_path / "missing")])


def test_a_refused_path_never_reaches_the_engine_and_is_counted(roots):
    root, outside = roots
    svc = make_service(root)
    admin = who(svc, ADMIN)
    for path in ("/etc", str(outside)):
        with pytest.raises(ServiceError) as err:
            asyncio.run(svc.load_lora(admin, "x", path))
        assert err.value.message == REFUSED_PATH
    assert "x" not in svc.engine.lora_adapters()
    assert refused_total(svc) == {("load_lora_adapter", "lora_root"): 2.0}
    no_roots = make_service(None)
    with pytest.raises(ServiceError) as err:
        asyncio.run(no_roots.load_lora(who(no_roots, ADMIN), "x", str(root / "mlp")))
    assert err.value.message == NO_ROOTS
    asyncio.run(svc.load_lora(admin, "mlp", str(root / "mlp")))
    assert svc.engine.lora_adapters()["mlp"] == os.path.realpath(
        root / "mlp"
    )  # the engine reads the resolved path


# -- roles on the service -------------------------------------------------------------------------------


def test_tenant_keys_are_refused_every_operator_action_naming_it_and_counted(roots, caplog):
    root, _ = roots
    svc = make_service(root)
    caplog.set_level(logging.INFO, logger="sidecar.audit")
    tenant = who(svc, KEY_B)
    calls = {
        "load_lora_adapter": lambda: svc.load_lora(tenant, "mine", str(root / "mlp")),
        "unload_lora_adapter": lambda: svc.unload_lora(tenant, "support"),
    }
    for action, call in calls.items():
        with pytest.raises(ServiceError) as err:
            asyncio.run(call())
        assert err.value.code == "permission_denied" and action in err.value.message
    assert svc.engine.lora_adapters() == {"support": "/startup/support"}  # the start-up adapter stays
    assert asyncio.run(run(svc, who(svc, KEY_A), "support")) == "length"
    assert refused_total(svc) == {
        ("load_lora_adapter", "permission"): 1.0,
        ("unload_lora_adapter", "permission"): 1.0,
    }
    lines = [r for r in caplog.records if r.name == "sidecar.audit"]
    assert [(r.action, r.result, r.role, r.tenant) for r in lines] == [
        ("load_lora_adapter", "permission_denied", "tenant", "tenant-b"),
        ("unload_lora_adapter", "permission_denied", "tenant", "tenant-b"),
    ]
    assert all(r.key_id == tenant.key_id and KEY_B not in caplog.text for r in lines)


def test_operator_actions_are_audited_once_with_their_result(roots, caplog):
    root, _ = roots
    svc = make_service(root)
    caplog.set_level(logging.INFO, logger="sidecar.audit")
    admin = who(svc, ADMIN)
    asyncio.run(svc.load_lora(admin, "mlp", str(root / "mlp")))
    with pytest.raises(ServiceError):
        asyncio.run(svc.load_lora(admin, "mlp", str(root / "mlp")))
    asyncio.run(svc.unload_lora(admin, "mlp"))
    with pytest.raises(ServiceError):
        asyncio.run(svc.unload_lora(admin, "mlp"))
    lines = [r for r in caplog.records if r.name == "sidecar.audit"]
    assert [(r.action, r.result, r.lora_name) for r in lines] == [
        ("load_lora_adapter", "ok", "mlp"),
        ("load_lora_adapter", "invalid_argument", "mlp"),
        ("unload_lora_adapter", "ok", "mlp"),
        ("unload_lora_adapter", "not_found", "mlp"),
    ]
    assert {(r.key_id, r.role, r.tenant) for r in lines} == {(admin.key_id, "operator", "ops")}
    assert ADMIN not in caplog.text and refused_total(svc) == {}


def test_without_keys_every_caller_may_run_operator_actions(roots):
    root, _ = roots
    svc = make_service(root, keys=False)
    anyone = who(svc, None)
    asyncio.run(svc.load_lora(anyone, "mlp", str(root / "mlp")))
    assert asyncio.run(run(svc, anyone, "mlp")) == "length"
    with pytest.raises(ServiceError) as err:  # no keys, no tenants to scope an adapter to
        asyncio.run(svc.load_lora(anyone, "t", str(root / "mlp"), tenant="tenant-a"))
    assert (err.value.code, err.value.field) == ("invalid_argument", "tenant")
    asyncio.run(svc.unload_lora(anyone, "mlp"))


# -- tenant-scoped adapters -----------------------------------------------------------------------------


def test_a_tenant_scoped_adapter_is_seen_and_used_by_its_tenant_alone(roots):
    root, _ = roots
    svc = make_service(root)
    admin, a, b = who(svc, ADMIN), who(svc, KEY_A), who(svc, KEY_B)
    asyncio.run(svc.load_lora(admin, "a-only", str(root / "mlp"), tenant="tenant-a"))
    assert set(svc.model_info(a)["lora_adapters"]) == {"support", "a-only"}
    assert set(svc.model_info(b)["lora_adapters"]) == {"support"}
    assert set(svc.model_info(admin)["lora_adapters"]) == {"support"}
    assert set(svc.model_info()["lora_adapters"]) == {"support"}
    assert asyncio.run(run(svc, a, "a-only")) == "length"
    messages = {}
    for name in ("a-only", "never-loaded"):
        with pytest.raises(ServiceError) as err:
            asyncio.run(run(svc, b, name))
        assert (err.value.code, err.value.field) == ("not_found", "model")
        messages[name] = err.value.message.replace(repr(name), "NAME")
    assert messages["a-only"] == messages["never-loaded"]  # the same answer as for a name never loaded
    assert "a-only" not in messages["a-only"]
    assert svc.engine.used == ["a-only"]
    with pytest.raises(ServiceError) as err:
        asyncio.run(svc.load_lora(admin, "z", str(root / "mlp"), tenant="nobody"))
    assert (err.value.code, err.value.field) == ("invalid_argument", "tenant")
    asyncio.run(svc.unload_lora(admin, "a-only"))
    asyncio.run(svc.load_lora(admin, "a-only", str(root / "mlp")))  # the name again, global now
    assert "a-only" in svc.model_info(b)["lora_adapters"]


def test_an_adapter_in_use_is_not_unloaded_until_its_requests_end(roots):
    root, _ = roots
    svc = make_service(root, script=[4, 5, 6])
    admin, a = who(svc, ADMIN), who(svc, KEY_A)

    async def scenario() -> None:
        agen = svc.generate(
            a, GenerationRequest(prompt="hi", params=SamplingParams(max_tokens=3), model="support")
        )
        first = await agen.__anext__()
        assert not first.finished
        with pytest.raises(ServiceError) as err:
            await svc.unload_lora(admin, "support")
        assert (err.value.code, err.value.field) == ("failed_precondition", "lora_name")
        assert "in use by 1 running request" in err.value.message
        assert "support" in svc.engine.lora_adapters()
        rest = [ev async for ev in agen]
        assert rest[-1].finished
        await svc.unload_lora(admin, "support")
        assert "support" not in svc.engine.lora_adapters()

    asyncio.run(scenario())
    assert svc.adapters.users == {}


# -- transports -----------------------------------------------------------------------------------------


def test_http_tenant_keys_get_403_naming_the_action_before_the_body_is_read(roots):
    root, _ = roots
    svc = make_service(root)
    c = TestClient(create_app(svc, settings=HttpSettings(metrics=svc.metrics)))
    tenant, admin = {"authorization": f"Bearer {KEY_A}"}, {"authorization": f"Bearer {ADMIN}"}
    for route, body in (
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "mlp")}),
        ("/v1/unload_lora_adapter", {"lora_name": "support"}),
        ("/v1/load_lora_adapter", {"not": "a valid body"}),
    ):
        r = c.post(route, json=body, headers=tenant)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("permission_error", "permission_denied")
        assert route.removeprefix("/v1/") in err["message"]
    r = c.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "a-only", "lora_path": str(root / "mlp"), "tenant": "tenant-a"},
        headers=admin,
    )
    assert r.status_code == 200, r.text
    ids = {
        k: {m["id"] for m in c.get("/v1/models", headers=h).json()["data"]}
        for k, h in (("a", tenant), ("ops", admin))
    }
    assert "a-only" in ids["a"] and "a-only" not in ids["ops"]
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "/etc"}, headers=admin)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": REFUSED_PATH,
        "type": "invalid_request_error",
        "param": "lora_path",
        "code": "invalid_value",
    }
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "support"}, headers=admin).status_code == 200
    text = generate_latest(svc.metrics.registry).decode()
    assert (
        'sidecar_operator_actions_refused_total{action="load_lora_adapter",reason="permission"} 2.0' in text
    )
    assert (
        'sidecar_operator_actions_refused_total{action="unload_lora_adapter",reason="permission"} 1.0' in text
    )
    assert 'sidecar_operator_actions_refused_total{action="load_lora_adapter",reason="lora_root"} 1.0' in text


def test_grpc_tenant_keys_get_permission_denied_naming_the_action(roots):
    from sidecar.server.grpc.servicer import Health, build_server

    root, _ = roots
    svc = make_service(root)

    async def scenario() -> None:
        server = build_server(svc, Health(), 1 << 20, 16)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pbg.InferenceStub(ch)
                tenant = (("authorization", f"Bearer {KEY_B}"),)
                admin = (("authorization", f"Bearer {ADMIN}"),)
                load = pb.LoadLoraAdapterRequest(
                    lora_name="b-only", lora_path=str(root / "mlp"), tenant="tenant-b"
                )
                for call, req, action in (
                    (stub.LoadLoraAdapter, load, "load_lora_adapter"),
                    (
                        stub.UnloadLoraAdapter,
                        pb.UnloadLoraAdapterRequest(lora_name="support"),
                        "unload_lora_adapter",
                    ),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(req, metadata=tenant)
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert action in err.value.details()
                assert (await stub.LoadLoraAdapter(load, metadata=admin)).status == "loaded"
                names = {
                    key: [
                        x.name
                        for x in (
                            await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md)
                        ).lora_adapters
                    ]
                    for key, md in (("b", tenant), ("ops", admin))
                }
                assert names == {"b": ["b-only", "support"], "ops": ["support"]}
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_an_operator_action_whose_caller_left_is_audited_as_cancelled(roots, caplog):
    root, _ = roots
    svc = make_service(root)
    caplog.set_level(logging.INFO, logger="sidecar.audit")
    started = []

    async def never(name: str, path: str) -> None:
        started.append(name)
        await asyncio.Event().wait()

    svc.engine.load_lora = never

    async def scenario() -> None:
        task = asyncio.ensure_future(svc.load_lora(who(svc, ADMIN), "slow", str(root / "mlp")))
        while not started:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert [(r.action, r.result) for r in caplog.records if r.name == "sidecar.audit"] == [
        ("load_lora_adapter", "cancelled")
    ]
