"""Mixture-of-experts MLP: a softmax router picks ``experts_per_token`` SwiGLU experts per token, whose outputs
are summed weighed by the router's probabilities.

Routing follows transformers: the router's logits in the model dtype, their softmax and top-k in float32,
the top-k probabilities renormalised where the family does (``norm_topk_prob``) and kept in float32
(Mixtral) or cast to the model dtype (Qwen3-MoE) before they weigh the outputs; a token's output is the
sum over its k slots in top-k order, in the dtype the weighted outputs promote to, as transformers' grouped
expert forward sums them.

Execution: the step's (token, slot) pairs are sorted by expert, and each expert that any row picked runs
once over all of its rows (``MLP``: a fused gate/up ``Linear`` with silu * up, then the down ``Linear``),
so its weights are read once per step; experts no row picked are not touched. A one-row step reads only
its k experts. The experts are plain per-expert ``Linear`` layers, so the CPU layouts, the int8 / int4
quantized layers and their kernels take them as they take the dense MLP's; an MXFP4 checkpoint's experts on the
CPU are ``mxfp4.Mxfp4Linear`` layers over their codes instead (read by the MXFP4 kernel). Decode-sized CPU
steps over int8 / int4 experts, or bf16 ones in our bf16 kernel's layouts, run in one kernel call instead
(``moe_cpu.py``), with the same result, as do int4 experts' steps of more rows, prefill chunks too, in calls of
a bounded scratch (``moe_int4_batched.py``); and
where the block's softmax router passed its load-time check, the router too (``kernels/cpu/moe_route.c``):
the gate, the router and the experts are then kernel calls alone, which a CPU decode replay records.

gpt-oss (``ModelArgs.softmax_after_topk``): the router has a bias, the top-k of its logits are softmaxed in the
model dtype, and the experts have biases and a clamped SwiGLU (``MLP``, layers.py).

Device fast path ``moe`` (``kernels/triton/moe.py``): with it on, every expert runs in two Triton launches
over the step's rows sorted by expert (no host reads: the step can be captured in a CUDA graph), reading the
experts' weights stacked [E, 2I, H] / [E, H, I] (``stacked``, built at load by ``stack_experts`` where the path
can run; on CUDA the experts' own weights become views of the stacks, so they are held once). Experts that are
not plain weights (quantized, MXFP4 codes) have no stacks: the torch path runs.

Llama 4 (``ModelArgs.router_sigmoid_input``): each of the top-k router logits goes through a sigmoid (float32,
cast to the model dtype) and scales the expert's input rather than its output; a shared expert
(``shared_expert_size``) sees every token, its output added to the routed sum. Qwen3-Next and Qwen3.5-MoE
(``shared_expert_gate``) scale the shared expert's output by the sigmoid of a one-output projection of the
token (``shared_expert_gate``, kept in full precision as the router is), in the model dtype.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from sidecar.model import moe_cpu
from sidecar.model.args import ModelArgs
from sidecar.model.kernels.gpu_paths import FastPaths
from sidecar.model.layers import MLP
from sidecar.model.linear import Linear
from sidecar.model.mxfp4 import Mxfp4Linear

Weight = Any  # a projection's weight: a tensor [out, in], or MXFP4 codes kept as they ship (``mxfp4.Codes``)


class SparseMoE(nn.Module):
    """``gate``: the router ([experts, hidden], no bias); ``experts``: one ``MLP`` per expert.
    ``cpu_grouped``: whether ``moe_cpu.routed`` and the router kernel may run a step (off: torch's router and
    the per-expert loop, the reference)."""

    cpu_grouped = True

    def __init__(self, args: ModelArgs, paths: Optional[FastPaths] = None) -> None:
        super().__init__()
        self.args = args
        self.num_experts, self.top_k = args.num_experts, args.experts_per_token
        self.norm_topk_prob = args.norm_topk_prob
        self.weights_float32 = args.routing_weights_float32
        self.softmax_after_topk = args.softmax_after_topk
        self.sigmoid_input = args.router_sigmoid_input
        self.gate = Linear(args.hidden_size, args.num_experts, bias=args.router_bias)
        expert = replace(args, intermediate_size=args.expert_intermediate_size, mlp_bias=args.expert_bias)
        self.experts = nn.ModuleList(MLP(expert, paths) for _ in range(args.num_experts))
        shared = replace(args, intermediate_size=args.shared_expert_size, mlp_bias=False)
        self.shared_expert = MLP(shared, paths) if args.shared_expert_size else None
        gated = args.shared_expert_size and args.shared_expert_gate
        self.shared_expert_gate = Linear(args.hidden_size, 1, bias=False) if gated else None
        self.fast_paths = paths
        self.stacked = None  # kernels/triton/moe.Experts, set by ``stack_experts``

    def stack(self, views: bool) -> bool:
        """Build ``stacked`` from the experts' weights when all are plain tensors of one float dtype or all
        MXFP4 codes (``stack_codes``); with ``views`` the experts' weights become views of the stacks.
        Returns whether it did."""
        from sidecar.model.kernels.triton.moe import Experts

        projs = [(e.gate_up_proj, e.down_proj) for e in self.experts]
        lins = [lin for pair in projs for lin in pair]
        if all(isinstance(lin, Mxfp4Linear) for lin in lins):
            return self.stack_codes(projs, views)
        if not all(type(lin) is Linear and lin.weight is not None for lin in lins):
            return False
        dtype = lins[0].weight.dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        if any(
            lin.weight.dtype != dtype or (lin.bias is not None and lin.bias.dtype != dtype) for lin in lins
        ):
            return False
        stacks = []
        for i in (0, 1):
            stacks.append(torch.stack([p[i].weight.detach() for p in projs]))
            has_bias = projs[0][i].bias is not None
            stacks.append(torch.stack([p[i].bias.detach() for p in projs]) if has_bias else None)
        self.stacked = Experts(*stacks)
        if views:
            for e, (gu, down) in enumerate(projs):
                gu.weight = nn.Parameter(self.stacked.gate_up[e], requires_grad=False)
                down.weight = nn.Parameter(self.stacked.down[e], requires_grad=False)
                if gu.bias is not None:
                    gu.bias = nn.Parameter(self.stacked.gate_up_bias[e], requires_grad=False)
                    down.bias = nn.Parameter(self.stacked.down_bias[e], requires_grad=False)
        return True

    def stack_codes(self, projs: list, views: bool) -> bool:
        """``stack`` for MXFP4 experts: codes [E, rows, cols / 2] and scales [E, rows, cols / 32] kept as they
        are (``kernels/triton/moe.Experts``), biases stacked in their dtype."""
        from sidecar.model.kernels.triton.moe import Experts

        parts: list = []
        for i in (0, 1):
            lins = [p[i] for p in projs]
            codes = torch.stack([lin.blocks.flatten(-2) for lin in lins])
            scales = torch.stack([lin.scales for lin in lins])
            has_bias = lins[0].bias is not None and lins[0].bias.device.type != "meta"
            parts.append(
                (codes, torch.stack([lin.bias.detach() for lin in lins]) if has_bias else None, scales)
            )
        (gu, gu_b, gu_s), (dn, dn_b, dn_s) = parts
        self.stacked = Experts(gu, gu_b, dn, dn_b, gu_s, dn_s)
        if views:
            for e, (g, d) in enumerate(projs):
                for lin, (codes, bias, scales) in ((g, parts[0]), (d, parts[1])):
                    lin.blocks = codes[e].view(lin.blocks.shape)
                    lin.scales = scales[e]
                    if bias is not None:
                        lin.bias = nn.Parameter(bias[e], requires_grad=False)
        return True

    def _triton_takes(self, x: torch.Tensor) -> bool:
        """Whether the Triton grouped GEMM runs this step (stacked experts, the ``moe`` path on for ``x``)."""
        return self.stacked is not None and self.fast_paths is not None and self.fast_paths.takes("moe", x)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """The routed sum by the Triton grouped GEMM, or None where it does not run."""
        if not self._triton_takes(x):
            return None
        from sidecar.model.kernels.triton import moe as triton_moe

        mlp = self.experts[0]
        if mlp.clamp is not None:
            act, (limit, alpha) = triton_moe.CLAMPED_SWIGLU, mlp.clamp
        else:
            act, limit, alpha = (triton_moe.SILU if mlp.silu else triton_moe.GELU_TANH), 0.0, 0.0
        return triton_moe.grouped_moe(x, weights, ids, self.stacked, act, limit, alpha, self.sigmoid_input)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of the rows ``x`` [T, hidden], best first -- or, where the router
        kernel routes the step (``moe_cpu.kernel_route``: decode-sized CPU steps of a block whose router passed its
        load-time check), ascending ids, as ``forward`` sorts them anyway; the same set and weights."""
        logits = self.gate(x)
        fast = moe_cpu.kernel_route(self, logits, x.dtype)
        return fast if fast is not None else self.route_logits(logits, x.dtype)

    def route_logits(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``route`` from the gate's logits [T, experts] of rows in ``dtype``."""
        if self.sigmoid_input:
            logits, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.sigmoid(logits.float()).to(dtype), ids
        if self.softmax_after_topk:
            logits, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1), ids
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_float32 else weights.to(dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape[0], self.top_k
        # decode-sized CPU steps in kernel calls alone: the router's, then the grouped experts' (moe_cpu.py)
        if self.cpu_grouped and not self._triton_takes(x):
            fast = moe_cpu.decode_step(self, x)
            if fast is not None:
                return self._plus_shared(x, fast)
        weights, ids = self.route(x)
        # Each token's experts in ascending id: transformers adds the experts' outputs to a token in that
        # order (one index_add per expert), and the sum below keeps it, so float32 results match to the bit.
        ids, perm = ids.sort(dim=-1)
        weights = weights.gather(-1, perm)
        fast = self._grouped(x, weights, ids)
        # decode-sized CPU steps over int8 / int4 / bf16 experts (moe_cpu.py)
        if fast is None and self.cpu_grouped:
            fast = moe_cpu.routed(self, x, weights, ids)
        if fast is not None:
            return self._plus_shared(x, fast)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the T * k slots grouped by expert, experts ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        slot_weights = weights.reshape(-1).index_select(0, order).unsqueeze(1)
        slots = x.new_empty((t * k, x.shape[1]), dtype=torch.promote_types(x.dtype, weights.dtype))
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            end = start + n
            rows = x if t == 1 else x.index_select(0, tokens[start:end])
            w = slot_weights[start:end]
            out = self.experts[e](rows * w) if self.sigmoid_input else self.experts[e](rows) * w
            slots.index_copy_(0, order[start:end], out)
            start = end
        per = slots.view(t, k, -1)
        routed = per[:, 0].to(x.dtype)
        for j in range(1, k):  # one add at a time, each in x's dtype, as transformers' index_add does
            routed = routed + per[:, j].to(x.dtype)
        return self._plus_shared(x, routed)

    def _plus_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The routed sum plus the shared expert's output (gated where the family gates it)."""
        if self.shared_expert is None:
            return routed
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return routed + shared


def stack_experts(model: nn.Module, device: torch.device) -> int:
    """Stack every sparse block's experts (``SparseMoE.stack``) where the ``moe`` path can run: on CUDA (the
    experts' weights then views of the stacks) and under Triton's interpreter on CPU (copies: the CPU layouts
    may take the plain weights' pages). Returns how many blocks were stacked."""
    from sidecar.model.kernels.gpu_paths import triton_available, triton_interpreted

    if not (device.type == "cuda" or triton_interpreted()) or not triton_available():
        return 0
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    return sum(m.stack(views=device.type == "cuda") for m in blocks)


def has_stacked_experts(model: nn.Module) -> bool:
    """Whether a sparse block of ``model`` has stacked experts (the ``moe`` path has something to run)."""
    return any(getattr(m, "stacked", None) is not None for m in model.modules() if isinstance(m, SparseMoE))


def block_prefix(has: Callable[[str], bool], layer_prefix: str, args: ModelArgs) -> str:
    """The sparse block's name in a checkpoint: the family's own (the hub's layout, e.g. Mixtral's
    ``block_sparse_moe``), else transformers' module name ``mlp`` (its fused layout)."""
    own = f"{layer_prefix}.{args.moe_names[0]}"
    return own if has(f"{own}.gate.weight") else f"{layer_prefix}.mlp"


def _deinterleaved(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate/up outputs alternate (gate 2j, up 2j + 1) along dim 0: gate rows first, then up."""
    return torch.cat((t[0::2], t[1::2]))


def _gpt_oss_experts(
    get: Callable[[str], torch.Tensor], has: Callable[[str], bool], prefix: str, args: ModelArgs, codes: bool
) -> Iterator[tuple[int, Weight, torch.Tensor, Weight, torch.Tensor]]:
    """transformers' gpt-oss layout: ``experts.gate_up_proj`` [experts, hidden, 2 * width] with gate and up
    columns interleaved, ``experts.down_proj`` [experts, width, hidden] (inputs first), their biases
    ``*_bias``; or the MXFP4 form of the published checkpoints (``*_blocks`` / ``*_scales``, outputs
    first: mxfp4.py), kept as ``mxfp4.Codes`` where ``codes``, else dequantized one expert at a time."""
    from sidecar.model import mxfp4

    p = f"{prefix}.experts"
    packed = has(f"{p}.gate_up_proj_blocks")
    weights = {}
    for name in ("gate_up_proj", "down_proj"):
        if packed:
            weights[name] = (get(f"{p}.{name}_blocks"), get(f"{p}.{name}_scales"))
        else:
            weights[name] = get(f"{p}.{name}")
    gu_bias, down_bias = get(f"{p}.gate_up_proj_bias"), get(f"{p}.down_proj_bias")
    for e in range(args.num_experts):
        if packed and codes:  # rows are whole: the gate/up rows are reordered as the dequantized ones are
            (gb, gs), (db, ds) = weights.values()
            gu = mxfp4.Codes(_deinterleaved(gb[e]), _deinterleaved(gs[e]))
            down = mxfp4.Codes(db[e].clone(), ds[e].clone())  # its own bytes, not a view of the layer's
            yield e, gu, _deinterleaved(gu_bias[e]), down, down_bias[e]
            continue
        if packed:
            gu, down = (mxfp4.dequantize(b[e], s[e], torch.float32) for b, s in weights.values())
        else:
            gu, down = weights["gate_up_proj"][e].t(), weights["down_proj"][e].t()
        yield e, _deinterleaved(gu), _deinterleaved(gu_bias[e]), down, down_bias[e]


def expert_weights(
    get: Callable[[str], torch.Tensor],
    has: Callable[[str], bool],
    prefix: str,
    args: ModelArgs,
    codes: bool = False,
    skip: Callable[[int], bool] = lambda e: False,
) -> Iterator[tuple[int, Weight, Optional[torch.Tensor], Weight, Optional[torch.Tensor]]]:
    """(expert, gate/up [2 * width, hidden] gate rows first, its bias or None, down [hidden, width], its
    bias or None) for each expert of the sparse block at ``prefix`` (e.g. ``model.layers.3.mlp``), from the
    hub's per-expert tensors (``experts.<e>.<gate|up|down>.weight``), transformers' fused ones
    (``experts.gate_up_proj`` [experts, 2 * width, hidden] and ``experts.down_proj`` [experts, hidden,
    width]) or gpt-oss's (``_gpt_oss_experts``; MXFP4 weights as ``mxfp4.Codes`` where ``codes``). Per-expert
    tensors of the experts ``skip`` names are not read (built already from a hub-quantized file's codes)."""
    if args.expert_bias:
        yield from _gpt_oss_experts(get, has, prefix, args, codes)
        return
    _, gate, up, down = args.moe_names
    fused = f"{prefix}.experts.gate_up_proj"
    if has(fused):
        gate_up, downs = get(fused), get(f"{prefix}.experts.down_proj")
        for e in range(args.num_experts):
            yield e, gate_up[e], None, downs[e], None
        return
    for e in (e for e in range(args.num_experts) if not skip(e)):
        p = f"{prefix}.experts.{e}"
        gu = torch.cat((get(f"{p}.{gate}.weight"), get(f"{p}.{up}.weight")))
        yield e, gu, None, get(f"{p}.{down}.weight"), None


def block_tensors(
    moe: SparseMoE,
    get: Callable[[str], torch.Tensor],
    has: Callable[[str], bool],
    layer_prefix: str,
    codes: bool = False,
) -> Iterator[tuple[Optional[nn.Module], list[tuple[nn.Module, str, torch.Tensor]]]]:
    """The checkpoint tensors of the sparse block ``moe`` of the layer at ``layer_prefix``, as (owner,
    [(module, parameter name, tensor)]): first the router's (owner None), then each expert's (owner: the
    expert's ``MLP``, complete once its tensors are set, so a loader may quantize it then), then the shared
    expert's where the block has one (``shared_expert.{gate,up,down}_proj``). With ``codes`` an MXFP4
    projection becomes an ``mxfp4.Mxfp4Linear`` over its codes here, and only its bias is listed."""
    from sidecar.model import mxfp4

    args = moe.args
    prefix = block_prefix(has, layer_prefix, args)
    router = f"{prefix}.router" if has(f"{prefix}.router.weight") else f"{prefix}.gate"
    parts = [(moe.gate, "weight", get(f"{router}.weight"))]
    if args.router_bias:
        parts.append((moe.gate, "bias", get(f"{router}.bias")))
    if moe.shared_expert_gate is not None:
        parts.append((moe.shared_expert_gate, "weight", get(f"{prefix}.shared_expert_gate.weight")))
    yield None, parts

    def built(e: int) -> bool:  # both projections in place already (hub-quantized codes, hf_quant.py)
        return not any(isinstance(m, nn.Linear) and m.weight.is_meta for m in moe.experts[e].children())

    for e, gate_up, gate_up_bias, down, down_bias in expert_weights(get, has, prefix, args, codes, built):
        expert = moe.experts[e]
        parts = []
        for attr, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
            if isinstance(weight, mxfp4.Codes):
                setattr(expert, attr, mxfp4.Mxfp4Linear(weight, getattr(expert, attr).bias is not None))
            else:
                parts.append((getattr(expert, attr), "weight", weight))
        if gate_up_bias is not None:
            parts += [(expert.gate_up_proj, "bias", gate_up_bias), (expert.down_proj, "bias", down_bias)]
        yield expert, parts
    if moe.shared_expert is not None:
        s = f"{prefix}.shared_expert"
        gate_up = torch.cat((get(f"{s}.gate_proj.weight"), get(f"{s}.up_proj.weight")))
        shared = moe.shared_expert
        yield (
            shared,
            [
                (shared.gate_up_proj, "weight", gate_up),
                (shared.down_proj, "weight", get(f"{s}.down_proj.weight")),
            ],
        )
