"""The routed sum of a sparse block (moe.py) for a decode-sized step on the CPU in one kernel call.

``routed(moe, x, weights, ids)`` runs every (row, expert) slot of the step through ``sidecar_int8_moe``
(``kernels/cpu/int8_gemv.c``), ``sidecar_int4_moe`` (``kernels/cpu/int4_gemv.c``) or ``sidecar_bf16_moe``
(``kernels/cpu/bf16_gemv.c``; ``moe_args.h`` for all three): gate/up, silu * up, down and the weighted sum
in one parallel region, reading the experts' weights where their layers hold them (``Int8Linear`` /
``Int4Linear`` codes; a bf16 ``Linear``'s tiled or plain rows, each picked expert's read once for all of its
slots). No routing result is read back to Python: the kernel takes the ids and weights tensors as they are.
Each slot is the one-row product the expert's layer computes and the sum keeps moe.py's order, so the result
equals the per-expert loop's bit for bit.

The fast path refuses (returns None, and the per-expert loop runs) where it does not do a case: experts that
are not int8 / int4 layers in the CPU kernels' layouts (per-row int8 scales, unpadded inputs and outputs, no
biases, no codes kept for Triton) or bf16 layers the bf16 kernel reads (tiled or plain rows: not AMX's tile
layout nor oneDNN's packed one; widths of whole 32-value chunks), an activation other than silu, routers of
another form (Llama 4's scaled inputs, gpt-oss's softmax after top-k), more rows than ``MAX_ROWS`` (bf16: than
the layers' own kernel takes, ``Linear.kernel_rows``; int4 experts: steps of more rows, prefill chunks too, go
to ``moe_int4_batched``'s kernel), activations other than float32 / bf16 (bf16 experts: bf16), or a kernel that
did not build. The experts' address tables are built at first use (``CpuExperts.of``) and hold the tensors they
point into: the experts are fixed once loaded.
``self_check`` (at load) compares each block's fast path with its loop and leaves the loop on where they differ.

``kernel_route`` routes CPU steps of up to ``ROUTE_ROWS`` rows (decode batches) of every block whose router passed
that check, whatever its experts; ``decode_step(moe, x)`` runs such a step that ``routed`` takes (int4 experts:
past ``MAX_ROWS`` rows in their grouped kernel) with the router in a kernel too (``kernels/cpu/moe_route.c``): the
gate's logits (the block's ``gate`` layer: our bf16 kernel in a bf16 model), then the softmax, top-k and
renormalisation into the ids and weights ``routed`` reads, so the block makes kernel calls alone and a CPU
decode replay can record it. It runs only blocks whose router ``self_check`` found equal to torch's, bit for bit
(ids and weights, on probe rows, on ties and through the whole block): elsewhere torch's router runs, the
reason logged. The routers that pick first (gpt-oss's softmax after top-k, Llama 4's sigmoid) route in the
kernel too (``moe_route.route_picked``), though their experts stay with the loop (biased, clamped or scaled
inputs: the grouped kernels refuse them); subclasses that route their own way keep torch's, named.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch
from torch import nn

from sidecar.model import moe_cpu_layouts, moe_int4_batched
from sidecar.model.kernels.cpu import bf16_gemv, int4_gemv, int8_gemv, moe_route
from sidecar.model.kernels.cpu.moe_args import MoeArgs
from sidecar.model.linear import Linear

log = logging.getLogger("sidecar.model")

# Rows per step up to which the slots run one by one (each slot reads its expert's weights; a step of many
# rows leaves that to int4's grouped kernel or the per-expert loop, each picked expert read once a step). Below
# int4_gemv.TILE_MIN_ROWS, so no expert of the loop it must equal reaches the AMX tile kernel's row count.
MAX_ROWS = int4_gemv.TILE_MIN_ROWS - 1
# Rows per step up to which the router kernel routes it and ``decode_step`` runs it (batched decode steps: int4
# experts' grouped kernel takes them past MAX_ROWS); ``check_router`` probes a step of this many rows.
ROUTE_ROWS = 64
_FLOATS = (torch.float32, torch.bfloat16)


class CpuExperts:
    """The addresses of a sparse block's expert weights and scales (int64 tensors [E]), and the tensors they
    point into (held, so the addresses stay valid)."""

    __slots__ = ("fn", "extra", "tables", "held", "hidden", "inter", "rows", "dtypes", "batched")

    def __init__(self, fn, extra: dict, tables: list, held: list, hidden: int, inter: int, batched=None):
        self.fn, self.extra, self.tables, self.held = fn, extra, tables, held
        self.hidden, self.inter = hidden, inter
        self.rows, self.dtypes = MAX_ROWS, _FLOATS  # the steps it runs: rows, activation dtypes
        self.batched: Optional[moe_int4_batched.Batched] = batched  # int4: the kernel of steps of more rows

    def runs_many(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether int4 experts' grouped kernel runs a step of ``rows`` rows (past MAX_ROWS) in ``dtype``."""
        return moe_int4_batched.kernel(self.batched, rows, dtype) is not None

    @staticmethod
    def of(moe: nn.Module) -> Optional["CpuExperts"]:
        """The block's tables, built at its first step (None where the fast path does not run it, the reason
        logged once)."""
        got = moe.__dict__.get("_cpu_experts")
        if got is None:
            got = _build(moe)
            if isinstance(got, str):
                log.debug("moe: the grouped CPU expert path does not run this block: %s", got)
            moe.__dict__["_cpu_experts"] = got
        return got if isinstance(got, CpuExperts) else None


