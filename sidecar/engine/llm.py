"""LLM: the offline facade over LLMEngine (``LLM(model=...).generate(prompts, SamplingParams(...))``)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from sidecar.config import EngineConfig
from sidecar.engine.beam_params import BeamSearchOutput, BeamSearchParams
from sidecar.engine.engine import LLMEngine, Prompt
from sidecar.engine.request import RequestOutput, SamplingParams


class LLM:
    """Offline facade: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

    def __init__(
        self,
        model: Optional[str] = None,
        dtype: str = "auto",
        quantization: Optional[str] = None,
        block_size: int = 16,
        kv_cache_memory_gb: Optional[float] = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                quantization=quantization,
                block_size=block_size,
                kv_cache_memory_gb=kv_cache_memory_gb,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching,
                seed=seed,
                max_waiting_requests=kwargs.pop("max_waiting_requests", 1 << 30),
                **kwargs,
            )
        )
        self.tokenizer = self.engine.tokenizer

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name``. Raises ValueError naming the file and field."""
        self.engine.lora.register(name, self.engine.lora.read(path))

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``. Raises LookupError when it is not loaded."""
        self.engine.lora.unregister(name)

    def _run(
        self,
        prompts: list[Prompt],
        params: Union[SamplingParams, Sequence[SamplingParams], None],
        use_tqdm: bool,
        lora: Union[str, None, Sequence[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} SamplingParams for {len(prompts)} prompts")
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora: got {len(loras)} adapter names for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for p, sp, name in zip(prompts, plist, loras):
                ids.append(self.engine.add_request(None, p, sp, lora=name))
        except Exception:
            for rid in ids:
                self.engine.abort(rid, "error: batch rejected")
            self.engine.step()
            raise
        done: dict[str, RequestOutput] = {}
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:  # interrupted (e.g. KeyboardInterrupt): give every block back
                if rid not in done:
                    self.engine.abort(rid, "shutdown")
        return [done[i] for i in ids]

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = False,
        lora: Union[str, None, Sequence[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts (strings or token-id lists); outputs in input order.
        ``lora``: the adapter every prompt uses, or a list with one name (or None: the base model) per prompt."""
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        return self._run(list(prompts), params, use_tqdm, lora)

    def beam_search(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: Optional[BeamSearchParams] = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for a prompt or a list of prompts (strings or token-id lists), all prompts' beams in
        one continuous batch; per prompt a ``BeamSearchOutput`` whose ``sequences`` are best first."""
        if params is None:
            params = BeamSearchParams()
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params: must be a BeamSearchParams")
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        outs = self._run(list(prompts), params.sampling_params(), use_tqdm)
        return [
            BeamSearchOutput(o.request_id, o.prompt, o.prompt_token_ids, list(o.beams or []), o.finish_reason)
            for o in outs
        ]

    def stats(self) -> dict[str, Any]:
        """A snapshot of the engine's cumulative counters, e.g. for benchmarks: ``prefix_cache_queries`` /
        ``prefix_cache_hits`` (prompt tokens looked up in / served from the prefix cache), ``num_steps``,
        ``prompt_tokens``, ``generation_tokens``, ``num_requests_finished``, ``num_preemptions``, the current
        KV pool state (``num_kv_blocks``, ``num_free_kv_blocks``, ``kv_cache_usage``, ``kv_cache_tokens``: the
        pool's capacity in tokens), ``kv_offload_*`` (offloaded / loaded blocks and bytes, tier hits, hit rates,
        load time), ``spec_decode_*`` (tokens proposed / accepted / emitted, verifications, acceptance
        histogram, step costs, proposer failures) and, for a hybrid model with prefix caching,
        ``state_checkpoints*`` (linear-attention states held / saved / restored by hits / evicted)."""
        return dict(self.engine.stats())

    def chat(
        self,
        conversations: Union[list[dict], Sequence[list[dict]]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = False,
        lora: Union[str, None, Sequence[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        """Generate replies for one conversation or a list of them (chat template applied); ``lora`` as in
        ``generate``."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run([self.engine.encode_chat(list(c)) for c in conversations], params, use_tqdm, lora)
