"""LoRA adapters in the PEFT format, and the batched low-rank update applied on top of the base layers.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (``adapter_model.bin``
is refused: pickles are not loaded). ``read_adapter`` validates it against the base model (targets among
q/k/v/o and gate/up/down, or a fused checkpoint's qkv/gate_up; rank <= the configured maximum, every shape
the base's) and returns its weights with the scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
rsLoRA) folded into B.

A base whose checkpoint stores ``qkv_proj`` and ``gate_up_proj`` fused (Phi-3) has adapters on those
modules: ``B x A`` on a fused module is, row block by row block, ``B_part x A`` on each of its parts, so
such an adapter is held as one adapter per part sharing its A, with B split along the output rows as the
fused weight is (q, k, v; gate, up). An adapter naming the parts on a fused base, or a fused module on a
base that stores its parts apart, was trained on another architecture and is refused.

``LoraLayers`` holds ``max_loras`` resident slots as stacked weights per fused projection and adds the
update to each projection's output through a forward hook, so the base layers (dense, int8, int4) run
unchanged. For a fused projection with ``n`` parts (qkv: 3, gate_up: 2, o and down: 1) slot ``s`` owns rows
``[s*n*R, (s+1)*n*R)`` of ``a`` ([S*n*R, in]) and ``bt`` ([S*n*R, out]); part ``j`` owns its ``R`` rows,
its A padded with zero rows below its rank and its B^T nonzero only over the part's output columns.

In float32 on CPU our kernel (``kernels/cpu/lora_bgmv.c``, gather-style like Punica's BGMV) adds the update:
``set_batch`` lists the rows that have an adapter, grouped by slot, once per forward, and each hook adds in
place every listed row's own ``B (A x)``, per part over that part's columns only, from A held transposed
(``at``, [S, in, n*R padded]). Base rows are not touched and a row costs its own adapter's rank-R products
only, where the masked GEMMs below compute every slot's columns for every row (docs/perf/code-notes.md).

On a split model every rank holds the same slots (engine/tp.py mirrors each load): a tensor-parallel rank
holds its slice of each adapter (``Shard.lora_slice``: B's output rows of a column-parallel projection, A's
input columns of a row-parallel one, whose update joins the partial product its all-reduce sums); a pipeline
stage holds its own layers' weights.

Other dtypes and devices take two GEMMs per projection whatever the mix of adapters (gather-free):
``((x @ a[:k].T) * mask) @ bt[:k]`` where row ``t`` of ``mask`` keeps only the columns of its token's slot
(none for base-model tokens) and ``k`` covers the slots up to the highest one in the batch, rounded up
to a power of two. On CPUs where oneDNN takes them, the weights of each such prefix are also held in its
packed layout (``linear.py``: torch's default float32 GEMM runs several times slower than oneDNN on packed
weights); a slot's load repacks the prefixes holding it before the next forward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from sidecar.model.kernels.cpu import lora_bgmv
from sidecar.model.linear import PACK_ROWS_HINT, can_pack
from sidecar.model.lora_config import (  # noqa: F401 (re-exported)
    CONFIG_FILE,
    FUSED_TARGETS,
    TARGETS,
    WEIGHTS_FILE,
    AdapterError,
    module_names,
    read_config,
)
from sidecar.model.tp_shard import RowParallel

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.[\w-]+)?\.weight$"
)


@dataclass
class Adapter:
    """A validated adapter: ``weights[(layer, peft_module)] = (A [r, in], B [out, r] * scaling)`` in float32."""

    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def part_shapes(args) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of that part in the base model ``args``."""
    h, hd = args.hidden_size, args.head_dim
    q, kv, inter = args.num_heads * hd, args.num_kv_heads * hd, args.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def layer_part_shapes(args, layer: int) -> dict[str, tuple[int, int]]:
    """``part_shapes`` of one layer: only the projections it has, where layers differ (gemma4.py)."""
    if args.layer_head_dims is None and args.kv_source is None:
        return part_shapes(args)
    from sidecar.model.gemma4 import lora_part_shapes

    return lora_part_shapes(args, layer)


