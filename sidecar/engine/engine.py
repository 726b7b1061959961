"""LLMEngine (add_request / step / abort) and LLM, the offline facade."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence, Union

import torch

from sidecar.config import EngineConfig
from sidecar.engine import pp as pipeline_parallel
from sidecar.engine import tp as tensor_parallel
from sidecar.engine.beam import BeamSearch
from sidecar.engine.chat_template import encode_chat
from sidecar.engine.detokenizer import IncrementalDetokenizer
from sidecar.engine.kv_grouped import build_kv_manager
from sidecar.engine.kv_evict import KVPolicies
from sidecar.engine.lora_manager import LoraManager
from sidecar.engine.overlap import OverlapPipeline, append_sampled
from sidecar.engine.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    random_request_id,
)
from sidecar.engine.runner import ModelRunner
from sidecar.engine.sampler import Sampler
from sidecar.engine.sampler_check import device_sampler_check
from sidecar.engine.scheduler import Scheduler, SchedulerOutput
from sidecar.engine.spec.decoder import SpecDecoder
from sidecar.engine.structured import StructuredDecoder
from sidecar.model import heap, hugepages
from sidecar.model.lora import part_shapes
from sidecar.model.param_count import parameter_counts

log = logging.getLogger("sidecar.engine")

Prompt = Union[str, Sequence[int]]
MAX_REQUEST_ID_LEN = 128


class LLMEngine:
    """Synchronous, single-threaded engine core. Not thread-safe: AsyncEngine owns it."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        mapped_before = hugepages.snapshot()
        # tp None unless the model is split over processes (tensor-parallel ranks or pipeline stages)
        split = pipeline_parallel if config.pipeline_parallel_size > 1 else tensor_parallel
        self.tp, loaded = split.load(config)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = loaded.args.vocab_size
        self.runner = ModelRunner(loaded, config, device_sampler_check(loaded.device, config.seed))
        if self.tp is not None:  # the workers allocate pools of the runner's size; its model drives them
            self.tp.attach(self.runner)
        self.lora = LoraManager(
            loaded.model,
            loaded.args,
            config.max_loras,
            config.max_lora_rank,
            enabled=bool(config.lora_modules) or config.enable_lora,
        )
        for name, path in config.lora_modules.items():
            self.lora.register(name, self.lora.read(path))
        if self.tp is not None and self.lora.enabled:  # every rank's slots hold the same adapters
            self.tp.attach_lora(self.lora.layers)
        self.runner.lora = self.lora
        self.kv = build_kv_manager(config, self.runner, loaded)  # with the offload tiers asked for
        # Weights and KV pool in transparent huge pages where torch's allocator did not already place them.
        self.huge_pages = (
            hugepages.advise_new(mapped_before)
            if loaded.device.type == "cpu"
            else {"state": f"off (device {loaded.device.type})"}
        )
        # A step's large intermediates (logits, a prompt chunk's MLP) reused from the heap, not mapped anew each step.
        self.heap = (
            heap.keep_step_blocks()
            if loaded.device.type == "cpu"
            else {"state": f"off (device {loaded.device.type})"}
        )
        # A lone request must always fit the pool, so no request can be starved by its own length.
        self.max_model_len = self.kv.capacity(loaded.max_model_len)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self.kv_policies = KVPolicies.for_model(config, loaded.args, self.runner.kv_plan is not None)
        self.scheduler.rope_long_from = loaded.model.rope_long_from
        self.beams = BeamSearch(self)  # beam search groups: each live beam runs as a scheduled Request
        self.sampler = Sampler(self._sampling_device(), config.seed, config.max_num_seqs)
        self.spec = SpecDecoder(config, self.kv, self.max_model_len, self.runner, loaded)
        self.structured = StructuredDecoder(
            self.tokenizer, self.vocab_size, self.eos_token_ids, overlap=self.runner.host_overlaps_forward
        )
        self.requests: dict[str, Request] = {}
        overlap = config.overlap_steps
        self.overlap = OverlapPipeline(
            self, (loaded.device.type == "cuda" and not config.enforce_eager) if overlap is None else overlap
        )
        self._pending: list[RequestOutput] = []
        self.counters = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "num_requests_finished": 0,
            "num_steps": 0,
        }
        self.model_info = {
            "model": config.model,
            "model_dir": str(loaded.model_dir),
            "architecture": loaded.args.architecture,
            # a mixture of experts runs fewer per token than it holds: each token's router picks its experts
            **dict(zip(("total_parameters", "active_parameters"), parameter_counts(loaded.args))),
            "dtype": str(loaded.dtype).replace("torch.", ""),
            "dtype_reason": loaded.dtype_reason,
            "quantization": loaded.quantization or "none",
            "lm_head": getattr(loaded.model.lm_head, "mode", None) or str(loaded.dtype).replace("torch.", ""),
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "block_size": config.block_size,
            "num_kv_blocks": self.kv.num_blocks,
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            "prefix_caching": self.kv.enable_caching,  # off for models it cannot serve exactly
            "device": str(loaded.device),
            **self.runner.fast_path_info(),  # fast_paths, fast_path_fallbacks
            **self.runner.cpu_plans.info(),  # on CPU: cpu_decode_replay (+ reason)
            **(self.tp.replay_info() if hasattr(self.tp, "replay_info") else {}),  # every pipeline stage's
            **self.runner.kv_info(),  # kv_cache_dtype (+ reason), kv_cache_tokens
            # what a LoRA adapter for this base must fit: layers and each target's (in, out) features
            "num_layers": loaded.args.num_layers,
            "lora_target_shapes": part_shapes(loaded.args),
        }
        weights = sum(
            t.numel() * t.element_size()
            for t in list(loaded.model.parameters()) + list(loaded.model.buffers())
        )
        kvb = self.runner.kv_budget
        log.info(
            "engine ready: model=%s arch=%s dtype=%s (%s) quantization=%s device=%s weights=%.1f MiB "
            "kv_blocks=%d x %d tokens (%d tokens, %s, %.1f MiB, %s, sized by %s; container limit %s) "
            "max_model_len=%d load=%.1fs",
            config.model,
            loaded.args.architecture,
            self.model_info["dtype"],
            loaded.dtype_reason,
            self.model_info["quantization"],
            loaded.device,
            weights / 2**20,
            self.kv.num_blocks,
            config.block_size,
            self.model_info["kv_cache_tokens"],
            self.model_info["kv_cache_dtype"],
            kvb.bytes / 2**20,
            "committed" if config.kv_cache_commit else "lazy",
            kvb.source,
            "none" if kvb.container_limit_bytes is None else f"{kvb.container_limit_bytes / 2**20:.0f} MiB",
            self.max_model_len,
            loaded.load_time_s,
        )

    # -- input ---------------------------------------------------------------------------------------
    def max_len(self, req: Request) -> int:
        """The longest ``req`` may grow: a sequence under a KV budget is not bounded by the pool's size."""
        return (
            self.loaded.max_model_len
            if req.kv_policy is not None and req.kv_policy.bounded
            else self.max_model_len
        )

    def tokenize(self, prompt: Prompt, limit: Optional[int] = None) -> tuple[Optional[str], list[int]]:
        """Validate and tokenize a prompt (of fewer than ``limit`` tokens, default ``max_model_len``). Raises
        ValueError naming ``prompt``."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt: must not be empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text: Optional[str] = prompt
        elif isinstance(prompt, (list, tuple)):
            ids, text = list(prompt), None
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt: token ids must be integers")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
        else:
            raise ValueError(f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        limit = limit or self.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within the context length of {limit} tokens"
            )
        return text, ids

    def encode_chat(self, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
        """Apply the checkpoint's chat template (with the generation prompt); ``tools`` (OpenAI function
        specs) and tool messages are passed to the template as Hugging Face defines them."""
        return encode_chat(self.tokenizer, messages, tools)  # content never forges turns (see chat_template)

    def add_request(
        self,
        request_id: Optional[str],
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        deadline: Optional[float] = None,
        arrival_time: Optional[float] = None,
        tenant: str = "",
        lora: Optional[str] = None,
    ) -> str:
        """Queue a request. Raises ValueError (bad input, naming the field), AdapterNotFoundError (``lora``
        names no loaded adapter) or QueueFullError. ``tenant`` groups requests for fair admission (see
        Scheduler); ``lora`` is the adapter it runs with (None: the base model)."""
        request_id = request_id or random_request_id()
        if not isinstance(request_id, str) or len(request_id) > MAX_REQUEST_ID_LEN:
            raise ValueError(f"request_id: must be a string of at most {MAX_REQUEST_ID_LEN} characters")
        if request_id in self.requests or request_id in self.beams.groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        params.validate(self.vocab_size)
        if self.tp is not None:
            self.tp.check_params(params)
        if not isinstance(priority, int):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        policy = self.kv_policies.window if params.beam_width else self.kv_policies.for_params(params)
        bounded = policy is not None and policy.bounded
        text, ids = self.tokenize(prompt, self.loaded.max_model_len if bounded else None)
        req = Request(
            request_id,
            ids,
            params,
            prompt=text,
            priority=priority,
            cache_salt=cache_salt or None,
            deadline=deadline,
            arrival_time=arrival_time,
            eos_token_ids=self.eos_token_ids,
            tenant=tenant,
        )
        req.kv_policy = policy
        req.detok = IncrementalDetokenizer(self.tokenizer, params)
        if params.beam_width is not None:  # its beams run in the batch (engine/beam.py)
            self.beams.add(req, lora)
            self.counters["prompt_tokens"] += len(ids)
            return request_id
        self.scheduler.check_room(len(self.lora.parked))  # may raise QueueFullError
        admitted = self.lora.admit(req, lora)  # may raise AdapterNotFoundError; False: parked for a slot
        self.structured.attach(request_id, params.structured)  # may raise ValueError naming structured
        try:
            if admitted:
                self.scheduler.add(req)
        except Exception:
            self.structured.release(request_id)
            self.lora.release(req)
            raise
        self.requests[request_id] = req
        self.counters["prompt_tokens"] += len(ids)
        return request_id

    def abort(self, request_id: str, reason: str = "client") -> None:
        """Finish the request now; its final output comes with the next step(). Unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            self.beams.abort(request_id, reason, self._pending)
        else:
            self._finish(req, FinishReason.ABORT, reason)
            self._pending.append(req.make_output())

    def has_unfinished_requests(self) -> bool:
        return (
            bool(self.requests)
            or bool(self.beams.groups)
            or bool(self._pending)
            or self.overlap.inflight is not None
        )

    def _sampling_device(self) -> torch.device:
        """The logits' device, unless the self-check turned the device sampler off there: then the CPU (the
        reference sampler, on a copy of the logits)."""
        dev = self.runner.device
        if dev.type == "cpu" or self.runner.fast_paths.device_sampler:
            return dev
        why = (self.runner.fast_paths.reasons or {}).get("device_sampler", "not checked")
        log.warning("device sampler off (%s): sampling on a CPU copy of the logits", why)
        return torch.device("cpu")

    def sampling_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if logits.device == self.sampler.device else logits.to(self.sampler.device)

    # -- the step -------------------------------------------------------------------------------------
    def _finish(self, req: Request, reason: FinishReason, abort_reason: Optional[str] = None) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.abort_reason = abort_reason
        req.finished_time = time.monotonic()
        req.text = req.detok.visible_text(True) if reason != FinishReason.ABORT else req.text
        self.scheduler.remove(req)
        self.lora.release(req)
        self.structured.release(req.request_id)
        self.spec.release(req.request_id)
        self.sampler.release(req)
        self.requests.pop(req.request_id, None)
        self.counters["num_requests_finished"] += 1

    def _check_stop(self, req: Request, token: int) -> Optional[FinishReason]:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids):
            return FinishReason.STOP
        if req.detok.add_token(token) is not None:
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_len(req):
            return FinishReason.LENGTH
        return None

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return the outputs of every request that changed."""
        outputs, self._pending = self._pending, []
        now = time.monotonic()
        for req in self.scheduler.expired(now) + self.lora.expired(now):
            self._finish(req, FinishReason.ABORT, "deadline")
            outputs.append(req.make_output())
        for group_id in self.beams.expired(now):
            self.beams.abort(group_id, "deadline", outputs)
        for req in self.lora.unpark():  # its adapter got a slot: it queues as if it arrived now
            self.scheduler.readmit(req)
        if self.overlap.advance(outputs):  # the next step was launched from the in-flight step's device ids
            return outputs
        self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        for req in sched.unschedulable:
            if req.beam_group is not None:
                self.beams.abort(req.beam_group.group_id, "error: beams do not fit the KV cache", outputs)
                continue
            self._finish(req, FinishReason.ABORT, "error: request does not fit the KV cache")
            outputs.append(req.make_output())
        if sched.empty:
            return outputs
        self.counters["num_steps"] += 1
        try:
            if not self.overlap.launch_scheduled(sched):
                self._run_scheduled(sched, outputs)
        except Exception as exc:  # a failed step fails its requests, never the engine
            log.exception("engine step failed; aborting %d requests", len(sched.scheduled))
            for s in sched.scheduled:
                if s.request.beam_group is not None:  # its group ends (each beam is marked finished)
                    self.beams.abort(s.request.beam_group.group_id, f"error: {type(exc).__name__}", outputs)
                elif not s.request.is_finished:
                    self._finish(s.request, FinishReason.ABORT, f"error: {type(exc).__name__}: {exc}")
                    outputs.append(s.request.make_output())
        return outputs

    def _run_scheduled(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        # Grammar masks are computed while the forward runs; None when no sampling request is constrained.
        masks = self.structured.start_masks(
            [s.request.request_id for s in sched.scheduled if s.completes_prompt]
        )
        sample_reqs, logits = self.runner.execute(sched, self.kv)
        for s in sched.scheduled:  # proposed tokens count as computed only once accepted (spec/decoder.py)
            s.request.num_computed_tokens += s.num_new_tokens - s.num_spec_tokens
            self.kv.cache_computed_blocks(s.request)
        num_spec = {s.request.request_id: s.num_spec_tokens for s in sched.scheduled if s.num_spec_tokens}
        sample_reqs, logits = self.beams.split(sample_reqs, logits, num_spec)  # beams keep their rows
        if sample_reqs:
            results = self.spec.sample(
                self.structured, self.sampler, self.sampling_logits(logits), sample_reqs, num_spec, masks
            )
            now = time.monotonic()
            for req, (token_ids, logprobs) in zip(sample_reqs, results):
                append_sampled(self, req, token_ids, logprobs, now, outputs)
        self.beams.advance(outputs)

    def stats(self) -> dict[str, Any]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_kv_blocks": self.kv.num_blocks,
            "kv_cache_tokens": self.model_info["kv_cache_tokens"],
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            "num_free_kv_blocks": self.kv.num_free_blocks(),
            **self.kv.offload_stats(),
            "kv_cache_usage": self.kv.usage(),
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            **(self.kv.ckpts.stats() if self.kv.ckpts is not None else {}),  # hybrid models' states
            "num_preemptions": self.scheduler.num_preemptions,
            **self.counters,
            **self.structured.counters(),
            **self.spec.counters(),
            "fast_path_active": self.runner.fast_path_states(),
            **self.lora.stats(),
        }
