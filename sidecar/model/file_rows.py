"""A checkpoint's safetensors files by tensor name (``SafetensorsIndex``), and a tensor of them read in blocks
of rows, each through its own file handle (``FileRows``).

A safetensors handle maps its whole file, and every page read through a mapping stays in the process's
RSS until that mapping goes: a table read whole (or sliced through one handle) is resident in full while
it is quantized, beside the codes being written. ``FileRows`` opens the file once per block of rows, so
no more than one block's pages are mapped at a time; the quantizers (``quant_format.quantize_int8`` /
``quantize_int4``) take it in place of a tensor, reading it in their own row chunks.
"""

from __future__ import annotations

import json
from pathlib import Path

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


class SafetensorsIndex:
    """Name -> file map over a checkpoint's safetensors shards, opened lazily (mmap)."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not files:
                raise ValueError(f"model: no *.safetensors weights in {model_dir}")
            weight_map = {}
        self.paths = {f: str(model_dir / f) for f in files}
        if not weight_map:
            for f, path in self.paths.items():
                with safe_open(path, framework="pt", device="cpu") as h:
                    for k in h.keys():
                        weight_map[k] = f
        self.weight_map: dict[str, str] = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ValueError(f"model: checkpoint is missing tensor {name!r}")
        from safetensors import safe_open

        # An open handle maps the whole file and every page read through it counts in this
        # process's RSS until the handle closes; one handle per tensor keeps peak RSS near the
        # final model size when quantizing on load (the returned tensor keeps only its own bytes).
        with safe_open(self.paths[self.weight_map[name]], framework="pt", device="cpu") as h:
            return h.get_tensor(name)

    def rows(self, name: str, dtype: torch.dtype, like: torch.Tensor) -> FileRows:
        """The tensor ``name`` (of ``like``'s shape) read a block of rows at a time (file_rows.py)."""
        if name not in self.weight_map:
            raise ValueError(f"model: checkpoint is missing tensor {name!r}")
        return FileRows(self.paths[self.weight_map[name]], name, dtype, tuple(like.shape))
