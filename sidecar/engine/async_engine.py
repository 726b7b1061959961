"""AsyncEngine: runs LLMEngine in one thread and streams its outputs to asyncio.

The engine thread is the only one that touches LLMEngine state. asyncio code
talks to it through a command queue (add / abort); outputs come back through
per-request asyncio queues via ``loop.call_soon_threadsafe``.

Callers outside the engine thread never touch LLMEngine: ``model_info`` is a
copy taken at construction, and ``tokenize`` / ``encode_chat`` /
``token_strings`` run on a tokenizer of AsyncEngine's own (a copy of the
engine's, behind a lock), so worker threads never share a tokenizer with the
engine thread that detokenizes every step.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Optional

from sidecar.config import EngineConfig
from sidecar.engine.chat_template import encode_chat
from sidecar.engine.engine import LLMEngine, Prompt
from sidecar.engine.grammar_compile import lower_thread_priority
from sidecar.engine.lora_manager import check_name
from sidecar.engine.request import RequestOutput, SamplingParams, random_request_id

log = logging.getLogger("sidecar.engine")

_STOP = object()


def _settle(fut: asyncio.Future, result: Any, exc: Optional[BaseException]) -> None:
    if fut.done():  # the caller was cancelled
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class EngineDeadError(RuntimeError):
    """The engine thread is not running (shut down or crashed)."""


class _Stream:
    """One request's outputs on their way to its consumer. Bounded whatever the consumer does: an output
    that arrives while the previous one is still unread is merged into it (deltas concatenated, the
    cumulative fields taken from the newer), so a stream nobody reads holds one pending output, not a
    copy of the text per token. Errors are never merged, nor anything into a finished output."""

    __slots__ = ("items", "ready", "loop", "finished")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: deque = deque()
        self.ready = asyncio.Event()
        self.loop = loop
        self.finished = False

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item: Any) -> None:
        last = self.items[-1] if self.items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            self.items[-1] = item.merged_after(last)
        else:
            self.items.append(item)
        self.ready.set()

    async def get(self) -> Any:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        return self.items.popleft()


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: "queue.Queue[Any]" = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._thread: Optional[threading.Thread] = None
        self.failure: Optional[str] = None  # why the engine thread stopped by itself (the server then exits)
        self._accepting = True
        self._stats: dict[str, Any] = engine.stats()
        self._lock = threading.Lock()
        self._model_info: dict[str, Any] = dict(engine.model_info)  # facts fixed at load
        # Tokenizers are not safe to share across threads; this copy serves every caller but the
        # engine thread, one call at a time.
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self._tokenizer_lock = threading.Lock()
        self._loras: dict[str, str] = engine.lora.names()  # name -> path; replaced whole on each change
        engine.structured.prepare()  # holds the GIL for long: before serving, never under a first grammar request
        # Below the step loop's and the servers' CPU priority: compiling takes only what they leave.
        self._grammar_pool = ThreadPoolExecutor(
            1, thread_name_prefix="sidecar-grammar", initializer=lower_thread_priority
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="sidecar-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        """Refuse new requests, let running ones finish for up to ``timeout_s``, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, timeout_s)
        while self.num_unfinished and time.monotonic() < deadline and self.is_running:
            await asyncio.sleep(0.02)
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self._commands.put(("abort", rid, "shutdown"))
        while self.num_unfinished and self.is_running and time.monotonic() < deadline + 5.0:
            await asyncio.sleep(0.01)
        self._commands.put(_STOP)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    # -- engine thread ------------------------------------------------------------------------------------
    def _handle(self, cmd: Any) -> bool:
        if cmd is _STOP:
            return False
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, kwargs = cmd
            stream = self._streams.get(rid)
            try:
                self.engine.add_request(rid, prompt, params, **kwargs)
            except Exception as exc:  # ValueError / QueueFullError go back to the caller
                self._drop(rid)
                if stream is not None:
                    stream.put(exc)
        elif kind == "abort":
            self.engine.abort(cmd[1], cmd[2])
        elif kind == "call":  # fn(engine) on this thread; its result or exception goes to the caller's future
            _, fn, fut, loop = cmd
            try:
                result, exc = fn(self.engine), None
            except Exception as e:
                result, exc = None, e
            loop.call_soon_threadsafe(_settle, fut, result, exc)
        return True

    def _drop(self, rid: str) -> None:
        with self._lock:
            self._streams.pop(rid, None)

    def _loop(self) -> None:
        running = True
        while running:
            try:
                block = not self.engine.has_unfinished_requests()
                while True:
                    try:
                        cmd = self._commands.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        break
                    block = False
                    if not self._handle(cmd):
                        running = False
                        break
                if not running:
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    # Refresh the snapshot before anyone hears of these outputs, so a stats call made
                    # after a response already sees that request's blocks returned.
                    self._stats = self.engine.stats()
                    for out in outputs:
                        with self._lock:
                            stream = self._streams.get(out.request_id)
                            if out.finished:
                                self._streams.pop(out.request_id, None)
                        if stream is not None:
                            stream.put(out)
                self._stats = self.engine.stats()
                tp = getattr(self.engine, "tp", None)
                if tp is not None and tp.broken:  # the model cannot run again: stop, so the server exits
                    log.error("engine stopped: %s", tp.broken)
                    self.failure = tp.broken
                    break
            except Exception as exc:  # never let one bad step kill the loop, nor retry it forever
                log.exception("engine loop error; aborting all requests")
                for rid in list(self.engine.requests):
                    self.engine.abort(rid, f"error: {type(exc).__name__}: {exc}")
        # Anything still attached gets a terminal error instead of hanging.
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.put(EngineDeadError(f"engine stopped: {self.failure}" if self.failure else "engine stopped"))

    # -- any thread ------------------------------------------------------------------------------------------
    @property
    def model_info(self) -> dict[str, Any]:
        """A copy of the loaded model's facts (model, max_model_len, vocab_size, ...)."""
        return dict(self._model_info)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` as the engine would tokenize it. Safe from any thread."""
        with self._tokenizer_lock:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_chat(
        self, messages: list[dict], tools: Optional[list[dict]] = None, template_kwargs: Optional[dict] = None
    ) -> list[int]:
        """``messages`` (and OpenAI function specs ``tools``, extra template variables ``template_kwargs``)
        rendered by the model's chat template, with the generation prompt; raises ValueError naming the
        field. Safe from any thread."""
        with self._tokenizer_lock:
            return encode_chat(self._tokenizer, messages, tools, template_kwargs)

    def special_token_id(self, text: str) -> Optional[int]:
        """The id of the special token whose text is ``text``, None when it is not one. Safe from any thread."""
        with self._tokenizer_lock:
            ids = self._tokenizer.encode(text, add_special_tokens=False)
            special = set(getattr(self._tokenizer, "all_special_ids", ()) or ())
        return ids[0] if len(ids) == 1 and ids[0] in special else None

    @property
    def chat_template(self) -> str:
        """The model's chat template source ("" when it has none)."""
        return getattr(self._tokenizer, "chat_template", None) or ""

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token id decoded on its own. Safe from any thread."""
        with self._tokenizer_lock:
            return [self._tokenizer.decode([i]) for i in ids]

    # -- asyncio API -------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    async def abort(self, request_id: str, reason: str = "client") -> None:
        self._commands.put(("abort", request_id, reason))

    def lora_adapters(self) -> dict[str, str]:
        """Loaded LoRA adapter name -> its path. Safe from any thread."""
        return dict(self._loras)

    async def _call(self, fn: Any) -> Any:
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put(("call", fn, fut, loop))
        return await fut

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name``. The files are read and validated off the engine
        thread (requests in flight keep running); raises AdapterError / ValueError naming the field."""
        check_name(name)
        adapter = await asyncio.get_running_loop().run_in_executor(None, self.engine.lora.read, path)

        def register(engine: LLMEngine) -> dict[str, str]:
            engine.lora.register(name, adapter)
            return engine.lora.names()

        self._loras = await self._call(register)

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (requests already using it finish with it); raises
        AdapterNotFoundError when it is not loaded."""

        def unregister(engine: LLMEngine) -> dict[str, str]:
            engine.lora.unregister(name)
            return engine.lora.names()

        self._loras = await self._call(unregister)

    async def compile_grammar(self, constraint: Any) -> None:
        """Compile (and try) a constraint on the grammar thread, never the engine's (which keeps stepping);
        raises ValueError("structured: ..."). One thread: a request's n choices compile it once, without
        taking the shared workers that tokenize other tenants' prompts."""
        if constraint is not None:
            await asyncio.get_running_loop().run_in_executor(
                self._grammar_pool, self.engine.structured.compiled, constraint
            )

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: Optional[str] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        deadline: Optional[float] = None,
        arrival_time: Optional[float] = None,
        tenant: str = "",
        lora: Optional[str] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Errors (ValueError, AdapterNotFoundError, QueueFullError) raise
        before any output. Leaving the iteration early aborts the request in the engine. ``lora``: the
        adapter it runs with (None: the base model).

        ``arrival_time`` (time.monotonic()) defaults to now: queue time and TTFT count from the moment
        the request reached us, including the hand-over to the engine thread."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if not self._accepting:
            raise EngineDeadError("engine is shutting down")
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        await self.compile_grammar(params.structured)
        rid = request_id or random_request_id()
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already in use")
            self._streams[rid] = stream
        self._commands.put(
            (
                "add",
                rid,
                prompt,
                params,
                {
                    "priority": priority,
                    "cache_salt": cache_salt,
                    "deadline": deadline,
                    "arrival_time": arrival_time,
                    "tenant": tenant,
                    "lora": lora,
                },
            )
        )
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._drop(rid)
                self._commands.put(("abort", rid, "client"))
