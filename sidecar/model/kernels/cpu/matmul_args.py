"""``MatmulArgs``: the ctypes mirror of ``matmul_args.h``, the argument struct of every matrix product kernel."""

from __future__ import annotations

import ctypes

from sidecar.model.kernels.cpu import cpu_build

OUT_F32, OUT_BF16, OUT_F32_OF_BF16 = (
    0,
    1,
    2,
)  # ``out``: float32, bf16 (rounded once), float32 of the bf16 values


class MatmulArgs(cpu_build.Args):
    """The mirror of matmul_args.h's struct (its comments say what each field holds)."""

    c_name = "sidecar_matmul_args"
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("M", ctypes.c_int),
        ("N", ctypes.c_int),
        ("K", ctypes.c_int),
        ("nthreads", ctypes.c_int),
        ("x_bf16", ctypes.c_int),
        ("bias_bf16", ctypes.c_int),
        ("out", ctypes.c_int),
        ("group_size", ctypes.c_int),
        ("block_n", ctypes.c_int),
        ("split", ctypes.c_int),
        ("grouped", ctypes.c_int),
        ("silu", ctypes.c_int),
    ]
