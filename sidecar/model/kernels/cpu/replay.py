"""CPU step replay: a decode step's C kernel calls recorded once, then replayed from C in one call.

On a CPU a decode step of a small model is ~220 kernel calls (norms, products, rope, attention per layer),
and the Python around each (module dispatch, checks, allocations, ctypes) costs more than the smaller
kernels themselves. The CUDA answer is a graph; this is the CPU one. ``record(step)`` runs ``step()`` once, eagerly,
with every kernel call (``cpu_build.KernelFunction``) logged with its arguments -- pointers into
tensors, sizes, flags -- and every tensor the step allocates noted. The plan lays those intermediate
tensors out anew in one scratch arena (two whose uses do not overlap share bytes: a step's worth of
activations, not one buffer per call) and keeps the pointers into them as arena offsets. ``Plan.replay``
then makes the same calls from C (``replay.c``): the same kernels on the same operands, so the same bits,
without the Python. What changes between replays are the contents of the buffers the step reads (token
rows, positions, KV slots, block tables, context lengths: see ``engine/cpu_graphs.py``), never their
addresses or sizes.

A step can be recorded only when all of its work runs in our kernels: a torch operator that computes
(anything but allocations and views) would be skipped by a replay, so ``record`` watches the step through
a dispatch mode and refuses it, naming the operator (``Unreplayable``). A kernel that refuses its
arguments at replay (a non-zero result) stops the replay (``Plan.replay`` returns False): the caller then
runs the step eagerly.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import platform
import sys
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I, P

_KERNEL = cpu_build.Kernel(
    "replay",
    {
        "sidecar_replay": ([P, I, P], I),
        "sidecar_replay_ints": ([], I),
        "sidecar_replay_floats": ([], I),
        "sidecar_replay_words": ([], I),
        "sidecar_replay_op_size": ([], I),
    },
)
# as replay.c's SIDECAR_REPLAY_INTS / _FLOATS / _WORDS (checked at load)
_INTS, _FLOATS, _WORDS = 20, 4, 20


class _Op(ctypes.Structure):
    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("checked", ctypes.c_int64),
        ("rel", ctypes.c_int64),
        ("a", ctypes.c_int64 * _INTS),
        ("f", ctypes.c_float * _FLOATS),
        ("args_at", ctypes.c_int64),
        ("args_rel", ctypes.c_int64),
        ("args", ctypes.c_int64 * _WORDS),
    ]


# Operators a recorded step may run besides our kernels: allocations (the recording keeps their results
# alive) and views (no data moves). Anything else computes, and a replay would skip it.
_ALLOCATIONS = {
    "aten::empty.memory_format",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
}
_VIEWS = {
    "aten::view",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::slice.Tensor",
    "aten::select.int",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::squeeze.dim",
    "aten::expand",
    "aten::as_strided",
    "aten::t",
    "aten::transpose.int",
    "aten::permute",
    "aten::alias",
    "aten::detach",
    "aten::split.Tensor",
    "aten::chunk",
    "aten::narrow",
    "aten::unbind.int",
    "aten::view_as",
    "aten::reshape_as",
}


def unavailable_reason() -> Optional[str]:
    """Why steps cannot be replayed here (None when they can)."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in (
        "x86_64",
        "amd64",
        "aarch64",
    ):
        return f"the replay's calling convention is not known on {sys.platform} {platform.machine()}"
    lib = _KERNEL.lib()
    if lib is None:
        return f"the replay kernel is not built: {cpu_build.reason('replay')}"
    if (
        lib.sidecar_replay_ints(),
        lib.sidecar_replay_floats(),
        lib.sidecar_replay_words(),
        lib.sidecar_replay_op_size(),
    ) != (_INTS, _FLOATS, _WORDS, ctypes.sizeof(_Op)):
        return "replay.c and replay.py disagree on the op layout"
    return None


class Unreplayable(RuntimeError):
    """The step ran work a replay would skip (a torch operator, or a kernel argument it cannot pass)."""


