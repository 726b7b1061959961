"""The KV pool's default size: what the deployment can use, bounded by the container's memory, reported."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest
import torch

from sidecar.config import EngineConfig
from sidecar.engine import kv_budget
from sidecar.engine.kv_budget import container_memory, kv_bytes_per_block, plan_kv_budget

GiB = 1 << 30


def fake_model(max_model_len=8192, layers=30, kv_heads=3, head_dim=64):
    args = SimpleNamespace(
        num_layers=layers,
        attention_layers=range(layers),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_shapes=lambda: [(kv_heads, head_dim)] * layers,
    )
    return SimpleNamespace(
        args=args, dtype=torch.float32, device=torch.device("cpu"), max_model_len=max_model_len
    )


def config(**kw) -> EngineConfig:
    return EngineConfig(model="demo", **kw)


@pytest.fixture
def host(monkeypatch):
    """A host with ``available`` bytes free, inside a container whose (limit, headroom) is ``cgroup``."""
    state = SimpleNamespace(available=64 * GiB, cgroup=(None, None))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=state.available))
    monkeypatch.setattr(kv_budget, "container_memory", lambda: state.cgroup)
    return state


def test_container_memory_reads_cgroup_v2_and_v1(tmp_path):
    limit, current = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text("2147483648\n")
    current.write_text("536870912\n")
    assert container_memory((str(limit),), (str(current),)) == (2 * GiB, 3 * GiB // 2)
    limit.write_text("max\n")
    assert container_memory((str(limit),), (str(current),)) == (None, None)
    v1 = tmp_path / "memory.limit_in_bytes"
    v1.write_text(str(1 << 62))  # cgroup v1's "unlimited"
    assert container_memory((str(tmp_path / "missing"), str(v1)), (str(current),)) == (None, None)
    assert container_memory((str(tmp_path / "missing"),), ()) == (None, None)


def test_default_is_bounded_by_the_container_not_the_host(host):
    model = fake_model()
    per_block = kv_bytes_per_block(model, 16)
    host.cgroup = (2 * GiB, GiB)  # 2 GiB pod with 1 GiB left, on a host with 64 GiB free
    b = plan_kv_budget(config(), model)
    assert b.source == "memory fraction" and b.container_limit_bytes == 2 * GiB
    assert b.num_blocks == int(GiB * 0.3) // per_block + 1
    assert b.bytes == b.num_blocks * per_block


def test_default_is_what_max_num_seqs_at_full_context_needs_when_that_is_less(host):
    model = fake_model(max_model_len=100)
    b = plan_kv_budget(config(max_num_seqs=4), model)
    assert b.source == "max_num_seqs x context"
    assert b.num_blocks == 4 * 7 + 1  # ceil(100 / 16) blocks per sequence, plus the padding block


def test_cpu_default_has_a_ceiling(host):
    host.available = 100 * GiB
    b = plan_kv_budget(config(), fake_model())
    assert b.source == "cpu cap"
    assert b.bytes <= kv_budget.CPU_DEFAULT_KV_CAP_BYTES + kv_bytes_per_block(fake_model(), 16)


def test_explicit_sizes_win_and_a_budget_without_a_block_names_the_field(host):
    host.cgroup = (GiB, 0)
    assert plan_kv_budget(config(num_kv_blocks=9), fake_model()).num_blocks == 9
    b = plan_kv_budget(config(kv_cache_memory_gb=0.5), fake_model())
    assert (
        b.source == "kv_cache_memory_gb"
        and b.num_blocks == GiB // 2 // kv_bytes_per_block(fake_model(), 16) + 1
    )
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        plan_kv_budget(config(), fake_model())  # no headroom left in the container
