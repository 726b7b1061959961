"""Hub-quantized checkpoints: a directory whose ``config.json`` carries the producing tool's
``quantization_config`` (GPTQ, AWQ, compressed-tensors), served on our own weight-only modules.

``parse_quant_config`` is the one dispatch by ``quant_method`` (``QUANT_METHODS``; compressed-tensors then by
its ``format``, ``COMPRESSED_TENSORS_FORMATS``): each entry validates its fields, raising ValueError naming
the one it refuses (``quantization_config.bits: 3 is not supported``), and returns a ``Scheme`` that builds
the runtime module of one (possibly fused) linear from the checkpoint. ``load_hf_quantized`` swaps those
modules into a model on the meta device before the loader reads everything else; linears the tool left in
full precision (its ignore list: no quantized tensors in the file) load as usual.

4-bit formats become ``Int4Linear`` (torch's int4 layout, zero points folded into its zeros; act-order input
columns permuted at load and the activations at run time, ``PermutedLinear``), per-channel 8-bit ones
``Int8Linear`` (asymmetric zero points that move codes outside int8: shifted codes plus a per-row offset
times the activations' sum, ``OffsetLinear``): the codes are converted exactly (``hf_quant_formats.py``),
never widened to float. The first layer of each kind is checked once against the tool's dequantized weight;
a kind that fails is logged and its layers run as dense float weights instead (the reference path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn

from sidecar.config import lm_head_quantization
from sidecar.model.hf_quant_formats import (
    Source,
    awq_source,
    compressed_source,
    gptq_source,
    int4_operands,
    int8_operands,
)
from sidecar.model.linear import Linear
from sidecar.model.moe import block_prefix
from sidecar.model.quant import Int4Linear, Int8Linear
from sidecar.model.quant_format import release_freed_memory

log = logging.getLogger("sidecar.model")


@dataclass(frozen=True)
class Scheme:
    """How one checkpoint's quantized linears are stored and built."""

    label: str  # the format as reported (LoadedModel.quantization, /v1/models, the start line)
    marker: str  # tensor suffix present exactly for the linears the tool quantized
    # (get, has, names, in_features, bias, dtype, device, checks) -> the runtime module of the linear whose
    # checkpoint parts are ``names`` (fused in that order); ``checks``: kind -> self-check verdict, per load
    make: Callable[..., nn.Module]


class PermutedLinear(nn.Module):
    """A quantized linear whose input columns were reordered at load so its groups are contiguous
    (act-order): computes ``inner(x[..., perm])``. The gather is a torch operator, so CPU decode steps of
    such a model run eagerly (the step replay refuses them), as do those of ``ConcatLinear``."""

    def __init__(self, inner: nn.Module, perm: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.in_features, self.out_features = inner, inner.in_features, inner.out_features
        self.register_buffer("perm", perm)

    @property
    def mode(self) -> str:
        return self.inner.mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))


class OffsetLinear(nn.Module):
    """An asymmetric 8-bit linear: ``inner(x) + sum(x) * offsets``, the int8 codes of ``inner`` shifted
    off their zero points (``int8_operands``) and the per-row remainder of the zero point added here, in
    float32. Torch operators: its CPU decode steps run eagerly, as those of ``PermutedLinear``."""

    def __init__(self, inner: nn.Module, offsets: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.in_features, self.out_features = inner, inner.in_features, inner.out_features
        self.register_buffer("offsets", offsets.float())

    @property
    def mode(self) -> str:
        return self.inner.mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x).float() + x.float().sum(-1, keepdim=True) * self.offsets
        return y.to(x.dtype)


