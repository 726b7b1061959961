"""A checkpoint tensor read in blocks of rows, each through its own file handle.

A safetensors handle maps its whole file, and every page read through a mapping stays in the process's
RSS until that mapping goes: a table read whole (or sliced through one handle) is resident in full while
it is quantized, beside the codes being written. ``FileRows`` opens the file once per block of rows, so
no more than one block's pages are mapped at a time; the quantizers (``quant_format.quantize_int8`` /
``quantize_int4``) take it in place of a tensor, reading it in their own row chunks.
"""

from __future__ import annotations

import torch


class FileRows:
    """Rows of the 2-D tensor ``name`` in the safetensors file ``path``, as ``dtype``: ``rows[a:b]`` reads
    those rows only (a new tensor, converted to ``dtype`` as the loader converts whole tensors). ValueError
    where the stored shape is not ``expected``."""

    def __init__(self, path: str, name: str, dtype: torch.dtype, expected: tuple[int, ...]) -> None:
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as h:
            shape = tuple(h.get_slice(name).get_shape())
        if shape != tuple(expected) or len(shape) != 2:
            raise ValueError(f"model: tensor {name} has shape {shape}, expected {tuple(expected)}")
        self.path, self.name, self.dtype = path, name, dtype
        self.shape, self.device = torch.Size(shape), torch.device("cpu")

    def __getitem__(self, rows: slice) -> torch.Tensor:
        from safetensors import safe_open

        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("FileRows reads contiguous row ranges only")
        with safe_open(self.path, framework="pt", device="cpu") as h:
            block = h.get_slice(self.name)[rows]
        # a copy owning its memory, so the block's file pages go with the handle
        return block.to(self.dtype, copy=True)
