"""Start-up self-check of the device fast paths against the eager torch reference.

After loading and before serving, a small probe (a few short sequences: one prompt pass, then a few
teacher-forced decode steps through the runner's decode path, the last with the first sequence alone)
runs once with every fast path off -- the reference -- and once per fast path with only that path on.
A path whose run raises, produces non-finite logits, logits further from the reference than the dtype's
tolerance, or another greedy token where the reference's choice is clear, is turned off with the reason
logged and recorded (``FastPaths.disable``); the others stay on. The survivors are then probed together
once; if that run disagrees, all of them go off (a wrong answer is never worth the speed).

The probe uses KV blocks 1..n of the pool (and the reserved block 0 for padded rows) and puts back
their contents afterwards, so it can run at any time no request is being stepped; decode graphs it
captures are dropped, and the runner's buckets are restored. A hybrid model's probe sequences take state
slots 0..n-1 (from rest, as a sequence does) and its padded rows the scratch row (linear_state.py): those
rows are put back too. Its linear layers' states after the probe -- each probe sequence's convolution window
and recurrent state -- are compared with the reference's as the logits are, so a path that steps a wrong
slot or computes a wrong state fails even where the probe's last logits would not show it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Optional, Sequence

import torch

from sidecar.engine.input_buffers import DecodeRow, pick_bucket
from sidecar.model.attention import AttentionMetadata, PrefillSegment
from sidecar.model.kernels.gpu_paths import PATH_NAMES, triton_available
from sidecar.model.moe import has_stacked_experts
from sidecar.model.quant import kernel_dtype

log = logging.getLogger("sidecar.engine")

PROBE_SEQS = 3
DECODE_STEPS = 3
# Largest |fast - reference| logit difference allowed, relative to the largest reference logit (at least 1):
# float32 kernels differ from torch in summation order only; half precision rounds every intermediate.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}
TRITON_PATHS = ("attention", "rope_kv", "norm", "silu_mul", "gemv", "weight_only", "moe")

SamplerCheck = Callable[[torch.Tensor], Optional[str]]
# A split model's ranks' common verdict: (path, this rank's reason or None) -> the group's (tp_device.py)
Agree = Callable[[str, Optional[str]], Optional[str]]


def default_paths(runner) -> list[str]:
    """The paths worth checking on this runner: every model path (int8/int4 GEMM only for a quantized
    model, the fused products only for one with plain weights, the grouped expert GEMM only for a mixture
    of experts with stacked experts); the device sampler only when a check for it is given (see ``run``)."""
    skip = {"device_sampler", "gemv" if runner.quantized else "weight_only"}
    if not has_stacked_experts(runner.model):
        skip.add("moe")
    return [n for n in PATH_NAMES if n not in skip]


@contextlib.contextmanager
def _scratch_blocks(runner, num: int, seqs: int) -> Iterator[list[int]]:
    """Blocks 1..num for the probe; their contents (and block 0's) are restored on exit, and so are a hybrid
    model's state slots 0..seqs-1 and its scratch row."""
    saved = [[t[: num + 1].clone() for t in layer] for layer in runner.kv_caches]  # values (and scales)
    states = getattr(runner, "states", None)
    rows = [*range(seqs), states.scratch] if states is not None else []
    kept_states = states.rows(rows) if states is not None else []
    try:
        yield list(range(1, num + 1))
    finally:
        for layer, kept in zip(runner.kv_caches, saved):
            for t, old in zip(layer, kept):
                t[: num + 1].copy_(old)
        if states is not None:
            states.put_rows(rows, kept_states)


def _probe_states(runner, seqs: int) -> list[torch.Tensor]:
    """A hybrid model's state slots 0..seqs-1 of every linear layer, in float32 (none for other models)."""
    states = getattr(runner, "states", None)
    return [] if states is None else [t.float() for t in states.rows(list(range(seqs)))]


def _probe(runner, blocks: list[int], prompts: list[list[int]], steps: list[list[int]]) -> list[torch.Tensor]:
    """Logits [PROBE_SEQS, V] of the prompt pass and of each decode step, under the current fast paths; then,
    for a hybrid model, the states the probe sequences end with (``_probe_states``)."""
    bs, dev = runner.block_size, runner.device
    nb = len(blocks) // len(prompts)
    tables = [blocks[i * nb : (i + 1) * nb] for i in range(len(prompts))]
    states = getattr(runner, "states", None)
    if states is not None:  # probe sequence i holds slot i, from rest
        for t in states.conv + states.recurrent:
            t[: len(prompts)].zero_()
    ids, pos, slots, segments, last = [], [], [], [], []
    for i, (p, t) in enumerate(zip(prompts, tables)):
        table = torch.tensor(t[: -(-len(p) // bs)], dtype=torch.long, device=dev)
        segments.append(PrefillSegment(len(ids), len(p), len(p), table, state_slot=i, state_start=True))
        ids.extend(p)
        pos.extend(range(len(p)))
        slots.extend(t[i // bs] * bs + i % bs for i in range(len(p)))
        last.append(len(ids) - 1)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731  (start-up only)
    meta = AttentionMetadata(slot_mapping=as_t(slots), block_size=bs, prefills=segments)
    hidden = runner.model(as_t(ids), as_t(pos), getattr(runner, "layer_caches", runner.kv_caches), meta)
    out = [runner.model.logits_at(hidden, as_t(last)).float()]  # a split model's whole rows too
    graphs = runner.fast_paths.cuda_graphs
    if graphs:  # the probe's own buckets captured (and replayed) under the current kernel settings
        runner.set_decode_padding(True)
        buckets = sorted({pick_bucket(runner.buckets, n) for n in (1, len(prompts))})
        runner.graphs.capture(buckets, lambda b: runner.inputs.fill_padding(b, runner.inputs.max_blocks))
    try:
        for k, toks in enumerate(steps):
            rows = []
            for i, (p, t, tok) in enumerate(zip(prompts, tables, toks)):
                c = len(p) + k
                rows.append(
                    DecodeRow(tok, c, t[c // bs] * bs + c % bs, c + 1, t[: c // bs + 1], state_slot=i)
                )
            if k == len(steps) - 1:
                rows = rows[:1]  # the last step: the first sequence alone (the batch-1 step)
            out.append(runner.decode_rows(runner.inputs.one_table(rows), list(range(len(rows)))).float())
    finally:
        if graphs:
            runner.graphs.clear()
            runner.set_decode_padding(False)
    return out + _probe_states(runner, len(prompts))


def _disagreement(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> Optional[str]:
    steps = 1 + DECODE_STEPS  # the logits; after them a hybrid model's states (``_probe_states``)
    return _logits_disagreement(got[:steps], ref[:steps], tol) or _states_disagreement(
        got[steps:], ref[steps:], tol
    )


def _states_disagreement(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> Optional[str]:
    """Why the probe's final states (every linear layer's windows, then its recurrent states) are off."""
    for i, (g, r) in enumerate(zip(got, ref)):
        scale = max(1.0, float(r.abs().max()))
        diff = float((g - r).abs().max()) if bool(torch.isfinite(g).all()) else float("inf")
        if diff > tol * scale:
            kind = "convolution windows" if i < len(got) // 2 else "recurrent states"
            return (
                f"linear-attention {kind} after the probe differ from the reference by {diff:.3g} "
                f"(tolerance {tol * scale:.3g})"
            )
    return None


def _logits_disagreement(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> Optional[str]:
    for i, (g, r) in enumerate(zip(got, ref)):
        where = "prompt pass" if i == 0 else f"decode step {i}"
        if not bool(torch.isfinite(g).all()):
            return f"non-finite logits in the {where}"
        scale = max(1.0, float(r.abs().max()))
        diff = float((g - r).abs().max())
        if diff > tol * scale:
            return (
                f"logits differ from the reference by {diff:.3g} in the {where} (tolerance {tol * scale:.3g})"
            )
        top2 = r.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff  # no rounding within the measured error flips these
        if bool(((g.argmax(-1) != r.argmax(-1)) & clear).any()):
            return f"greedy token differs from the reference in the {where}"
    return None


def _attempt(runner, blocks, prompts, steps, ref, tol) -> Optional[str]:
    try:
        return _disagreement(_probe(runner, blocks, prompts, steps), ref, tol)
    except Exception as exc:  # a failing path is switched off, never fatal
        return f"{type(exc).__name__}: {exc}"


@torch.inference_mode()
def run(
    runner,
    paths: Optional[Sequence[str]] = None,
    sampler_check: Optional[SamplerCheck] = None,
    agree: Optional[Agree] = None,
) -> dict:
    """Check ``paths`` (default: ``default_paths``) and leave on only those that agree with the reference.
    ``sampler_check(logits)`` checks the device sampler on reference logits (None = agrees, else the
    reason). Returns the fallbacks: path -> reason. The runner's graphs are left uncaptured.

    ``agree``: every rank of a split model runs this at once over its own slices, and each model path's
    verdict is the group's: asked before a path's probe (one rank that cannot take it: no rank probes it)
    and after it, so every rank makes the same probes in the same order and their collectives pair. The
    device sampler is rank 0's alone (no forward): never agreed."""
    fp = runner.fast_paths
    paths = [p for p in (default_paths(runner) if paths is None else paths) if p in PATH_NAMES]
    if sampler_check is not None and "device_sampler" not in paths:
        paths.append("device_sampler")
    runner.graphs.clear()  # graphs captured earlier replay their own kernels: the probes must run these settings
    runner.set_decode_padding(False)
    fp.set_all(False)
    fp.reasons = {}
    if runner.model.args.attn_sinks and "attention" in paths:  # never given such layers (attention_sinks.py)
        paths.remove("attention")
        fp.disable("attention", "attention sinks: the Triton decode kernel does not take them; torch attends")
        log.warning("fast path attention off: %s", fp.reasons["attention"])
    if runner.model.args.latent is not None:  # never given latent caches (mla.py)
        from sidecar.model.mla import FAST_PATH_REASON

        for name in ("attention", "rope_kv"):
            if name in paths:
                paths.remove(name)
                fp.disable(name, FAST_PATH_REASON)
                log.warning("fast path %s off: %s", name, FAST_PATH_REASON)
    bs, vocab = runner.block_size, runner.model.args.vocab_size
    states = getattr(runner, "states", None)  # a hybrid model's probe sequences each hold a state slot
    seqs = min(PROBE_SEQS, runner.inputs.max_batch, states.slots if states is not None else PROBE_SEQS)
    prompt_len = bs + 3  # one full block and a partial one: both block-table cases
    nb = -(-(prompt_len + DECODE_STEPS) // bs)
    if seqs * nb >= runner.num_blocks or not runner.fits_decode_buffers(seqs, nb):
        for p in paths:
            fp.disable(p, "self-check: the KV pool or decode buffers are too small for the probe")
        return dict(fp.reasons)
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, vocab, (prompt_len - i,), generator=gen).tolist() for i in range(seqs)]
    steps = [torch.randint(0, vocab, (seqs,), generator=gen).tolist() for _ in range(DECODE_STEPS)]
    tol = TOLERANCE.get(runner.dtype, 6e-2)
    if (
        runner.quantized and runner.device.type == "cuda"
    ):  # quantized layers compute in bf16 there (reference too)
        tol = max(tol, TOLERANCE[kernel_dtype(runner.dtype, runner.device)])
    passed = []
    with _scratch_blocks(runner, seqs * nb, seqs) as blocks:
        ref = _probe(runner, blocks, prompts, steps)
        for name in paths:
            fp.set_all(False)
            shared = agree if agree is not None and name != "device_sampler" else lambda _, why: why
            reason = "triton is not installed" if name in TRITON_PATHS and not triton_available() else None
            reason = shared(name, reason)
            if reason is None and name == "device_sampler":
                setattr(fp, name, True)
                reason = _attempt_sampler(sampler_check, ref[DECODE_STEPS - 1])  # every sequence's last step
            elif reason is None:
                setattr(fp, name, True)
                if name == "cuda_graphs" and "moe" in passed:  # the torch experts read counts to the host
                    fp.moe = True
                reason = shared(name, _attempt(runner, blocks, prompts, steps, ref, tol))
            if reason is None:
                passed.append(name)
            else:
                fp.disable(name, reason)
                log.warning("fast path %s off: %s", name, reason)
        fp.set_all(False)
        for name in passed:
            setattr(fp, name, True)
        model_paths = [p for p in passed if p != "device_sampler"]
        if len(model_paths) > 1:
            reason = _attempt(runner, blocks, prompts, steps, ref, tol)
            reason = agree("together", reason) if agree is not None else reason
            if reason is not None:
                for name in model_paths:
                    fp.disable(
                        name, f"together with {', '.join(p for p in model_paths if p != name)}: {reason}"
                    )
                log.warning(
                    "fast paths %s off: together they disagree with the reference: %s",
                    ", ".join(model_paths),
                    reason,
                )
    log.info("fast paths on: %s", ", ".join(fp.active()) or "none")
    return dict(fp.reasons)


def _attempt_sampler(check: Optional[SamplerCheck], logits: torch.Tensor) -> Optional[str]:
    if check is None:
        return "no check for the device sampler"
    try:
        return check(logits)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
