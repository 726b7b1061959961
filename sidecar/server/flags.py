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

from sidecar.config import CacheConfig, EngineConfig, ServerConfig, SidecarConfig, load_config

# (flag, section, field, help). Values are parsed by load_config, so a bad value
# is reported with the config field's name, the same way as for env and YAML.
FLAGS: list[tuple[str, str, str, str]] = [
    ("--model", "engine", "model", "model: SmolLM2-135M-Instruct (default), a .gguf file, a local Hugging "
                                   "Face directory, a hub id, or 'demo' (tiny random model)"),
    ("--dtype", "engine", "dtype", "weights/activations dtype: auto, float32, bfloat16, float16"),
    ("--quantization", "engine", "quantization", "weight-only quantization: none, int8, int4 (default: none)"),
    ("--quant-group-size", "engine", "quant_group_size", "int4 group size: 32, 64, 128, 256"),
    ("--quantize-lm-head", "engine", "quantize_lm_head", "also quantize the output projection (true/false)"),
    ("--block-size", "engine", "block_size", "tokens per KV block: 8, 16, 32, 64, 128"),
    ("--kv-cache-memory-gb", "engine", "kv_cache_memory_gb", "KV cache budget in GiB (default: a fraction of free memory)"),
    ("--kv-cache-memory-fraction", "engine", "kv_cache_memory_fraction",
     "fraction of free memory for the KV cache when no GiB budget is given"),
    ("--num-kv-blocks", "engine", "num_kv_blocks", "exact number of KV blocks (overrides the memory budget; default: from the budget)"),
    ("--max-num-seqs", "engine", "max_num_seqs", "most requests in the running batch"),
    ("--max-num-batched-tokens", "engine", "max_num_batched_tokens", "token budget per engine step"),
    ("--max-model-len", "engine", "max_model_len", "context length limit (default: the model's)"),
    ("--max-waiting-requests", "engine", "max_waiting_requests", "waiting queue bound; beyond it RESOURCE_EXHAUSTED"),
    ("--seed", "engine", "seed", "engine-wide random seed"),
    ("--device", "engine", "device", "auto, cpu, cuda or cuda:N"),
    ("--num-threads", "engine", "num_threads", "torch intra-op threads on CPU (default: torch's choice)"),
    ("--revision", "engine", "revision", "hub revision of the model (default: the main branch)"),
    ("--speculative", "engine", "speculative",
     "speculative decoding: none (default), ngram (prompt lookup) or draft:<model> (a smaller model sharing "
     "the target's tokenizer proposes)"),
    ("--num-speculative-tokens", "engine", "num_speculative_tokens",
     "most tokens proposed per request per step (adapts below it)"),
    ("--speculative-max-batch", "engine", "speculative_max_batch",
     "running-batch size from which a step does not speculate"),
    ("--speculative-token-cost", "engine", "speculative_token_cost",
     "extra step cost of one more proposed token (verifying it; with a draft model also proposing it), "
     "relative to a decode step (default: measured at start)"),
    ("--speculative-draft-quantization", "engine", "speculative_draft_quantization",
     "weight quantization of the draft model: none (default), int8 or int4"),
    ("--kv-cache-dtype", "engine", "kv_cache_dtype",
     "KV cache element type: auto (the compute dtype), int8 (per-token scales; about twice the tokens in the "
     "same memory), fp8 (e4m3 on CUDA sm89+, int8 elsewhere)"),
    ("--kv-offload-gb", "engine", "kv_offload_gb",
     "host RAM in GiB that keeps prefix blocks evicted from the KV pool for reuse; 0 = none"),
    ("--kv-offload-dir", "engine", "kv_offload_dir",
     "directory of the disk tier for evicted prefix blocks, kept across restarts (default: none)"),
    ("--kv-offload-disk-gb", "engine", "kv_offload_disk_gb", "most GiB the disk tier keeps in --kv-offload-dir"),
    ("--demo-dir", "engine", "demo_dir", "where the demo model is built/reused (default: the user cache dir)"),
    ("--host", "server", "host", "address both servers bind"),
    ("--grpc-port", "server", "grpc_port", "gRPC port; 0 picks a free port"),
    ("--http-port", "server", "http_port", "OpenAI HTTP port; 0 picks a free port, -1 disables HTTP"),
    ("--port-file", "server", "port_file", "write {grpc_port, http_port, pid} JSON here once listening (default: none)"),
    ("--api-keys-file", "server", "api_keys_file", "file with one 'key' or 'key:tenant' per line (default: none)"),
    ("--rate-limit-rps", "server", "rate_limit_rps", "per-key requests per second; 0 = unlimited"),
    ("--rate-limit-burst", "server", "rate_limit_burst", "per-key burst size; 0 = max(1, rps)"),
    ("--rate-limit-tpm", "server", "rate_limit_tpm", "per-key tokens (prompt + max_tokens) per minute; 0 = unlimited"),
    ("--max-message-bytes", "server", "max_message_bytes", "largest gRPC message accepted or sent"),
    ("--max-prompt-chars", "server", "max_prompt_chars", "largest prompt in characters"),
    ("--max-concurrent-streams", "server", "max_concurrent_streams", "HTTP/2 streams per gRPC connection"),
    ("--max-connection-age", "server", "max_connection_age_s",
     "seconds after which a gRPC connection is closed (GOAWAY) so clients re-resolve; 0 = never"),
    ("--max-connection-age-grace", "server", "max_connection_age_grace_s",
     "seconds calls in flight on an aged connection may take to finish"),
    ("--http-read-timeout", "server", "http_read_timeout_s",
     "seconds an HTTP client may take to send a request's headers or the next chunk of its body"),
    ("--auth-failures-per-min", "server", "auth_failures_per_min",
     "failed API-key checks per client address per minute before it is refused for a while; 0 = off"),
    ("--shutdown-timeout", "server", "shutdown_timeout_s", "seconds running requests may take to finish on SIGTERM"),
    ("--log-level", "server", "log_level", "debug, info, warning, error"),
    ("--served-model-name", "server", "served_model_name", "model name clients must use (default: --model)"),
    ("--cache-threshold", "cache", "threshold", "semantic cache cosine similarity threshold, (0, 1]"),
    ("--cache-max-entries", "cache", "max_entries", "semantic cache capacity (LRU beyond it)"),
    ("--cache-ttl", "cache", "ttl_s", "semantic cache entry lifetime in seconds"),
    ("--cache-path", "cache", "path", "SQLite file persisting the semantic cache (default: memory only)"),
    ("--embedding-model", "cache", "embedding_model", "sentence-transformers model for the cache and Embed"),
    ("--cache-hnsw-min-entries", "cache", "hnsw_min_entries", "entries from which the cache index is HNSW"),
]
# (flag, section, field, value stored when given, help)
SWITCHES: list[tuple[str, str, str, bool, str]] = [
    ("--no-prefix-caching", "engine", "enable_prefix_caching", False, "disable KV prefix caching"),
    ("--enforce-eager", "engine", "enforce_eager", True,
     "run the eager torch reference on the device: no CUDA graphs, no custom GPU kernels"),
    ("--log-json", "server", "log_json", True, "log one JSON object per line"),
    ("--no-semantic-cache", "cache", "enabled", False, "disable the semantic cache"),
    ("--cache-allow-sampled", "cache", "allow_sampled", True, "cache answers of sampled (temperature > 0) requests"),
    ("--no-cache-guard", "cache", "guard", False, "serve semantic hits even when numbers/negations differ"),
]
_SECTIONS = {"engine": EngineConfig, "cache": CacheConfig, "server": ServerConfig}


def _default(section: str, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(_SECTIONS[section])}[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _dest(section: str, name: str) -> str:
    return f"cfg__{section}__{name}"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="YAML", default=argparse.SUPPRESS,
                        help="YAML file with engine/cache/server sections (flags and SIDECAR_* env override it)")
    groups = {s: parser.add_argument_group(f"{s} settings (env SIDECAR_{s.upper()}_<NAME>)") for s in _SECTIONS}
    for flag, section, name, help_text in FLAGS:
        default = _default(section, name)
        shown = "" if default is None else f" [default: {default}]"  # None defaults are explained in the text
        groups[section].add_argument(flag, dest=_dest(section, name), default=argparse.SUPPRESS, metavar="V",
                                     help=help_text + shown)
    groups["server"].add_argument("--api-key", dest=_dest("server", "api_keys"), action="append",
                                  default=argparse.SUPPRESS, metavar="KEY[:TENANT]",
                                  help="accept this API key (repeatable); the tenant isolates caches "
                                       "[default: no keys, auth off]")
    for flag, section, name, value, help_text in SWITCHES:
        groups[section].add_argument(flag, dest=_dest(section, name), action="store_const", const=value,
                                     default=argparse.SUPPRESS, help=help_text)


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