class Plan:
    """A recorded step. Its intermediate tensors are laid out anew in one scratch arena (``arena_bytes``;
    tensors whose uses do not overlap share bytes), so a plan holds only its op list: ``replay(arena)`` runs
    the calls with the arena, a uint8 CPU tensor of at least ``arena_bytes`` (one arena serves every plan,
    replayed one at a time), and ``output(arena)`` is the step's result in it, overwritten by the next
    replay."""

    ALIGN = 64

    def __init__(
        self,
        ops: list[tuple[cpu_build.KernelFunction, tuple]],
        kept: list[torch.Tensor],
        output: torch.Tensor,
    ) -> None:
        self.num_ops = len(ops)
        self.names = [fn.name for fn, _ in ops]
        storages = _storages(kept)
        bases = sorted(storages)
        uses: dict[int, list[int]] = {}  # storage base -> [first op, last op]

        def storage_of(ptr: int) -> Optional[int]:
            i = bisect.bisect_right(bases, ptr) - 1
            return bases[i] if i >= 0 and ptr < bases[i] + storages[bases[i]] else None

        for i, (fn, args) in enumerate(ops):
            for value in _pointers(fn, args):
                if (b := storage_of(value)) is not None:
                    uses.setdefault(b, [i, i])[1] = i
        outputs = _results(output)
        roots = [storage_of(t.data_ptr()) if t.is_contiguous() else None for t in outputs]
        if None in roots:
            raise Unreplayable("the step's result is not a contiguous tensor it allocated")
        for base in roots:
            uses.setdefault(base, [self.num_ops, self.num_ops])[1] = self.num_ops  # read after the replay
        offsets = _place(uses, storages, self.ALIGN)
        self.arena_bytes = max((offsets[b] + storages[b] for b in offsets), default=0)
        placed = [(offsets[b] + t.data_ptr() - b, t.dtype, tuple(t.shape)) for t, b in zip(outputs, roots)]
        # the result (the first tensor of a tuple result), then the tuple's further tensors
        self._out, self._more = placed[0], placed[1:]
        self._tuple = isinstance(output, tuple)
        self._ops = (_Op * max(1, len(ops)))()
        for i, (fn, args) in enumerate(ops):
            _encode(self._ops[i], fn, args, storage_of, offsets)
        self._fn = _KERNEL.lib().sidecar_replay.function  # the raw ctypes function: never itself recorded
        self._ptr = ctypes.addressof(self._ops)
        self._view: Optional[tuple[int, torch.Tensor]] = None
        self.refused: Optional[str] = None  # the kernel that stopped the last replay

    def replay(self, arena: torch.Tensor) -> bool:
        """Run the recorded calls over ``arena``; False when a kernel refused its arguments (``refused`` names
        it; the step is then incomplete: run it eagerly)."""
        if arena.dtype != torch.uint8 or arena.device.type != "cpu" or arena.numel() < self.arena_bytes:
            raise ValueError(f"replay: an arena of {self.arena_bytes} bytes (uint8, CPU) is needed")
        rc = self._fn(self._ptr, self.num_ops, arena.data_ptr())
        self.refused = None if rc == 0 else self.names[rc - 1]
        return rc == 0

    def same_calls(self, other: "Plan") -> bool:
        """Whether ``other`` makes the same calls with the same arguments over an arena laid out alike."""

        def calls(plan: "Plan") -> list:
            return [
                (op.fn, op.checked, op.rel, tuple(op.a), tuple(op.f), op.args_at, op.args_rel, tuple(op.args))
                for op in plan._ops[: plan.num_ops]
            ]

        return (
            self.num_ops == other.num_ops
            and self.arena_bytes == other.arena_bytes
            and self._out == other._out
            and self._more == other._more
            and calls(self) == calls(other)
        )

    def output(self, arena: torch.Tensor) -> Any:
        """The step's result (a tensor, or a tuple of tensors) as the last replay over ``arena`` left it."""
        if self._view is None or self._view[0] != arena.data_ptr():
            views = []
            for off, dtype, shape in (self._out, *self._more):
                n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                views.append(arena[off : off + n].view(dtype).view(shape))
            self._view = (arena.data_ptr(), tuple(views) if self._tuple else views[0])
        return self._view[1]


