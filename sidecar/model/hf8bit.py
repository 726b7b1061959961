"""Load 8-bit HF checkpoints by their ``quantization_config``: compressed-tensors ``int-quantized`` (W8A8,
``w8a8.py``) and ``float-quantized`` (FP8), and the ``fp8`` method (``fp8.py``).

``parse_8bit_config(qcfg)`` checks the config and returns a ``Scheme8`` (which projection gets which format);
``preload_8bit`` puts each targeted projection of a meta-built model in place as its format's runtime module,
and the loader reads the rest (embeddings, norms, ignored projections such as ``lm_head``) as from a plain
checkpoint. Malformed or unsupported configs raise ValueError naming the field.

Mixtures of experts (Mixtral, Qwen3-MoE): each expert's gate and up tensors (``experts.<e>.<gate|up>``, one
set per expert as the tools write them) become its fused ``gate_up_proj`` and its down tensor its
``down_proj``, as the same runtime modules a dense MLP's get (``W8A8Linear``; for FP8 ``Fp8ScaledLinear`` or
our ``Linear`` over the dequantized weight, as ``fp8.load_linear_fp8`` picks for the device); the router
stays in full precision as the tools leave it. Expert layouts this does not build (biases, shared experts,
fused expert tensors, a quantized router) are refused naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from sidecar.model.fp8 import load_linear_fp8, parse_ct_fp8_scheme, parse_fp8_config
from sidecar.model.moe import block_prefix
from sidecar.model.w8a8 import load_linear_w8a8, parse_w8a8_scheme

METHODS = ("compressed-tensors", "fp8")
CT_FORMATS = ("int-quantized", "float-quantized")


@dataclass
class Scheme8:
    """What each projection of a checkpoint is: ``specs`` one per config group, in order, with the group's
    targets; ``ignore`` the names kept in full precision. A spec is ('w8a8', strategy) or ('fp8', block, the
    scale tensor's name)."""

    method: str
    name: str  # the format as /v1/models reports it
    groups: list[tuple[list[str], tuple]] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)

    def spec_for(self, name: str, has: callable) -> Optional[tuple]:
        """The spec of the projection stored under ``name`` (``has(tensor)``: whether the checkpoint holds
        it), None where it is stored in full precision."""
        if self.method == "fp8":  # transformers' fp8: each converted projection stores its scale
            return self.groups[0][1] if has(f"{name}.weight_scale_inv") else None
        if any(_matches(name, pattern) for pattern in self.ignore):
            return None
        for targets, spec in self.groups:
            if any(t == "Linear" or _matches(name, t) for t in targets):
                return spec
        return None


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors' target rule: ``re:<regex>`` matched from the start of the name, else the exact
    name."""
    return re.match(pattern[3:], name) is not None if pattern.startswith("re:") else name == pattern


def _compressed_tensors(qcfg: dict) -> Scheme8:
    where = "quantization_config"
    fmt = qcfg.get("format")
    status = qcfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}.quantization_status: {status!r} is not supported (expected 'compressed')")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qcfg.get(key):
            raise ValueError(f"{where}.{key}: {qcfg[key]!r} is not supported")
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}.config_groups: {groups!r} is not supported (expected named groups)")
    scheme = Scheme8("compressed-tensors", "")
    kinds = set()
    for gname, group in groups.items():
        at = f"{where}.config_groups.{gname}"
        if not isinstance(group, dict):
            raise ValueError(f"{at}: {group!r} is not a quantization scheme")
        gfmt = group.get("format") or fmt
        if gfmt not in CT_FORMATS:
            field_name = f"{at}.format" if group.get("format") else f"{where}.format"
            raise ValueError(f"{field_name}: {gfmt!r} is not supported here (expected one of {CT_FORMATS})")
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
            raise ValueError(f"{at}.targets: {targets!r} is not supported (expected a list of names)")
        if gfmt == "int-quantized":
            spec, kind = ("w8a8", parse_w8a8_scheme(group, at)), "w8a8"
        else:
            strategy, block = parse_ct_fp8_scheme(group, at)
            spec, kind = ("fp8", block, "weight_scale"), "fp8"
        scheme.groups.append((targets, spec))
        kinds.add(kind)
    ignore = qcfg.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise ValueError(f"{where}.ignore: {ignore!r} is not supported (expected a list of names)")
    scheme.ignore = ignore
    scheme.name = "compressed-tensors-" + "+".join(sorted(kinds))
    return scheme


def parse_8bit_config(qcfg: dict) -> Scheme8:
    """The ``Scheme8`` of a ``quantization_config``; ValueError naming the field where it is malformed or
    not a format this module loads."""
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if method == "compressed-tensors":
        return _compressed_tensors(qcfg)
    if method == "fp8":
        return Scheme8("fp8", "fp8", [(["Linear"], ("fp8", parse_fp8_config(qcfg), "weight_scale_inv"))])
    raise ValueError(
        f"quantization_config.quant_method: {method!r} is not supported (expected one of {METHODS})"
    )


def _projection(
    scheme: Scheme8, ckpt, names: list[str], old: nn.Module, dtype, device
) -> Optional[nn.Module]:
    """The runtime module of one (possibly fused) projection, or None where it is stored in full precision."""
    specs = {scheme.spec_for(n, ckpt.__contains__) for n in names}
    if len(specs) != 1:
        raise ValueError(f"quantization_config: {', '.join(names)} are fused here but quantized differently")
    spec = specs.pop()
    if spec is None:
        return None
    bias = getattr(old, "bias", None) is not None
    if spec[0] == "w8a8":
        strategy, static = spec[1]
        module = load_linear_w8a8(ckpt.get, names, strategy, bias, dtype, device, static)
    else:
        module = load_linear_fp8(ckpt.get, names, spec[2], spec[1], bias, dtype, device)
        module.gate_up_halves = getattr(old, "gate_up_halves", 0)
    module.preloaded = True  # the loader leaves it as it is
    return module


def preload_8bit(model, ckpt, qcfg: dict, requested: Optional[str], dtype, device) -> str:
    """Put each projection of ``model`` (built on the meta device) that ``qcfg`` quantizes in place as its
    format's runtime module, filled from ``ckpt`` (the loader's safetensors index) and marked
    ``preloaded``: the loader then reads the rest as from a plain checkpoint. Returns the format's name
    (``LoadedModel.quantization``). ``requested``: the engine's own quantization, which a quantized
    checkpoint cannot take."""
    scheme = parse_8bit_config(qcfg)
    if requested is not None:
        raise ValueError(
            f"quantization: checkpoint is already quantized as {scheme.name!r}, "
            f"cannot load it as {requested!r}"
        )
    args = model.args
    sparse = [i for i in range(len(model.layers)) if args.sparse(i)]
    for i in sparse:
        _check_sparse_block(scheme, ckpt, model.layers[i].mlp, f"model.layers.{i}")
    fused = args.fused_checkpoint  # Phi-3 stores the projections already fused
    for i, layer in enumerate(model.layers):
        p, attn, mlp = f"model.layers.{i}", layer.self_attn, layer.mlp
        qkv = [f"{p}.self_attn.qkv_proj"] if fused else [f"{p}.self_attn.{x}_proj" for x in "qkv"]
        projections = [(attn, "qkv_proj", qkv), (attn, "o_proj", [f"{p}.self_attn.o_proj"])]
        if i in sparse:
            projections += _expert_projections(ckpt, mlp, p)
        else:
            gate_up = [f"{p}.mlp.gate_up_proj"] if fused else [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]
            projections += [(mlp, "gate_up_proj", gate_up), (mlp, "down_proj", [f"{p}.mlp.down_proj"])]
        for parent, attr, names in projections:
            module = _projection(scheme, ckpt, names, getattr(parent, attr), dtype, device)
            if module is not None:
                setattr(parent, attr, module)
    if not args.tie_word_embeddings and "lm_head.weight" in ckpt:
        head = _projection(scheme, ckpt, ["lm_head"], model.lm_head, dtype, device)
        model.lm_head = model.lm_head if head is None else head
    return scheme.name


def _check_sparse_block(scheme: Scheme8, ckpt, moe: nn.Module, layer_prefix: str) -> None:
    """Refuse, naming the field, a sparse block whose experts this loader does not build from 8-bit codes:
    only per-expert SwiGLU experts without biases (Mixtral, Qwen3-MoE) in the hub's per-expert tensors,
    with the router in full precision (as the tools leave it: a quantized router would move tokens between
    experts)."""
    args = moe.args
    if args.expert_bias or getattr(moe, "shared_expert", None) is not None or hasattr(moe, "block_tensors"):
        raise ValueError(
            f"quantization_config: {scheme.name} experts of {args.architecture} are not supported "
            "(per-expert SwiGLU experts without biases or shared experts only: Mixtral, Qwen3-MoE)"
        )
    prefix = block_prefix(ckpt.__contains__, layer_prefix, args)
    if f"{prefix}.experts.gate_up_proj" in ckpt:
        raise ValueError(
            f"model: {prefix}.experts.gate_up_proj: fused expert tensors are not read with a "
            f"{scheme.name} quantization_config (the tools write one tensor set per expert)"
        )
    router = f"{prefix}.gate"
    if f"{router}.weight_scale" in ckpt or f"{router}.weight_scale_inv" in ckpt:
        field_name = "modules_to_not_convert" if scheme.method == "fp8" else "ignore"
        raise ValueError(
            f"quantization_config.{field_name}: the router {router} is quantized; it is read in full "
            "precision only (the tools leave it so)"
        )


def _expert_projections(ckpt, moe: nn.Module, layer_prefix: str) -> list[tuple[nn.Module, str, list[str]]]:
    """(expert MLP, attribute, checkpoint names) of each expert projection of the sparse block ``moe``: its
    gate and up tensors fused into ``gate_up_proj`` (rows gate first), its down tensor ``down_proj``."""
    _, gate, up, down = moe.args.moe_names
    at = f"{block_prefix(ckpt.__contains__, layer_prefix, moe.args)}.experts"
    out = []
    for e, expert in enumerate(moe.experts):
        out.append((expert, "gate_up_proj", [f"{at}.{e}.{gate}", f"{at}.{e}.{up}"]))
        out.append((expert, "down_proj", [f"{at}.{e}.{down}"]))
    return out
