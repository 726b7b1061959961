"""``MoeArgs``: the ctypes mirror of ``moe_args.h``, the argument struct of the grouped expert kernels."""

from __future__ import annotations

import ctypes

from sidecar.model.kernels.cpu import cpu_build


class MoeArgs(cpu_build.Args):
    """The mirror of moe_args.h's struct (its comments say what each field holds)."""

    c_name = "sidecar_moe_args"
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("ids", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("gate_up_scales", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("down_scales", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("T", ctypes.c_int),
        ("k", ctypes.c_int),
        ("E", ctypes.c_int),
        ("H", ctypes.c_int),
        ("I", ctypes.c_int),
        ("nthreads", ctypes.c_int),
        ("x_bf16", ctypes.c_int),
        ("weights_bf16", ctypes.c_int),
        ("group_size", ctypes.c_int),
        ("block_n", ctypes.c_int),
        ("split", ctypes.c_int),
        ("tiled", ctypes.c_int),
    ]
