"""`sidecar serve` configuration: flags > env > YAML > defaults, one validated tree, clear errors."""

import argparse
import dataclasses
import subprocess
import sys

import pytest

from sidecar.config import CacheConfig, EngineConfig, ServerConfig
from sidecar.server.flags import add_config_arguments, config_from_args


def parse(*argv):
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_without_flags_env_or_yaml():
    cfg = config_from_args(parse(), env={})
    assert cfg.engine == EngineConfig()
    assert cfg.cache == CacheConfig()
    assert cfg.server == ServerConfig()


def test_flags_map_to_fields_and_types():
    cfg = config_from_args(
        parse(
            "--model",
            "m",
            "--quantization",
            "int8",
            "--block-size",
            "32",
            "--num-kv-blocks",
            "64",
            "--no-prefix-caching",
            "--kv-cache-memory-gb",
            "1.5",
            "--grpc-port",
            "0",
            "--http-port",
            "-1",
            "--api-key",
            "a",
            "--api-key",
            "b:t",
            "--rate-limit-rps",
            "2.5",
            "--shutdown-timeout",
            "3",
            "--log-json",
            "--no-semantic-cache",
            "--cache-threshold",
            "0.9",
            "--cache-ttl",
            "60",
        ),
        env={},
    )
    e, s, c = cfg.engine, cfg.server, cfg.cache
    assert (e.model, e.quantization, e.block_size, e.num_kv_blocks) == ("m", "int8", 32, 64)
    assert e.enable_prefix_caching is False and e.kv_cache_memory_gb == 1.5
    assert (s.grpc_port, s.http_port, s.api_keys, s.rate_limit_rps) == (0, -1, ["a", "b:t"], 2.5)
    assert s.shutdown_timeout_s == 3.0 and s.log_json is True
    assert (c.enabled, c.threshold, c.ttl_s) == (False, 0.9, 60.0)
    assert config_from_args(parse("--quantization", "none"), env={}).engine.quantization is None


def test_precedence_flag_over_env_over_yaml(tmp_path):
    y = tmp_path / "sidecar.yaml"
    y.write_text(
        "engine:\n  block_size: 8\n  max_num_seqs: 7\n  seed: 3\nserver:\n  grpc_port: 1111\n"
        "cache:\n  max_entries: 5\n"
    )
    env = {"SIDECAR_ENGINE_MAX_NUM_SEQS": "9", "SIDECAR_ENGINE_SEED": "4", "SIDECAR_SERVER_API_KEYS": "x,y:t"}
    cfg = config_from_args(parse("--config", str(y), "--seed", "5"), env=env)
    assert cfg.engine.block_size == 8  # YAML only
    assert cfg.engine.max_num_seqs == 9  # env beats YAML
    assert cfg.engine.seed == 5  # flag beats env and YAML
    assert cfg.server.grpc_port == 1111 and cfg.cache.max_entries == 5
    assert cfg.server.api_keys == ["x", "y:t"]


@pytest.mark.parametrize(
    "argv, env, yaml_text, message",
    [
        (["--block-size", "7"], {}, None, "block_size: must be one of"),
        (["--block-size", "x"], {}, None, "engine.block_size: cannot parse 'x'"),
        (["--grpc-port", "70000"], {}, None, "grpc_port: must be in"),
        (["--cache-threshold", "1.5"], {}, None, "cache.threshold: must be in (0, 1]"),
        ([], {"SIDECAR_SERVER_RATE_LIMIT_RPS": "-1"}, None, "rate_limit_rps: must be >= 0"),
        ([], {"SIDECAR_ENGINE_BOGUS": "1"}, None, "engine.bogus: unknown setting"),
        ([], {}, "server:\n  nope: 1\n", "server.nope: unknown setting"),
        ([], {}, "other: {}\n", "other: unknown config section"),
        (["--log-level", "loud"], {}, None, "log_level: must be"),
    ],
)
def test_errors_name_the_field(tmp_path, argv, env, yaml_text, message):
    if yaml_text is not None:
        y = tmp_path / "c.yaml"
        y.write_text(yaml_text)
        argv = ["--config", str(y), *argv]
    with pytest.raises(ValueError) as exc:
        config_from_args(parse(*argv), env=env)
    assert message in str(exc.value)


def test_missing_config_file():
    with pytest.raises(ValueError, match="^config: no such file"):
        config_from_args(parse("--config", "/nonexistent.yaml"), env={})


def test_every_config_field_has_a_flag_in_help():
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    dests = {a.dest for a in p._actions}
    for section, cls in (("engine", EngineConfig), ("cache", CacheConfig), ("server", ServerConfig)):
        for f in dataclasses.fields(cls):
            assert f"cfg__{section}__{f.name}" in dests, f"no flag for {section}.{f.name}"


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--max-num-seqs", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["sidecar serve: error: max_num_seqs: must be >= 1, got 0"]
    keys = tmp_path / "keys"
    keys.write_text(":x\n")
    r = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--api-keys-file", str(keys)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.startswith("sidecar serve: error: api_keys_file:1:")


@pytest.mark.parametrize("flag", ["--grpc-port", "--http-port"])
def test_port_in_use_is_a_one_line_error(flag):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        args = {"--grpc-port": "0", "--http-port": "-1", flag: port}
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "sidecar",
                "serve",
                "--host",
                "127.0.0.1",
                "--no-semantic-cache",
                *[x for kv in args.items() for x in kv],
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 1
    name = flag[2:].replace("-", "_")
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith(f"sidecar serve: error: {name}: cannot bind 127.0.0.1:{port}")
    )
    assert "Traceback" not in r.stderr


def test_each_flag_shows_its_settings_own_help_text():
    from sidecar.config import help_text
    from sidecar.server.flags import FLAGS

    sections = {"engine": EngineConfig, "cache": CacheConfig, "server": ServerConfig}
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    shown = {a.option_strings[0]: a.help for a in p._actions if a.option_strings}
    for flag, section, name in FLAGS:
        text = help_text(sections[section], name)
        assert text, f"{section}.{name} has no help text"
        assert shown[flag].startswith(text), flag
    assert "KV block" in help_text(EngineConfig, "block_size")
