"""The block-scatter kernel that loads offloaded KV blocks into the pool: the same bytes as the staged
torch path, for plain and quantized caches, with bad block ids refused before anything is written."""

import pytest
import torch

from sidecar.model import kv_quant
from sidecar.model.kernels.cpu import block_copy, cpu_build


def _caches(dtype, layers=3, blocks=9):
    caches = [kv_quant.allocate(blocks, 16, 3, 64, dtype, torch.device("cpu")) for _ in range(layers)]
    gen = torch.Generator().manual_seed(5)
    for layer in caches:
        for t in layer:
            if t.dtype == torch.int8:
                t.copy_(torch.randint(-127, 128, t.shape, generator=gen).to(t.dtype))
            else:
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return caches


def test_kernel_builds_on_this_machine():
    assert block_copy.available(), cpu_build.reason("block_copy")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_scatter_matches_the_staged_torch_path(dtype):
    src = _caches(dtype)
    datas = [kv_quant.read_block(src, b) for b in (1, 4, 2, 7)]
    ids = [8, 3, 5, 6]  # any order, not contiguous
    by_kernel, by_torch = _caches(dtype), _caches(dtype)
    assert block_copy.scatter_blocks([t for layer in by_kernel for t in layer], ids, datas)
    kv_quant.write_blocks(by_torch, ids, torch.stack(datas))  # a staged tensor takes the torch path
    for a, b in zip(by_kernel, by_torch):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for data, bid in zip(datas, ids):
        assert torch.equal(kv_quant.read_block(by_kernel, bid), data)
    untouched = _caches(dtype)
    for layer, ref in zip(by_kernel, untouched):  # the other blocks keep their bytes
        for x, y in zip(layer, ref):
            assert torch.equal(x[[0, 1, 2, 4, 7]], y[[0, 1, 2, 4, 7]])


def test_write_blocks_on_cpu_goes_through_the_kernel_and_checks_sizes_first(monkeypatch):
    caches = _caches(torch.float32)
    calls = []
    real = block_copy.scatter_blocks
    monkeypatch.setattr(block_copy, "scatter_blocks", lambda *a: calls.append(a) or real(*a))
    data = kv_quant.read_block(caches, 2)
    kv_quant.write_blocks(caches, [6], [data])
    assert len(calls) == 1 and torch.equal(kv_quant.read_block(caches, 6), data)
    with pytest.raises(ValueError, match="bytes"):
        kv_quant.write_blocks(caches, [5], [data[:-4]])
    assert len(calls) == 1


def test_a_block_outside_the_pool_is_refused_before_any_copy():
    caches = _caches(torch.float32)
    before = [t.clone() for layer in caches for t in layer]
    data = kv_quant.read_block(caches, 2)
    with pytest.raises(ValueError, match="outside"):
        block_copy.scatter_blocks([t for layer in caches for t in layer], [3, 9], [data, data])
    assert all(torch.equal(a, b) for a, b in zip(before, [t for layer in caches for t in layer]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_gather_gives_the_bytes_of_every_tensor_in_order(dtype):
    caches = _caches(dtype)
    flat = [t for layer in caches for t in layer]
    for b in (0, 3, 8):
        want = torch.cat([t[b].reshape(-1).view(torch.uint8) for t in flat])
        got = block_copy.gather_block(flat, b)
        assert got is not None and got.dtype == torch.uint8 and torch.equal(got, want)
        assert torch.equal(kv_quant.read_block(caches, b), want)
    with pytest.raises(ValueError, match="outside"):
        block_copy.gather_block(flat, 9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_copy_within_the_pool_matches_the_indexed_torch_copy(dtype, monkeypatch):
    """Copy-on-write of shared blocks: every (block, tensor) span from src to dst, nothing else touched."""
    src, dst = [1, 4, 2], [8, 3, 5]
    by_kernel, expected = _caches(dtype), _caches(dtype)
    assert block_copy.copy_blocks([t for layer in by_kernel for t in layer], src, dst)
    for layer in expected:
        for t in layer:
            t[dst] = t[src].clone()
    for a, b in zip(by_kernel, expected):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="outside"):
        block_copy.copy_blocks([t for layer in by_kernel for t in layer], [1], [9])
    by_torch = _caches(dtype)
    monkeypatch.setattr(block_copy, "copy_blocks", lambda *a: False)  # the path without the kernel
    kv_quant.copy_blocks(by_torch, src, dst)
    for a, b in zip(by_torch, expected):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