def self_check(blocks: Iterable[nn.Module], dtype: torch.dtype) -> int:
    """At load: each sparse block's (``moe.SparseMoE``) fast path against its per-expert loop on probe rows
    (one and three rows, in the model's ``dtype``); a block whose result differs in any bit keeps the loop
    from then on, the reason logged. Where it passes, int4 experts' kernel of steps of many rows is checked
    (``moe_int4_batched.check``), then the router kernel (``check_router``). Returns the blocks it runs."""
    blocks = list(blocks)
    ran = _check_experts(blocks, dtype)
    routed_here = sum(check_router(moe, dtype) for moe in blocks)
    if routed_here:
        log.info(
            "moe: %d of %d sparse blocks route decode steps in the router kernel", routed_here, len(blocks)
        )
    return ran


def _check_experts(blocks: list, dtype: torch.dtype) -> int:
    gen, ran = torch.Generator().manual_seed(0), 0
    for moe in blocks:
        ex = CpuExperts.of(moe)
        if ex is None:
            continue
        ok = True
        for rows in (1, 3):
            x = torch.randn(rows, ex.hidden, generator=gen).to(dtype)
            with torch.no_grad():
                weights, ids = moe.route_logits(moe.gate(x), x.dtype)  # torch's router, whatever routes steps
                ids, perm = ids.sort(dim=-1)
                fast = routed(moe, x, weights.gather(-1, perm), ids)
                ref = _reference(moe, x)
            ok = ok and fast is not None and torch.equal(fast, ref)
        if not ok:
            log.warning("moe: the grouped CPU expert path differs from the per-expert loop; the loop runs")
            moe.__dict__["_cpu_experts"] = "its self-check differed"
        elif ex.batched is not None:  # its own verdict: a failure leaves only steps of many rows to the loop
            x = torch.randn(MAX_ROWS + 5, ex.hidden, generator=gen).to(dtype)
            moe_int4_batched.check(moe, ex.batched, x, routed, _reference)
        ran += ok
    return ran