class ConcatLinear(nn.Module):
    """Fused projections whose parts cannot share one module (different act-order permutations): the parts'
    outputs side by side."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    @property
    def mode(self) -> str:
        return self.parts[0].mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _field(
    qc: dict, key: str, allowed: tuple, default: Any = None, label: str = "quantization_config"
) -> Any:
    value = qc.get(key, default)
    if value not in allowed:
        raise ValueError(
            f"{label}.{key}: {value!r} is not supported (one of {', '.join(map(repr, allowed))})"
        )
    return value


def _group_size(qc: dict, key: str = "group_size", label: str = "quantization_config") -> int:
    value = -1 if qc.get(key) is None else qc[key]
    if not isinstance(value, int) or isinstance(value, bool) or not (value == -1 or value > 0):
        raise ValueError(f"{label}.{key}: {value!r} is not supported (a positive integer or -1)")
    if value != -1 and value % 32:
        raise ValueError(f"{label}.{key}: {value} is not supported (a multiple of 32, or -1 for per-channel)")
    return value


def _check_bits(bits: int, group_size: int, label: str = "quantization_config", key: str = "bits") -> None:
    if bits == 8 and group_size != -1:
        raise ValueError(
            f"{label}.{key}: 8 with group_size {group_size} is not supported "
            "(the int8 kernels hold one scale per output channel: group_size -1 / channel strategy)"
        )


def _gptq(qc: dict) -> Scheme:
    bits = _field(qc, "bits", (4, 8))
    group_size = _group_size(qc)
    _check_bits(bits, group_size)
    _field(qc, "sym", (True, False), True)
    _field(qc, "desc_act", (True, False), False)
    key = "checkpoint_format" if "checkpoint_format" in qc else "format"
    fmt = _field(qc, key, ("gptq", "gptq_v2"), "gptq")
    # v1 stores the zeros word minus one in every field (GPTQModel's v2 -> v1); v2 stores them as they are.
    read = partial(gptq_source, bits=bits, zero_offset=1 if fmt == "gptq" else 0)
    return _grouped_scheme(
        f"gptq-int{bits}", "qweight", lambda get, has, n, k: read(get, has, n, in_features=k)
    )


def _awq(qc: dict) -> Scheme:
    _field(qc, "bits", (4,), qc.get("w_bit"))
    _group_size(qc, "group_size" if "group_size" in qc else "q_group_size")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version: {qc.get('version')!r} is not supported ('gemm')")
    _field(qc, "zero_point", (True,), True)
    return _grouped_scheme("awq-int4", "qweight", lambda get, has, n, k: awq_source(get, n))


def _ct_pack_quantized(qc: dict, weights: dict, where: str) -> Scheme:
    bits = _field(weights, "num_bits", (4, 8), label=where)
    _field(weights, "type", ("int",), label=where)
    strategy = _field(weights, "strategy", ("group", "channel"), label=where)
    group_size = -1 if strategy == "channel" else _group_size(weights, label=where)
    _check_bits(bits, group_size, label=where, key="num_bits")
    sym = _field(weights, "symmetric", (True, False), True, label=where)
    read = partial(compressed_source, bits=bits, symmetric=sym)
    return _grouped_scheme(
        f"compressed-tensors-w{bits}a16", "weight_packed", lambda get, has, n, k: read(get, has, n)
    )


# compressed-tensors formats: (quantization_config, the weights' args, the field path naming them) -> Scheme.
COMPRESSED_TENSORS_FORMATS: dict[str, Callable[[dict, dict, str], Scheme]] = {
    "pack-quantized": _ct_pack_quantized,
}


def _compressed_tensors(qc: dict) -> Scheme:
    _field(qc, "quantization_status", ("compressed",), "compressed")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"quantization_config.sparsity_config: {sparsity.get('format')!r} is not supported")
    if qc.get("transform_config"):
        raise ValueError("quantization_config.transform_config: weight transforms are not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError("quantization_config.config_groups: must hold exactly one quantization scheme")
    ((name, group),) = groups.items()
    where = f"quantization_config.config_groups.{name}"
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise ValueError(f"{where}.weights: must be an object")
    fmt = group.get("format") or qc.get("format")
    if fmt not in COMPRESSED_TENSORS_FORMATS:
        raise ValueError(f"quantization_config.format: {fmt!r} is not supported")
    if fmt == "pack-quantized" and group.get("input_activations") is not None:
        raise ValueError(f"{where}.input_activations: activation quantization is not supported with {fmt}")
    return COMPRESSED_TENSORS_FORMATS[fmt](qc, group["weights"], f"{where}.weights")


# quant_method -> the parser of its quantization_config.
QUANT_METHODS: dict[str, Callable[[dict], Scheme]] = {
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed_tensors,
}


def _eight_bit(qc: Any) -> bool:
    """Whether the 8-bit loader (``hf8bit.py``) owns this config: the ``fp8`` method, or compressed-tensors
    whose schemes are all ``int-quantized`` (W8A8) or ``float-quantized`` (FP8)."""
    from sidecar.model.hf8bit import CT_FORMATS

    if not isinstance(qc, dict) or qc.get("quant_method") not in ("fp8", "compressed-tensors"):
        return False
    if qc["quant_method"] == "fp8":
        return True
    groups = qc.get("config_groups")
    groups = list(groups.values()) if isinstance(groups, dict) else []
    formats = {(g.get("format") if isinstance(g, dict) else None) or qc.get("format") for g in groups}
    return bool(formats) and formats <= set(CT_FORMATS)


def parse_quant_config(qc: Any) -> Scheme:
    """The Scheme of a ``config.json``'s ``quantization_config``; ValueError naming the field it refuses."""
    if not isinstance(qc, dict):
        raise ValueError("quantization_config: must be an object")
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(
            f"quantization_config.quant_method: {method!r} is not supported "
            f"(one of {', '.join([*QUANT_METHODS, 'fp8'])})"
        )
    return QUANT_METHODS[method](qc)


