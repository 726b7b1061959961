"""Write an int8/int4 weight-only quantized checkpoint that ``LLM(model=DIR)`` loads directly.

The full-precision model is loaded once, each decoder linear is quantized into
the stored format, and the result is written as safetensors together with
``quantization_config.json``, config.json and the tokenizer files.
"""

from __future__ import annotations

import argparse
import time

from sidecar.config import HEAD_MODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help='"demo", a local HF checkpoint directory or a hub id')
    parser.add_argument("--quantization", required=True, choices=("int8", "int4"), help="weight format")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size (32, 64, 128 or 256)")
    parser.add_argument(
        "--quantize-lm-head",
        nargs="?",
        const="same",
        default="auto",
        choices=HEAD_MODES,
        help="precision of lm_head (and of the embedding table when they are tied): auto (int8, as "
        "quantize-on-load does), none (full precision), int8, int4, same (the layers' mode; the bare flag)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="dtype of scales and of the unquantized tensors",
    )
    parser.add_argument("--out", required=True, help="output directory")


def run(args: argparse.Namespace) -> int:
    from sidecar.config import EngineConfig
    from sidecar.model.loader import load_model
    from sidecar.model.quant_checkpoint import save_quantized
    from sidecar.model.quant_format import check_quant_args

    check_quant_args(args.quantization, args.group_size)
    t0 = time.perf_counter()
    # Validated like the engine would; the model itself is loaded in full precision.
    EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        quant_group_size=args.group_size,
        quantize_lm_head=args.quantize_lm_head,
    )
    loaded = load_model(EngineConfig(model=args.model, dtype=args.dtype, device="cpu"), pack=False)
    if (loaded.model_dir / "quantization_config.json").exists():
        raise ValueError(f"model: {args.model!r} is already a quantized checkpoint")
    qcfg = save_quantized(
        loaded.model,
        loaded.tokenizer,
        loaded.model_dir,
        args.out,
        args.quantization,
        args.group_size,
        args.quantize_lm_head,
    )
    print(
        f"wrote {args.quantization} checkpoint ({len(qcfg['modules'])} linears quantized, "
        f"lm_head {qcfg['lm_head_mode'] or 'full precision'}"
        f"{' tied to embedding' if qcfg['tied_embedding'] else ''}) to {args.out} "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return 0