def _pointers(fn: cpu_build.KernelFunction, args: tuple):
    """The non-null pointers a recorded call passes: its pointer arguments and its argument struct's pointers."""
    for value, kind in zip(args, fn.argtypes):
        if kind is P and value:
            yield int(value)
        elif cpu_build._is_args(kind):
            for name, _ in _pointer_fields(kind):
                if getattr(value, name):
                    yield getattr(value, name)


def _pointer_fields(kind: type) -> list[tuple[str, int]]:
    """(name, offset) of an argument struct's pointer fields."""
    return [(f[0], getattr(kind, f[0]).offset) for f in kind._fields_ if f[1] is ctypes.c_void_p]


def _storages(kept: list[torch.Tensor]) -> dict[int, int]:
    """base address -> bytes of each distinct storage among ``kept``."""
    out: dict[int, int] = {}
    for t in kept:
        st = t.untyped_storage()
        if st.nbytes():
            out[st.data_ptr()] = st.nbytes()
    return out


def _place(uses: dict[int, list[int]], sizes: dict[int, int], align: int) -> dict[int, int]:
    """Arena offsets for the storages in ``uses`` (base -> [first, last] op): each at the lowest aligned
    offset where it overlaps no storage already placed whose span of ops overlaps its own."""
    live: list[tuple[int, int, int]] = []  # (offset, end, last) of those placed still in use, by offset
    offsets: dict[int, int] = {}
    for base, (first, last) in sorted(uses.items(), key=lambda kv: (kv[1][0], -sizes[kv[0]])):
        # in order of first use, so one placed before overlaps this one's span of ops iff still in use at its first
        live = [p for p in live if p[2] >= first]
        size = sizes[base]
        off = 0
        for o, e, _ in live:
            if off + size <= o:
                break
            off = max(off, -(-e // align) * align)
        offsets[base] = off
        bisect.insort(live, (off, off + size, last))
    return offsets


def _encode(
    op: _Op,
    fn: cpu_build.KernelFunction,
    args: tuple,
    storage_of: Callable[[int], Optional[int]],
    offsets: dict[int, int],
) -> None:
    """One recorded call into ``op``: pointers into the step's own tensors become arena offsets."""
    if len(args) != len(fn.argtypes):
        raise Unreplayable(f"{fn.name}: called with {len(args)} arguments, declared with {len(fn.argtypes)}")
    ints, floats, rel = [], [], 0
    for value, kind in zip(args, fn.argtypes):
        if cpu_build._is_args(kind):
            if op.args_at:
                raise Unreplayable(f"{fn.name}: more than one argument struct")
            _encode_args(op, value, storage_of, offsets)
            ints.append(0)  # the replay passes its copy of the struct here
            op.args_at = len(ints)
            continue
        if kind in (ctypes.c_float, ctypes.c_double):
            if kind is ctypes.c_double:
                raise Unreplayable(f"{fn.name}: a double argument")
            floats.append(float(value))
            continue
        v = 0 if value is None else int(value)
        if kind is P and v and (b := storage_of(v)) is not None:
            rel |= 1 << len(ints)
            v = offsets[b] + v - b
        ints.append(v)
    if len(ints) > _INTS or len(floats) > _FLOATS:
        raise Unreplayable(
            f"{fn.name}: {len(ints)} integer and {len(floats)} float arguments (the replay "
            f"passes at most {_INTS} and {_FLOATS})"
        )
    op.fn = fn.address
    op.checked = int(fn.restype is not None)
    op.rel = rel
    for i, v in enumerate(ints):
        op.a[i] = v
    for i, v in enumerate(floats):
        op.f[i] = v


def _encode_args(
    op: _Op, value: cpu_build.Args, storage_of: Callable[[int], Optional[int]], offsets: dict[int, int]
) -> None:
    """A recorded argument struct into ``op.args``: its pointers into the step's own tensors become arena
    offsets (their words' bits set in ``op.args_rel``)."""
    kind = type(value)
    size = ctypes.sizeof(kind)
    if size > 8 * _WORDS:
        raise Unreplayable(f"{kind.c_name}: {size} bytes (the replay passes at most {8 * _WORDS})")
    ctypes.memmove(op.args, ctypes.addressof(value), size)
    for name, offset in _pointer_fields(kind):
        v = getattr(value, name)
        if v and (b := storage_of(v)) is not None:
            if offset % 8:
                raise Unreplayable(f"{kind.c_name}.{name}: a pointer off an 8-byte boundary")
            op.args[offset // 8] = offsets[b] + v - b
            op.args_rel |= 1 << (offset // 8)


class _Guard(TorchDispatchMode):
    """Keeps what the step allocates and notes the first operator that computes (``dry``: stops the step there,
    before the operator runs on tensors no kernel has filled)."""

    def __init__(self, dry: bool = False) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []
        self.refused: Optional[str] = None
        self.dry = dry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if self.dry and name not in _ALLOCATIONS and name not in _VIEWS:
            raise Unreplayable(f"the step runs {name} outside our kernels")
        out = func(*args, **(kwargs or {}))
        if name in _ALLOCATIONS:
            self.kept.append(out)
        elif name in _VIEWS:
            if (
                name == "aten::reshape"
                and out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()
            ):
                self.refused = self.refused or "aten::reshape (a copy)"
        elif self.refused is None:
            self.refused = name
        return out


def record(step: Callable[[], Any], dry: bool = False) -> tuple[Any, Plan]:
    """Run ``step()`` eagerly, recording its kernel calls. Returns (its result, the plan replaying it); the
    result is a tensor or a tuple of tensors, each allocated by the step.
    Raises ``Unreplayable`` (after the step ran: its result is still right) when the step cannot be
    replayed. ``step`` must read its varying inputs only from buffers whose addresses stay fixed.

    ``dry``: plan the step without computing it -- its Python runs (the same calls, arguments and allocations
    as an eager run: nothing it decides may depend on what the kernels write) but no kernel is called, so its
    result holds nothing and nothing is written (the KV cache included) until the plan is replayed. Costs the
    step's Python alone. Also refused (``Unreplayable``, nothing written) when a tensor the step allocated is still held
    after it, by anything but the result: state a lazy set-up keeps would have been filled by a kernel."""
    reason = unavailable_reason()
    if reason is not None:
        raise Unreplayable(reason)
    ops: list[tuple[cpu_build.KernelFunction, tuple]] = []
    guard = _Guard(dry)
    cpu_build.set_recorder(lambda fn, args: ops.append((fn, _snapshot(args))) or dry)
    try:
        with guard:
            out = step()
    finally:
        cpu_build.set_recorder(None)
    if guard.refused is not None:
        raise Unreplayable(f"the step runs {guard.refused} outside our kernels")
    if not ops:
        raise Unreplayable("the step made no kernel calls")
    if not _results(out):
        raise Unreplayable("the step's result is not a tensor or a tuple of tensors")
    if dry:
        _check_released(guard.kept, out)
    return out, Plan(ops, guard.kept, out)


def _results(out: Any) -> list[torch.Tensor]:
    """The tensors of a step's result: a tensor, or a non-empty tuple of tensors (e.g. a pipeline stage's
    residual stream ``(h, delta)``); [] for anything else."""
    outs = list(out) if isinstance(out, tuple) else [out]
    return outs if outs and all(isinstance(t, torch.Tensor) for t in outs) else []


def _snapshot(args: tuple) -> tuple:
    """A recorded call's arguments, an argument struct copied as it is now (a caller may reuse it)."""
    return tuple(type(a).from_buffer_copy(a) if isinstance(a, cpu_build.Args) else a for a in args)


def _check_released(kept: list[torch.Tensor], out: Any) -> None:
    """Raises ``Unreplayable`` when a storage the step allocated (other than its result's) is referenced by more
    than its one tensor in ``kept``: something outside the step keeps it."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        raise Unreplayable("this torch does not say how many tensors hold a storage")
    results = {t.untyped_storage().data_ptr() for t in _results(out)}
    for t in kept:
        st = t.untyped_storage()
        # references: t's own, and ``st`` (this Python handle) -- any other is a tensor or view held elsewhere
        if st.data_ptr() not in results and st.nbytes() and use_count(st._cdata) > 2:
            raise Unreplayable(f"a {tuple(t.shape)} tensor the step allocated is held after it")