def _grouped_scheme(label: str, marker: str, read: Callable[..., Source]) -> Scheme:
    return Scheme(label, marker, partial(_grouped_linear, label, read))


def _grouped_linear(label, read, get, has, names, in_features, bias, dtype, device, checks) -> nn.Module:
    """One (possibly fused) linear: one module where the parts group their input columns alike (always so
    without act-order; with it, where the tool ordered them by the same activations), else one per part."""
    sources = [read(get, has, n, in_features) for n in names]
    groups = sources[0].group_index()
    if all(torch.equal(s.group_index(), groups) for s in sources[1:]):
        if len(sources) > 1:
            parts = [torch.cat([getattr(s, f) for s in sources]) for f in ("codes", "scales", "zeros")]
            sources = [Source(*parts, sources[0].g_idx, sources[0].bits)]
        return _checked_runtime(label, sources[0], names[0], in_features, bias, dtype, device, checks)
    biases = [None] * len(sources) if bias is None else bias.split([s.codes.shape[0] for s in sources])
    return ConcatLinear(
        [
            _checked_runtime(label, s, n, in_features, b, dtype, device, checks)
            for s, n, b in zip(sources, names, biases)
        ]
    )


def _checked_runtime(label, src: Source, name, in_features, bias, dtype, device, checks) -> nn.Module:
    """The runtime module of one Source; the first of each kind is compared with the dequantized weight
    (one small product), and a kind that is off runs its layers dense instead, with the reason logged."""
    offsets = None
    if src.bits == 4:
        q, s, z, perm = int4_operands(src, name)
        module = Int4Linear(q.to(device), s.to(device), z.to(device), in_features, bias, dtype)
    else:
        q, s, perm, offsets = int8_operands(src, name)
        module = Int8Linear(q.to(device), s.to(device), in_features, bias, dtype)
    if perm is not None:
        module = PermutedLinear(module, perm.to(device))
    if offsets is not None:
        module = OffsetLinear(module, offsets.to(device))
    kind = f"{label}{' act-order' if perm is not None else ''}{' offset' if offsets is not None else ''}"
    if kind not in checks:
        checks[kind] = _self_check(module, src, bias, dtype, device)
        if checks[kind]:
            log.warning("%s layers run dense: %s (%s)", kind, checks[kind], name)
    if not checks[kind]:
        return module
    dense = Linear(in_features, src.codes.shape[0], bias=bias is not None, device=device, dtype=dtype)
    dense.weight = nn.Parameter(src.dequantize().to(device, dtype), requires_grad=False)
    if bias is not None:
        dense.bias = nn.Parameter(bias, requires_grad=False)
    return dense


_CHECK_ROWS = 512  # output rows the self-check compares: every group and column of the layout, little memory


def _self_check(module: nn.Module, src: Source, bias, dtype, device) -> str:
    """'' when ``module`` computes the tool's dequantized weight's product (within the kernels' bf16
    scales and activations), else why not."""
    rows = min(src.codes.shape[0], _CHECK_ROWS)
    head = Source(src.codes[:rows], src.scales[:rows], src.zeros[:rows], src.g_idx, src.bits)
    x = torch.randn(3, src.codes.shape[1], generator=torch.Generator().manual_seed(0))
    ref = x @ head.dequantize().T + (0.0 if bias is None else bias[:rows].float().cpu())
    with torch.no_grad():
        y = module(x.to(device, dtype))[:, :rows].float().cpu()
    err, bound = float((y - ref).abs().max()), 0.02 * float(ref.abs().max()) + 1e-3
    return "" if err <= bound else f"off from the dequantized reference by {err:.3g} (bound {bound:.3g})"