def read_adapter(path: str, args, max_rank: int) -> Adapter:
    """Load and validate the PEFT adapter at ``path`` for the base model ``args``. Raises AdapterError
    naming the file and the field (or tensor) at fault."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise AdapterError(f"{root}: not a directory (a PEFT LoRA adapter directory is expected)")
    fused = bool(getattr(args, "fused_checkpoint", False))
    cfg = read_config(root, max_rank, fused, args.architecture)
    wfile = root / WEIGHTS_FILE
    if not wfile.is_file():
        raise AdapterError(f"{wfile}: not found (only safetensors adapters are loaded)")
    from safetensors import safe_open

    try:
        with safe_open(str(wfile), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # a truncated or foreign file: safetensors raises several types
        raise AdapterError(f"{wfile}: not a readable safetensors file ({exc})") from None
    shapes = part_shapes(args)
    for name, parts in FUSED_TARGETS.items():
        shapes[name] = (shapes[parts[0]][0], sum(shapes[p][1] for p in parts))
    known = module_names(fused)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in known:
            raise AdapterError(
                f"{wfile}: {key}: not a LoRA weight of a module {args.architecture} has "
                f"(supported: {', '.join(known)})"
            )
        layer, name, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= args.num_layers:
            raise AdapterError(
                f"{wfile}: {key}: layer {layer} does not exist (the base model has {args.num_layers} layers)"
            )
        mine = shapes if name in FUSED_TARGETS else layer_part_shapes(args, layer)
        if name not in mine:
            raise AdapterError(
                f"{wfile}: {key}: layer {layer} of {args.architecture} has no {name} (it reads another "
                "layer's keys and values, or its values are its keys)"
            )
        fin, fout = mine[name]
        want = (cfg["r"], fin) if ab == "A" else (fout, cfg["r"])
        if tuple(t.shape) != want:
            raise AdapterError(
                f"{wfile}: {key}: shape {tuple(t.shape)} does not fit the base model (expected "
                f"{want} for rank {cfg['r']}; was the adapter trained on another base?)"
            )
        found.setdefault((layer, name), {})[ab] = t
    weights = {}
    for (layer, name), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(
                f"{wfile}: model.layers.{layer}.{name}: has lora_{''.join(ab)} without its pair"
            )
        A, B = ab["A"].float(), ab["B"].float() * cfg["_scaling"]
        if name not in FUSED_TARGETS:
            weights[(layer, name)] = (A, B)
            continue
        rows = 0
        for part in FUSED_TARGETS[name]:  # A shared; B split along the output rows as the fused weight is
            out = shapes[part][1]
            weights[(layer, part)] = (A, B[rows : rows + out])
            rows += out
    if not weights:
        raise AdapterError(f"{wfile}: holds no LoRA weights")
    return Adapter(str(root), cfg["r"], cfg["_scaling"], weights)


def _projections(attn: nn.Module, shapes: dict) -> list[tuple[str, list[str]]]:
    """(projection module, its PEFT parts in output-row order) of a layer: q/k/v fused where the attention
    holds ``qkv_proj``, else each that ``shapes`` lists (Gemma 4's own modules)."""
    qkv = [("qkv_proj", ["q_proj", "k_proj", "v_proj"])] if hasattr(attn, "qkv_proj") else []
    qkv = qkv or [(name, [name]) for name in ("q_proj", "k_proj", "v_proj") if name in shapes]
    return qkv + [
        ("o_proj", ["o_proj"]),
        ("gate_up_proj", ["gate_proj", "up_proj"]),
        ("down_proj", ["down_proj"]),
    ]


class LoraLayers:
    """``max_loras`` resident adapter slots on ``model``'s projections. ``set_batch`` tells the hooks which
    slot each token of the next forward uses; outside a batch (or when every token is the base model's)
    the hooks return the base output untouched."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        args = model.args
        if args.num_experts:
            raise ValueError(
                f"lora: {args.architecture} is a mixture-of-experts model; LoRA adapters are not supported on "
                "its expert layers (serve it without lora_modules / enable_lora)"
            )
        if args.latent is not None:
            raise ValueError(
                f"lora: {args.architecture} has multi-head latent attention layers; LoRA adapters are not "
                "supported on them (serve it without lora_modules / enable_lora)"
            )
        if args.linear_layers:
            raise ValueError(
                f"lora: {args.architecture} has linear-attention layers; LoRA adapters are not supported on "
                "them (serve it without lora_modules / enable_lora)"
            )
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.max_loras, self.max_rank = max_loras, max_rank
        # (layer, fused) -> [a [S*n*R, in], bt [S*n*R, out], part output offsets]
        self.slots: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        self.parts: dict[
            tuple[int, str], list[str]
        ] = {}  # (layer, projection) -> its PEFT parts, in row order
        # A tensor-parallel rank's model slices each adapter as its weights are (tp_shard.Shard.lora_slice)
        self.slice = getattr(model, "lora_slice", None)
        self.mirror: Optional[Callable[[int, Adapter], None]] = None  # a split model's other ranks (tp.py)
        self.token_slots: Optional[Sequence[int]] = None  # this forward's, as set_batch was given them
        for i, layer in enumerate(model.layers):
            if not hasattr(layer, "self_attn"):  # a layer of another pipeline stage (pp_stage.py)
                continue
            shapes = layer_part_shapes(args, i)
            for fused, parts in _projections(layer.self_attn, shapes):
                fin = shapes[parts[0]][0]
                offsets = [0]
                for name in parts:
                    offsets.append(offsets[-1] + shapes[name][1])
                rows = max_loras * len(parts) * max_rank
                self.slots[(i, fused)] = (
                    torch.zeros(rows, fin, dtype=self.dtype, device=self.device),
                    torch.zeros(rows, offsets[-1], dtype=self.dtype, device=self.device),
                    offsets,
                )
                self.parts[(i, fused)] = parts
                module = layer.mlp if fused in ("gate_up_proj", "down_proj") else layer.self_attn
                proj = getattr(module, fused)
                # Row-parallel: the update of this rank's input columns joins its partial product before the
                # all-reduce, which sums it once with the rest
                proj = proj.inner if isinstance(proj, RowParallel) else proj
                proj.register_forward_hook(self._hook(i, fused, len(parts)))
        self._masks: Optional[dict[int, torch.Tensor]] = None  # parts n -> [T, k*n*R] for this batch
        self._k = 0
        a0 = next(iter(self.slots.values()))[0]
        self.prefixes = [1 << i for i in range(max_loras.bit_length()) if 1 << i < max_loras] + [max_loras]
        # (layer, fused, k) -> (a[:k*n*R], bt[:k*n*R].T) packed for oneDNN; rebuilt for prefixes in _stale
        self._packed: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # float32 on CPU with our kernel: the update runs gather-style per row (lora_bgmv.c) from A^T held per
        # slot, [S, in, n*R]; the masked GEMMs (and their packed weights) are then never used.
        self._bgmv = self.dtype == torch.float32 and self.device.type == "cpu" and lora_bgmv.available()
        width = {key: lora_bgmv.at_width(len(parts), max_rank) for key, parts in self.parts.items()}
        self.at = (
            {
                key: torch.zeros(max_loras, a.shape[1], width[key], dtype=self.dtype)
                for key, (a, _, _) in self.slots.items()
            }
            if self._bgmv
            else {}
        )
        self.offs = {key: torch.tensor(o, dtype=torch.int32) for key, (_, _, o) in self.slots.items()}
        self._rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # adapter rows, grouped by slot; slots
        self._can_pack = can_pack(a0) and not self._bgmv
        self._stale: set[int] = set()

    def load(self, slot: int, adapter: Adapter) -> None:
        """Write ``adapter`` into ``slot`` (every target it lacks becomes zero; on a tensor-parallel rank, its
        slice of each target), and into the same slot of a split model's other ranks (``mirror``)."""
        if self.mirror is not None:
            self.mirror(slot, adapter)
        R = self.max_rank
        for (layer, fused), (a, bt, offsets) in self.slots.items():
            n = len(self.parts[(layer, fused)])
            base = slot * n * R
            a[base : base + n * R].zero_()
            bt[base : base + n * R].zero_()
            for j, name in enumerate(self.parts[(layer, fused)]):
                w = adapter.weights.get((layer, name))
                if w is None:
                    continue
                A, B = w if self.slice is None else self.slice(name, *w)
                r0 = base + j * R
                a[r0 : r0 + A.shape[0]].copy_(A)
                bt[r0 : r0 + A.shape[0], offsets[j] : offsets[j + 1]].copy_(B.t())
            if self._bgmv:
                self.at[(layer, fused)][slot, :, : n * R].copy_(a[base : base + n * R].t())
        if self._can_pack:
            self._stale.update(k for k in self.prefixes if k > slot)

    def _repack(self) -> None:
        R = self.max_rank
        for k in sorted(self._stale):
            for (layer, fused), (a, bt, _) in self.slots.items():
                rows = k * len(self.parts[(layer, fused)]) * R
                reorder = torch.ops.mkldnn._reorder_linear_weight
                self._packed[(layer, fused, k)] = (
                    reorder(a[:rows].contiguous(), PACK_ROWS_HINT),
                    reorder(bt[:rows].t().contiguous(), PACK_ROWS_HINT),
                )
        self._stale.clear()

    def set_batch(self, token_slots: Optional[Sequence[int]]) -> None:
        """Slot (or -1: base model) of every token of the next forward, in order; None ends the batch."""
        self.token_slots = token_slots  # what a split model sends its other ranks (engine/dist_inputs.py)
        if token_slots is None or all(s < 0 for s in token_slots):
            self._masks, self._k, self._rows = None, 0, None
            return
        if self._bgmv:  # the plan every hook of this forward shares: adapter rows grouped by slot
            order = sorted((s, t) for t, s in enumerate(token_slots) if s >= 0)
            self._rows = (torch.tensor([t for _, t in order]), torch.tensor([s for s, _ in order]))
            return
        R = self.max_rank
        self._k = next(k for k in self.prefixes if k > max(token_slots))
        if self._stale:
            self._repack()
        slots = torch.tensor(list(token_slots), device=self.device)
        self._masks = {}
        for n in {len(parts) for parts in self.parts.values()}:
            col_slot = torch.arange(self._k * n * R, device=self.device) // (n * R)
            self._masks[n] = (col_slot[None, :] == slots[:, None]).to(self.dtype)

    def _hook(self, layer: int, fused: str, n: int):
        def hook(module: nn.Module, inputs: tuple, out: torch.Tensor) -> Optional[torch.Tensor]:
            x, masks, plan = inputs[0], self._masks, self._rows
            if plan is not None:  # in place: only the adapter rows of ``out`` change
                out = out if out.is_contiguous() else out.contiguous()
                lora_bgmv.lora_apply(
                    x.contiguous(),
                    self.at[(layer, fused)],
                    self.slots[(layer, fused)][1],
                    plan[0],
                    plan[1],
                    self.offs[(layer, fused)],
                    out,
                    n,
                    self.max_rank,
                )
                return out
            if masks is None:
                return None
            packed = self._packed.get((layer, fused, self._k)) if x.device.type == "cpu" else None
            if packed is not None and x.dtype == packed[0].dtype and x.dim() == 2:
                # The mask product and the residual add ride in the GEMMs' epilogues: two kernels in all,
                # which matters as much as the FLOPs at decode sizes.
                lin = torch.ops.mkldnn._linear_pointwise.binary
                return lin(lin(x, masks[n], packed[0], None, "mul"), out.contiguous(), packed[1], None, "add")
            a, bt, _ = self.slots[(layer, fused)]
            k = self._k * n * self.max_rank
            return torch.addmm(out, (x @ a[:k].t()) * masks[n], bt[:k])

        # Outside a batch with adapter rows the hook changes nothing: fused paths may then skip the projection's
        # module call (linear.hooks_idle).
        hook.idle = lambda: self._masks is None and self._rows is None
        return hook