def _reference(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block over ``x`` through torch's router and the per-expert loop (``cpu_grouped`` off for the call)."""
    own = moe.__dict__.get("cpu_grouped")
    moe.cpu_grouped = False
    try:
        return moe(x)
    finally:
        if own is None:
            del moe.cpu_grouped
        else:
            moe.cpu_grouped = own


def router_refusal(moe: nn.Module) -> Optional[str]:
    """Why the router kernel cannot route this block (None when it can, once checked)."""
    # the block class that first defines the router (moe.SparseMoE, not imported here: moe.py imports this module)
    base = next(c for c in reversed(type(moe).__mro__) if "route_logits" in vars(c))
    if type(moe).route is not base.route or type(moe).route_logits is not base.route_logits:
        return f"{type(moe).__name__} routes its own way"
    if moe.top_k > moe_route.MAX_K:
        return f"{moe.top_k} experts per token (the kernel takes at most {moe_route.MAX_K})"
    return moe_route.unavailable_reason()


def _torch_routes(
    moe: nn.Module, logits: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's (weights, ids) of the logits, ids ascending in each row as ``SparseMoE.forward`` sorts them."""
    weights, ids = moe.route_logits(logits, dtype)
    ids, perm = ids.sort(dim=-1)
    return weights.gather(-1, perm), ids


def check_router(moe: nn.Module, dtype: torch.dtype) -> bool:
    """The router kernel against torch's router on probe rows of the model's ``dtype`` (the gate's logits of
    random rows of one and three rows; logits of a few values, so equal probabilities straddle the k-th place;
    the whole block's result against the per-expert loop's): where every id and weight is equal, bit for bit,
    ``decode_step`` routes the block in the kernel from now on; else torch routes it, the reason logged.
    Returns whether the kernel routes it."""
    why = router_refusal(moe)
    if why is not None:
        log.debug("moe: decode steps of this block route in torch: %s", why)
    else:
        why = _router_differs(moe, dtype)
        if why is not None:
            log.warning("moe: decode steps of this block route in torch: %s", why)
    moe.__dict__["_cpu_router"] = why or True
    return why is None


def _router_differs(moe: nn.Module, dtype: torch.dtype) -> Optional[str]:
    gen = torch.Generator().manual_seed(1)
    hidden, e = moe.gate.in_features, moe.num_experts
    with torch.no_grad():
        probes = [moe.gate(torch.randn(rows, hidden, generator=gen).to(dtype)) for rows in (1, 3, ROUTE_ROWS)]
        probes += [
            torch.randint(0, 3, (rows, e), generator=gen).to(probes[0].dtype) for rows in (4, ROUTE_ROWS)
        ]
        for logits in probes:
            got = _kernel_routes(moe, logits, dtype)
            want = _torch_routes(moe, logits, dtype)
            if got is None:
                return "the router kernel refused the block's logits"
            if not (torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])):
                return "the router kernel's ids or weights differ from torch's"
        for rows in (1, 3, MAX_ROWS + 2):  # the last: int4 experts' grouped kernel past the one-row slots
            x = torch.randn(rows, hidden, generator=gen).to(dtype)
            moe.__dict__["_cpu_router"] = True
            fast = moe(x)
            if not torch.equal(fast, _reference(moe, x)):
                return "the block routed in the router kernel differs from the per-expert loop"
    return None


