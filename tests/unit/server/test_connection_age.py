"""gRPC max connection age: config fields, `sidecar serve` flags and the server options they become."""

import argparse

import grpc
import pytest

from sidecar.config import ServerConfig
from sidecar.server.flags import add_config_arguments, config_from_args


def parse(*argv):
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_close_connections_after_five_minutes_with_a_grace():
    s = ServerConfig()
    assert (s.max_connection_age_s, s.max_connection_age_grace_s) == (300.0, 120.0)


def test_flags_and_env_set_the_fields():
    cfg = config_from_args(parse("--max-connection-age", "1", "--max-connection-age-grace", "0.5"), env={})
    assert (cfg.server.max_connection_age_s, cfg.server.max_connection_age_grace_s) == (1.0, 0.5)
    cfg = config_from_args(parse(), env={"SIDECAR_SERVER_MAX_CONNECTION_AGE_S": "0"})
    assert cfg.server.max_connection_age_s == 0.0


@pytest.mark.parametrize("field", ["max_connection_age_s", "max_connection_age_grace_s"])
def test_negative_values_are_rejected_naming_the_field(field):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: -1})


def test_server_options_carry_the_age_in_milliseconds(monkeypatch):
    from sidecar.server.grpc import servicer as grpc_service

    seen = {}

    def capture(*args, **kw):
        seen.update(dict(kw.get("options", [])))
        raise RuntimeError("captured")

    monkeypatch.setattr(grpc.aio, "server", capture)
    with pytest.raises(RuntimeError, match="captured"):
        grpc_service.build_server(None, None, 1 << 20, 16, 1.5, 0.25)
    assert seen["grpc.max_connection_age_ms"] == 1500
    assert seen["grpc.max_connection_age_grace_ms"] == 250

    seen.clear()
    with pytest.raises(RuntimeError, match="captured"):
        grpc_service.build_server(None, None, 1 << 20, 16, 0.0, 120.0)
    assert "grpc.max_connection_age_ms" not in seen
