"""``sidecar serve`` flags: one flag per config field, merged into one validated tree.

Precedence: flags > env ``SIDECAR_<SECTION>_<NAME>`` > ``--config`` YAML > defaults.
Flags default to "not given" (argparse.SUPPRESS) so only what the user typed
overrides the lower layers; the help text shows the built-in default instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Optional

from sidecar.config import CacheConfig, EngineConfig, ServerConfig, SidecarConfig, help_text, load_config

# (flag, section, field); the help text is the field's own (config.setting). Values are parsed by
# load_config, so a bad value is reported with the config field's name, the same way as for env and YAML.
FLAGS: list[tuple[str, str, str]] = [
    ("--model", "engine", "model"),
    ("--dtype", "engine", "dtype"),
    ("--quantization", "engine", "quantization"),
    ("--quant-group-size", "engine", "quant_group_size"),
    ("--quantize-lm-head", "engine", "quantize_lm_head"),
    ("--block-size", "engine", "block_size"),
    ("--kv-cache-memory-gb", "engine", "kv_cache_memory_gb"),
    ("--kv-cache-memory-fraction", "engine", "kv_cache_memory_fraction"),
    ("--num-kv-blocks", "engine", "num_kv_blocks"),
    ("--kv-cache-commit", "engine", "kv_cache_commit"),
    ("--max-num-seqs", "engine", "max_num_seqs"),
    ("--max-num-batched-tokens", "engine", "max_num_batched_tokens"),
    ("--max-model-len", "engine", "max_model_len"),
    ("--max-waiting-requests", "engine", "max_waiting_requests"),
    ("--seed", "engine", "seed"),
    ("--device", "engine", "device"),
    ("--num-threads", "engine", "num_threads"),
    ("--revision", "engine", "revision"),
    ("--speculative", "engine", "speculative"),
    ("--num-speculative-tokens", "engine", "num_speculative_tokens"),
    ("--speculative-max-batch", "engine", "speculative_max_batch"),
    ("--speculative-token-cost", "engine", "speculative_token_cost"),
    ("--speculative-draft-quantization", "engine", "speculative_draft_quantization"),
    ("--kv-cache-dtype", "engine", "kv_cache_dtype"),
    ("--kv-offload-gb", "engine", "kv_offload_gb"),
    ("--kv-offload-dir", "engine", "kv_offload_dir"),
    ("--kv-offload-disk-gb", "engine", "kv_offload_disk_gb"),
    ("--kv-budget", "engine", "kv_budget"),
    ("--kv-eviction", "engine", "kv_eviction"),
    ("--demo-dir", "engine", "demo_dir"),
    ("--max-loras", "engine", "max_loras"),
    ("--max-lora-rank", "engine", "max_lora_rank"),
    ("--overlap-steps", "engine", "overlap_steps"),
    ("--tensor-parallel-size", "engine", "tensor_parallel_size"),
    ("--pipeline-parallel-size", "engine", "pipeline_parallel_size"),
    ("--pipeline-micro-batches", "engine", "pipeline_micro_batches"),
    ("--nnodes", "engine", "nnodes"),
    ("--node-rank", "engine", "node_rank"),
    ("--master-addr", "engine", "master_addr"),
    ("--master-port", "engine", "master_port"),
    ("--host", "server", "host"),
    ("--grpc-port", "server", "grpc_port"),
    ("--http-port", "server", "http_port"),
    ("--port-file", "server", "port_file"),
    ("--api-keys-file", "server", "api_keys_file"),
    ("--admin-keys-file", "server", "admin_keys_file"),
    ("--rate-limit-rps", "server", "rate_limit_rps"),
    ("--rate-limit-burst", "server", "rate_limit_burst"),
    ("--rate-limit-tpm", "server", "rate_limit_tpm"),
    ("--max-message-bytes", "server", "max_message_bytes"),
    ("--max-prompt-chars", "server", "max_prompt_chars"),
    ("--max-concurrent-streams", "server", "max_concurrent_streams"),
    ("--max-connection-age", "server", "max_connection_age_s"),
    ("--max-connection-age-grace", "server", "max_connection_age_grace_s"),
    ("--http-read-timeout", "server", "http_read_timeout_s"),
    ("--auth-failures-per-min", "server", "auth_failures_per_min"),
    ("--http-docs", "server", "http_docs"),
    ("--shutdown-timeout", "server", "shutdown_timeout_s"),
    ("--responses-max-entries", "server", "responses_max_entries"),
    ("--responses-max-bytes", "server", "responses_max_bytes"),
    ("--responses-ttl", "server", "responses_ttl_s"),
    ("--log-level", "server", "log_level"),
    ("--served-model-name", "server", "served_model_name"),
    ("--cache-threshold", "cache", "threshold"),
    ("--cache-max-entries", "cache", "max_entries"),
    ("--cache-ttl", "cache", "ttl_s"),
    ("--cache-path", "cache", "path"),
    ("--cache-backend", "cache", "backend"),
    ("--embedding-model", "cache", "embedding_model"),
    ("--cache-hnsw-min-entries", "cache", "hnsw_min_entries"),
]
# (flag, section, field, value stored when given, help)
SWITCHES: list[tuple[str, str, str, bool, str]] = [
    ("--no-prefix-caching", "engine", "enable_prefix_caching", False, "disable KV prefix caching"),
    (
        "--enable-lora",
        "engine",
        "enable_lora",
        True,
        "accept LoRA adapters loaded at run time (POST /v1/load_lora_adapter) even when no --lora is given",
    ),
    (
        "--enforce-eager",
        "engine",
        "enforce_eager",
        True,
        "run the eager torch reference on the device: no CUDA graphs, no custom GPU kernels",
    ),
    ("--log-json", "server", "log_json", True, "log one JSON object per line"),
    ("--no-ui", "server", "ui", False, "do not serve the built-in page at GET / (it answers 404 then)"),
    ("--no-semantic-cache", "cache", "enabled", False, "disable the semantic cache"),
    (
        "--cache-allow-sampled",
        "cache",
        "allow_sampled",
        True,
        "cache answers of sampled (temperature > 0) requests",
    ),
    ("--no-cache-guard", "cache", "guard", False, "serve semantic hits even when numbers/negations differ"),
]
_SECTIONS = {"engine": EngineConfig, "cache": CacheConfig, "server": ServerConfig}


def _default(section: str, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(_SECTIONS[section])}[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _dest(section: str, name: str) -> str:
    return f"cfg__{section}__{name}"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="YAML",
        default=argparse.SUPPRESS,
        help="YAML file with engine/cache/server sections (flags and SIDECAR_* env override it)",
    )
    groups = {
        s: parser.add_argument_group(f"{s} settings (env SIDECAR_{s.upper()}_<NAME>)") for s in _SECTIONS
    }
    for flag, section, name in FLAGS:
        default = _default(section, name)
        shown = "" if default is None else f" [default: {default}]"  # None defaults are explained in the text
        groups[section].add_argument(
            flag,
            dest=_dest(section, name),
            default=argparse.SUPPRESS,
            metavar="V",
            help=help_text(_SECTIONS[section], name) + shown,
        )
    groups["server"].add_argument(
        "--api-key",
        dest=_dest("server", "api_keys"),
        action="append",
        default=argparse.SUPPRESS,
        metavar="KEY[:TENANT]",
        help="accept this API key (repeatable); the tenant isolates caches [default: no keys, auth off]",
    )
    groups["server"].add_argument(
        "--admin-key",
        dest=_dest("server", "admin_keys"),
        action="append",
        default=argparse.SUPPRESS,
        metavar="KEY[:TENANT]",
        help="accept this operator key (repeatable): it may also load and unload adapters [default: none]",
    )
    groups["server"].add_argument(
        "--lora-root",
        dest=_dest("server", "lora_roots"),
        action="append",
        default=argparse.SUPPRESS,
        metavar="DIR",
        help="adapters loaded at run time must lie under DIR (repeatable) [default: none, run-time "
        "loading off]",
    )
    groups["engine"].add_argument(
        "--lora",
        dest=_dest("engine", "lora_modules"),
        action="append",
        default=argparse.SUPPRESS,
        metavar="NAME=PATH",
        help=help_text(EngineConfig, "lora_modules"),
    )
    for flag, section, name, value, switch_help in SWITCHES:
        groups[section].add_argument(
            flag,
            dest=_dest(section, name),
            action="store_const",
            const=value,
            default=argparse.SUPPRESS,
            help=switch_help,
        )


def config_from_args(args: argparse.Namespace, env: Optional[dict[str, str]] = None) -> SidecarConfig:
    """The validated config tree; raises ValueError naming the offending setting."""
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if key.startswith("cfg__"):
            _, section, name = key.split("__", 2)
            overrides.setdefault(section, {})[name] = value
    path = getattr(args, "config", None)
    if path and not os.path.isfile(path):
        raise ValueError(f"config: no such file {path!r}")
    return load_config(path, env=env, overrides=overrides)
