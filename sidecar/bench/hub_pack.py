"""Hub-quantized checkpoints written the way their tools write them, from a float checkpoint's own weights:
the files ``sidecar bench quant``'s hub modes load (``pack_dir``) and the unit tests' tiny checkpoints with
their dequantized references.

GPTQ and AWQ files are packed here following GPTQModel's ``pack`` (input rows along int32 words; in the
v1 format the zeros word minus one in every field, as its v2 -> v1 conversion writes it) and AutoAWQ's
``WQLinear_GEMM.from_linear`` (output columns in ``AWQ_ORDER``), neither tool installing next to our torch;
each is read back by an independent element-wise dequantizer written from the tools' dequantization
(``dequant_gptq`` / ``dequant_awq``). compressed-tensors ``pack-quantized`` files come from the tool itself
(``PackedQuantizationCompressor.compress``), read back by its ``decompress``. ``int-quantized`` W8A8 (int8
``weight`` and ``weight_scale`` per channel, the tool's symmetric absmax / 127.5 rounding) and the ``fp8``
method (e4m3 ``weight`` and ``weight_scale_inv`` per 128x128 block) are written from their documented tensor
names (``w8a8.py``, ``fp8.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj")
LINEARS += ("mlp.up_proj", "mlp.down_proj")


def exact_scale(s: torch.Tensor) -> torch.Tensor:
    """Scales rounded to 4 significant bits: fp16 stores them, and the int4 kernel's bf16 scales and zeros
    ((8 - z) * s, at most 8 significant bits) hold them exactly."""
    e = torch.floor(torch.log2(s)) - 3
    return torch.round(s / 2**e) * 2**e


def quantize(w, bits, g_idx, groups, sym, exact, narrow=False):
    """GPTQ's min-max quantizer per (row, group): unsigned codes [N, K], fp16-valued scales and integer
    zeros [N, G]. ``narrow``: symmetric codes within +-(2 ** (bits - 1) - 1) (scale absmax / 127 for 8 bits,
    where GPTQ's absmax / 127.5 reaches -128)."""
    maxq = (1 << bits) - 1
    n, k = w.shape
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            span = maxq // 2 if narrow else maxq / 2
            s, z = torch.maximum(-lo, hi) / span, torch.full((n,), float((maxq + 1) // 2))
        else:
            s = (hi - lo) / maxq
            z = torch.round(-lo / s.clamp(min=1e-8)).clamp(0, maxq)
        s = s.clamp(min=1e-4).half().float()
        scales[:, g], zeros[:, g] = exact_scale(s) if exact else s, z
    s, z = scales[:, g_idx], zeros[:, g_idx]
    lo_code = 1 if narrow and sym else 0  # narrow: codes stay within zero +- (2 ** (bits - 1) - 1)
    codes = torch.clamp(torch.round(w / s) + z, lo_code, maxq).to(torch.int64)
    return codes, scales, zeros


def _words(vals: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """AutoGPTQ's pack loop: 32 / bits values per uint32 along ``axis``, the first in the lowest bits."""
    per = 32 // bits
    vals = np.moveaxis(vals.astype(np.uint32), axis, 0)
    out = np.zeros((vals.shape[0] // per, *vals.shape[1:]), dtype=np.uint32)
    for j in range(per):
        out |= vals[j::per] << np.uint32(bits * j)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis)).view(np.int32)


def pack_gptq(codes, scales, zeros, g_idx, bits, v1: bool) -> dict:
    pad = -zeros.shape[0] % (32 // bits)  # output rows padded to whole words (a vocab-sized lm_head)
    qzeros = _words(np.pad(zeros.to(torch.int64).T.numpy(), ((0, 0), (0, pad))), bits, 1).view(np.uint32)
    if v1:  # GPTQModel's v2 -> v1: one subtracted from every field of the word at once, borrows included
        qzeros = qzeros - np.uint32(sum(1 << s for s in range(0, 32, bits)))
    return {
        "qweight": torch.from_numpy(_words(codes.T.numpy(), bits, 0)),
        "qzeros": torch.from_numpy(qzeros.view(np.int32)),
        "scales": scales.T.contiguous().half(),
        "g_idx": g_idx.to(torch.int32),
    }


def dequant_gptq(t: dict, bits: int, v1: bool) -> torch.Tensor:
    """Element by element, as the tool's reference dequantizer reads its tensors."""
    per, mask = 32 // bits, (1 << bits) - 1
    qw, qz = t["qweight"].numpy().view(np.uint32), t["qzeros"].numpy().view(np.uint32)
    if v1:  # GPTQModel's v1 -> v2: the word plus one in every field, carries included
        qz = qz + np.uint32(sum(1 << s for s in range(0, 32, bits)))
    k, n = qw.shape[0] * per, qw.shape[1]
    kk, nn = np.arange(k)[:, None], np.arange(n)[None, :]
    q = (qw[kk // per, nn] >> (bits * (kk % per))) & mask
    g = t["g_idx"].numpy().astype(np.int64)[:, None]
    z = (qz[g, nn // per] >> (bits * (nn % per))) & mask
    s = t["scales"].float().numpy()[g, nn]
    return torch.from_numpy((s * (q.astype(np.float32) - z.astype(np.float32))).T.copy())


def pack_awq(codes, scales, zeros) -> dict:
    def words(v):  # [R, N] -> [R, N / 8]: nibble i of word c holds column 8 c + AWQ_ORDER[i]
        v = v.numpy().astype(np.uint32)
        out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
        for i, col in enumerate(AWQ_ORDER):
            out |= v[:, col::8] << np.uint32(4 * i)
        return torch.from_numpy(out.view(np.int32))

    return {"qweight": words(codes.T), "qzeros": words(zeros.T.to(torch.int64)), "scales": scales.T.half()}


def dequant_awq(t: dict, group_size: int) -> torch.Tensor:
    qw, qz = t["qweight"].numpy().view(np.uint32), t["qzeros"].numpy().view(np.uint32)
    k, n = qw.shape[0], qw.shape[1] * 8
    nibble = np.array([AWQ_ORDER.index(j % 8) for j in range(n)])  # where column j sits in its word
    kk, nn = np.arange(k)[:, None], np.arange(n)[None, :]
    q = (qw[kk, nn // 8] >> (4 * nibble[nn])) & 15
    z = (qz[kk // group_size, nn // 8] >> (4 * nibble[nn])) & 15
    s = t["scales"].float().numpy()[kk // group_size, nn]
    return torch.from_numpy((s * (q.astype(np.float32) - z.astype(np.float32))).T.copy())


def ct_scheme(bits: int, strategy: str, group_size: Optional[int], sym: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(
        num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=group_size
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def pack_ct(w, bits, strategy, group_size, sym, exact, narrow=False) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' own compress / decompress of one weight (decompressed with float32 scales: the
    tool's products of codes and scales, not rounded to the fp16 it would return them in)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as C

    k = w.shape[1]
    groups = 1 if strategy == "channel" else k // group_size
    codes, s, z = quantize(w, bits, torch.arange(k) // (k // groups), groups, sym, exact, narrow)
    scheme = ct_scheme(bits, strategy, group_size, sym)
    # The tool quantizes what it is given with these scales: the weight on its grid gives back our codes.
    g = torch.arange(k) // (k // groups)
    state = {"weight": (codes - z[:, g]) * s[:, g], "weight_scale": s.half()}
    if not sym:
        state["weight_zero_point"] = (z - (1 << (bits - 1))).to(torch.int8)
    packed = C.compress(state, scheme)
    back = C.decompress(dict(packed) | {"weight_scale": packed["weight_scale"].float()}, scheme)["weight"]
    return {k: v for k, v in packed.items()}, back


def write(
    src: Path, out: Path, qconfig: dict, layer_tensors, lm_head: bool = False
) -> dict[str, torch.Tensor]:
    """Copy ``src`` (a float checkpoint, one ``model.safetensors``) to ``out`` with every decoder linear
    replaced by ``layer_tensors(name, weight) -> (tensors, dequantized or None)``; returns the dequantized
    reference state dict (the float weight where the writer gives no dequantized one)."""
    if not (src / "model.safetensors").is_file():
        raise ValueError(f"model: {src} has no single model.safetensors to pack")
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    state = load_file(str(src / "model.safetensors"))
    ref, stored = dict(state), {}
    names = [k[: -len(".weight")] for k in state if k.endswith(".weight") and k.split(".")[-2] in _LEAVES]
    if lm_head and "lm_head.weight" in state:
        names.append("lm_head")
    for name in names:
        tensors, back = layer_tensors(name, state[f"{name}.weight"].float())
        stored.update({f"{name}.{k}": v for k, v in tensors.items()})
        if back is not None:
            ref[f"{name}.weight"] = back
    stored.update({k: v for k, v in state.items() if k[: -len(".weight")] not in names})
    save_file({k: v.contiguous() for k, v in stored.items()}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(cfg))
    return ref


_LEAVES = {n.split(".")[-1] for n in LINEARS} | {
    "w1",
    "w2",
    "w3",
}  # with Mixtral's experts (router: ``gate``)


def gptq_layer(bits: int = 4, group_size: int = 128, sym: bool = False, reference: bool = True):
    """A ``write`` layer writer of GPTQ (v1 format, no act-order) and its ``quantization_config``."""

    def layer(name, w):
        k = w.shape[1]
        gs = k if group_size == -1 else group_size
        g_idx = torch.arange(k) // gs
        codes, s, z = quantize(w, bits, g_idx, k // gs, sym, exact=False)
        t = pack_gptq(codes, s, z, g_idx, bits, v1=True)
        return t, dequant_gptq(t, bits, v1=True) if reference else None

    qc = dict(quant_method="gptq", bits=bits, group_size=group_size, sym=sym, desc_act=False)
    return qc | {"checkpoint_format": "gptq"}, layer


def awq_layer(group_size: int = 128, reference: bool = True):
    """A ``write`` layer writer of AWQ GEMM (4-bit, zero points) and its ``quantization_config``."""

    def layer(name, w):
        k = w.shape[1]
        codes, s, z = quantize(w, 4, torch.arange(k) // group_size, k // group_size, False, exact=False)
        t = pack_awq(codes, s, z)
        return t, dequant_awq(t, group_size) if reference else None

    return dict(quant_method="awq", bits=4, group_size=group_size, zero_point=True, version="gemm"), layer


def w8a8_layer():
    """compressed-tensors ``int-quantized`` W8A8 as llm-compressor writes it: int8 ``weight`` rounded from
    ``w / s`` with the per-channel scale ``s = absmax / 127.5`` (so a row's minimum can reach -128),
    ``weight_scale`` [N, 1]; activations per token at run time."""

    def layer(name, w):
        s = (w.abs().amax(1, keepdim=True) / 127.5).clamp(min=1e-8).half().float()
        q = torch.round(w / s).clamp(-128, 127).to(torch.int8)
        return {"weight": q, "weight_scale": s.half()}, q.float() * s

    args = dict(num_bits=8, type="int", symmetric=True, dynamic=False)
    group = dict(
        targets=["Linear"],
        weights=dict(args, strategy="channel"),
        input_activations=dict(args, dynamic=True, strategy="token"),
        format="int-quantized",
    )
    qc = dict(
        quant_method="compressed-tensors",
        format="int-quantized",
        quantization_status="compressed",
        config_groups={"group_0": group},
        ignore=["lm_head"],
    )
    return qc, layer


def fp8_layer(block: int = 128):
    """The ``fp8`` method: e4m3 ``weight`` and float32 ``weight_scale_inv`` (absmax / 448 of each
    ``block`` x ``block`` block; partial blocks at the edges)."""

    def layer(name, w):
        n, k = w.shape
        v = torch.nn.functional.pad(w, (0, -k % block, 0, -n % block))
        v = v.view(v.shape[0] // block, block, v.shape[1] // block, block)
        s = v.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
        full = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": s.contiguous()}, q.float() * full

    qc = dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[block, block])
    return qc, layer


# hub format -> its writer (group_size -> (quantization_config, layer writer)); the bench's hub modes
FORMATS = {
    "gptq-int4": lambda gs: gptq_layer(4, gs, reference=False),
    "awq-int4": lambda gs: awq_layer(gs, reference=False),
    "w8a8": lambda gs: w8a8_layer(),
    "fp8": lambda gs: fp8_layer(),
}


def pack_dir(src: Path, out: Path, fmt: str, group_size: int = 128) -> Path:
    """``src``'s float weights packed into the hub format ``fmt`` (one of ``FORMATS``) as a checkpoint
    directory ``out`` that the loader reads by its ``quantization_config``."""
    if fmt not in FORMATS:
        raise ValueError(f"format: {fmt!r} is not one of {', '.join(FORMATS)}")
    write(Path(src), Path(out), *FORMATS[fmt](group_size))
    return Path(out)