def head_quantization(label: str, setting: str, head: Optional[nn.Module] = None) -> Optional[str]:
    """The mode of the full-precision head (and a tied embedding) of a file quantized as ``label``: what
    ``quantize_lm_head`` (``setting``) gives our own weights of its width (int4 for the 4-bit formats, int8
    for the 8-bit ones): int8 by default; ``none`` keeps it as the file has it. A head the file holds
    quantized (``head``, loaded) stays as it is; ValueError where ``setting`` is none for one."""
    if setting == "none" and head is not None and not isinstance(head, nn.Linear):
        raise ValueError(
            f"quantize_lm_head: none keeps the head in full precision, but the checkpoint's lm_head is "
            f"quantized ({label}); leave it auto or same"
        )
    bits = "int4" if label.endswith(("int4", "w4a16")) else "int8"
    return lm_head_quantization(bits, setting)


def load_hf_quantized(
    model: nn.Module, ckpt: Any, hf_config: dict, requested: Optional[str], dtype, device
) -> Optional[str]:
    """Swap in the runtime modules of every quantized linear of ``model`` (on the meta device) from the
    checkpoint ``ckpt`` (``get(name)``, ``name in ckpt``); returns the format's label (for MXFP4 experts, which
    load dequantized, the ``requested`` mode). ValueError naming the problem: a refused ``quantization_config``
    field, a ``quantization`` asked on top of it, an unsupported layout."""
    qc = hf_config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":
        # gpt-oss's published experts: moe.py reads their blocks and scales, kept as codes or dequantized (mxfp4.py)
        if not model.args.num_experts:
            raise ValueError("quantization_config.quant_method: 'mxfp4' is supported for expert weights only")
        return requested  # a quantize-on-load mode dequantizes them, then quantizes as full-precision ones
    if _eight_bit(qc):
        from sidecar.model.hf8bit import preload_8bit

        return preload_8bit(model, ckpt, qc, requested, dtype, device)
    scheme = parse_quant_config(qc)
    if requested is not None:
        raise ValueError(
            f"quantization: the checkpoint is already quantized ({scheme.label}); leave it unset"
        )
    args = model.args
    for i in (i for i in range(len(model.layers)) if args.sparse(i)):
        block = model.layers[i].mlp  # per-expert SwiGLU experts only (Mixtral, Qwen3-MoE)
        if (
            args.expert_bias
            or getattr(block, "shared_expert", None) is not None
            or hasattr(block, "block_tensors")
        ):
            raise ValueError(
                f"quantization_config: {scheme.label} experts of {args.architecture} are not supported"
            )
    checks: dict[str, str] = {}

    def swap(parent: nn.Module, attr: str, names: list[str]) -> None:
        marked = [f"{n}.{scheme.marker}" in ckpt for n in names]
        if not any(marked):
            return  # left in full precision by the tool
        if not all(marked):
            raise ValueError(f"model: {', '.join(names)} are quantized only in part")
        meta = getattr(parent, attr)
        bias = None
        if meta.bias is not None:
            bias = torch.cat([ckpt.get(f"{n}.bias") for n in names]).to(device, dtype)
        module = scheme.make(
            ckpt.get, ckpt.__contains__, names, meta.in_features, bias, dtype, device, checks
        )
        setattr(parent, attr, module)
        release_freed_memory()  # the conversion's scratch: the heap grows by the codes kept only

    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        fused = args.fused_checkpoint
        swap(
            layer.self_attn,
            "qkv_proj",
            [f"{p}.self_attn.qkv_proj"] if fused else [f"{p}.self_attn.{x}_proj" for x in "qkv"],
        )
        swap(layer.self_attn, "o_proj", [f"{p}.self_attn.o_proj"])
        if args.sparse(i):  # each expert as a linear of its own; the router stays as the tool left it
            _, gate, up, down = args.moe_names
            at = f"{block_prefix(ckpt.__contains__, p, args)}.experts"
            for e, expert in enumerate(layer.mlp.experts):
                swap(expert, "gate_up_proj", [f"{at}.{e}.{gate}", f"{at}.{e}.{up}"])
                swap(expert, "down_proj", [f"{at}.{e}.{down}"])
            continue
        swap(
            layer.mlp,
            "gate_up_proj",
            [f"{p}.mlp.gate_up_proj"] if fused else [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"],
        )
        swap(layer.mlp, "down_proj", [f"{p}.mlp.down_proj"])
    if not args.tie_word_embeddings:
        swap(model, "lm_head", ["lm_head"])
    return scheme.label