def kernel_route(
    moe: nn.Module, logits: torch.Tensor, dtype: torch.dtype
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(weights, ids ascending) of a decode-sized step's gate ``logits`` [T, experts] (rows in ``dtype``) from
    the router kernel, or None where it does not route them (a router not checked equal to torch's, another
    step, ``cpu_grouped`` off: the reference)."""
    if not moe.cpu_grouped or moe.__dict__.get("_cpu_router") is not True or logits.device.type != "cpu":
        return None
    if logits.dim() != 2 or logits.shape[0] > ROUTE_ROWS or dtype not in _FLOATS:
        return None
    return _kernel_routes(moe, logits, dtype)


def _kernel_routes(
    moe: nn.Module, logits: torch.Tensor, dtype: torch.dtype
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The router kernel's (weights, ids ascending) of the logits in the block's form of router."""
    if moe.sigmoid_input or moe.softmax_after_topk:  # as route_logits: the sigmoid first
        form = moe_route.PICKED_SIGMOID if moe.sigmoid_input else moe_route.PICKED_SOFTMAX
        return moe_route.route_picked(logits.contiguous(), moe.top_k, form, dtype)
    wdtype = torch.float32 if moe.weights_float32 else dtype
    return moe_route.route(logits.contiguous(), moe.top_k, moe.norm_topk_prob, wdtype)


def decode_step(moe: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The routed sum [T, hidden] of rows ``x`` [T, hidden] with the router in its kernel and the experts in
    theirs (kernel calls alone), or None where the block or the step is not one it runs: a router not checked
    equal to torch's (``check_router``), or a step ``routed`` does not take."""
    if moe.__dict__.get("_cpu_router") is not True:
        return None
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] > ROUTE_ROWS or x.dtype not in _FLOATS:
        return None
    ex, t = CpuExperts.of(moe), x.shape[0]
    if ex is None or not (t <= ex.rows and x.dtype in ex.dtypes or t > MAX_ROWS and ex.runs_many(t, x.dtype)):
        return None
    got = kernel_route(moe, moe.gate(x), x.dtype)
    if got is None:
        return None
    return routed(moe, x, *got)


def _build_bf16(moe: nn.Module, hidden: int, inter: int):
    """``CpuExperts`` over bf16 experts for ``sidecar_bf16_moe`` (bf16_gemv.c), or the reason there are none.
    Steps run there only while each expert's own call would take the same kernel on its rows (up to its
    layer's ``kernel_rows``; oneDNN beyond)."""
    lib = bf16_gemv._KERNEL.lib()
    if lib is None or not lib._sidecar_bf16 or hidden % 32 or inter % 32:
        return "the bf16 kernel did not build, or widths that are not multiples of 32"
    tables: list[list[int]] = [[], []]
    held: list[torch.Tensor] = []
    layouts, rows = set(), MAX_ROWS
    for e in moe.experts:
        for i, (lin, n, k) in enumerate(((e.gate_up_proj, 2 * inter, hidden), (e.down_proj, hidden, inter))):
            got = moe_cpu_layouts.bf16_weight(lin, n, k)
            if isinstance(got, str):
                return got
            tables[i].append(got[0].data_ptr())
            held.append(got[0])
            layouts.add(got[1])
            rows = min(rows, lin.kernel_rows)
    if len(layouts) != 1:
        return "bf16 experts in more than one layout"
    gu, dn = (torch.tensor(t, dtype=torch.int64) for t in tables)
    zeros = torch.zeros_like(gu)  # no scales
    ex = CpuExperts(
        lib.sidecar_bf16_moe, {"tiled": layouts.pop()}, [gu, zeros, dn, zeros], held, hidden, inter
    )
    ex.rows, ex.dtypes = rows, (torch.bfloat16,)
    return ex


def _kernel(cls: type):
    """(function, extra MoeArgs fields) of the experts' mode, or the reason there is none."""
    if cls.mode == "int8":
        lib = int8_gemv._KERNEL.lib()
        return (lib.sidecar_int8_moe, {}) if lib is not None else "the int8 kernel did not build"
    lib, layout = int4_gemv._KERNEL.lib(), int4_gemv.torch_layout()
    if lib is None or layout is None or not lib.sidecar_int4_integer_dot():
        return "the int4 kernel did not build (or keeps float activations)"
    return lib.sidecar_int4_moe, {"block_n": layout[0], "split": int(layout[1])}


def _build(moe: nn.Module):
    """``CpuExperts`` for the block, or the reason it cannot have them."""
    from sidecar.model.quant import Int4Linear, Int8Linear

    if moe.sigmoid_input or moe.softmax_after_topk:
        return "the router's form"
    first = moe.experts[0]
    if first.clamp is not None or not first.silu:
        return "an activation other than silu"
    hidden, inter = first.down_proj.out_features, first.down_proj.in_features
    cls = type(first.gate_up_proj)
    if cls is Linear:
        return _build_bf16(moe, hidden, inter)
    if cls not in (Int8Linear, Int4Linear):
        return "experts that are not int8 / int4 / bf16 layers"
    kernel = _kernel(cls)
    if isinstance(kernel, str):
        return kernel
    fn, extra = kernel
    batched = None
    if cls is Int4Linear:
        extra["group_size"] = first.gate_up_proj.group_size
        lib, gs, e = int4_gemv._KERNEL.lib(), extra["group_size"], moe.num_experts
        batched = moe_int4_batched.build(lib, gs, hidden, inter, moe.top_k, e)
    tables: list[list[int]] = [[], [], [], []]
    held: list[torch.Tensor] = []
    for e in moe.experts:
        for i, (lin, n, k) in enumerate(((e.gate_up_proj, 2 * inter, hidden), (e.down_proj, hidden, inter))):
            ops = moe_cpu_layouts.operands(lin, cls, n, k)
            if ops is None or getattr(lin, "group_size", 0) != extra.get("group_size", 0):
                return "experts without biases, padding or another layout"
            tables[2 * i].append(ops[0].data_ptr())
            tables[2 * i + 1].append(ops[1].data_ptr())
            held += ops
    tabs = [torch.tensor(t, dtype=torch.int64) for t in tables]
    return CpuExperts(fn, extra, tabs, held, hidden, inter, batched)


def routed(
    moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> Optional[torch.Tensor]:
    """The routed sum [T, hidden] of rows ``x`` [T, hidden] whose experts ``ids`` [T, k] (ascending in each
    row) are weighed by ``weights`` [T, k], or None where the fast path does not run the step."""
    floats = x.dtype in _FLOATS and weights.dtype in _FLOATS and ids.dtype == torch.int64
    if x.device.type != "cpu" or x.dim() != 2 or not floats:
        return None
    ex = CpuExperts.of(moe)
    if ex is None or x.shape[1] != ex.hidden:
        return None
    t = x.shape[0]  # got: (kernel, rows a call)
    got = (ex.fn, t) if t <= ex.rows and x.dtype in ex.dtypes else None
    if got is None and t > MAX_ROWS:  # int4 experts: steps of many rows in the grouped kernel
        got = moe_int4_batched.kernel(ex.batched, t, x.dtype)
    if got is None:
        return None
    (fn, step), k = got, ids.shape[1]
    x, weights, ids, y = x.contiguous(), weights.contiguous(), ids.contiguous(), torch.empty_like(x)
    (gu, gus, dn, dns), row, rc = ex.tables, x.shape[1] * x.element_size(), 0  # row: bytes of a row of x, y
    for lo in range(0, t, step):  # calls of up to step rows (int4's grouped kernel: its scratch)
        rc = fn(
            MoeArgs(
                x=x.data_ptr() + lo * row,
                ids=ids.data_ptr() + lo * k * 8,
                weights=weights.data_ptr() + lo * k * weights.element_size(),
                gate_up=gu.data_ptr(),
                gate_up_scales=gus.data_ptr(),
                down=dn.data_ptr(),
                down_scales=dns.data_ptr(),
                y=y.data_ptr() + lo * row,
                T=min(step, t - lo),
                k=k,
                E=gu.shape[0],
                H=ex.hidden,
                I=ex.inter,
                nthreads=torch.get_num_threads(),
                x_bf16=x.dtype is torch.bfloat16,
                weights_bf16=weights.dtype is torch.bfloat16,
                **ex.extra,
            )
        )
        if rc:
            break
    if rc == 1:
        raise ValueError(f"moe: an expert id outside 0..{gu.shape[0] - 1}")
    if rc == 2:
        raise MemoryError("moe: out of memory for the grouped expert scratch")
    if rc == 3:  # a shape the kernel does not take: the loop runs this block from now on
        moe.__dict__["_cpu_experts"] = "a group size or width the kernel does not take"
        return None
    return y
