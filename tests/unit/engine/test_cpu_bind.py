"""Placement of tensor / pipeline parallel ranks' threads on a CPU host (engine/cpu_bind.py): how a host's CPUs
split between its ranks (whole NUMA nodes where there are enough, else equal runs; explicit sets; off), the
errors that name ``SIDECAR_CPU_BIND``, and pinning this process's every thread then putting them back."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from sidecar.engine import cpu_bind


def test_ranks_split_the_cpus_into_equal_runs_or_whole_numa_nodes():
    eight = set(range(8))
    assert [cpu_bind.rank_cpus(2, r, eight, [eight]) for r in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [cpu_bind.rank_cpus(3, r, eight, []) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    # two nodes whose CPUs interleave: each rank its node's, not a run across both
    nodes = [{0, 2, 4, 6}, {1, 3, 5, 7}]
    assert [cpu_bind.rank_cpus(2, r, eight, nodes) for r in (0, 1)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # four nodes for two ranks: two whole nodes each; a node with no allowed CPU does not count
    four = [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    assert cpu_bind.rank_cpus(2, 1, eight, four) == [4, 5, 6, 7]
    assert cpu_bind.rank_cpus(2, 1, {0, 1, 2, 3, 4}, four) == [2, 3, 4]
    assert cpu_bind.rank_cpus(4, 0, {0, 1, 2}, [eight]) is None  # fewer CPUs than ranks: not pinned


def test_explicit_sets_and_off():
    allowed = set(range(8))
    assert cpu_bind.rank_cpus(2, 1, allowed, [], "0-3|4,6-7") == [4, 6, 7]
    assert cpu_bind.rank_cpus(2, 0, allowed, [], "off") is None
    for spec, words in (
        ("0-3", "1 CPU sets for 2 ranks"),
        ("0-3|9", "not all usable"),
        ("0-x|4", "CPU list"),
    ):
        with pytest.raises(ValueError, match=f"SIDECAR_CPU_BIND.*{words}"):
            cpu_bind.rank_cpus(2, 1, allowed, [], spec)
    assert cpu_bind.parse_cpulist("0-2,5,7-8\n") == {0, 1, 2, 5, 7, 8}


def test_bind_pins_every_thread_and_release_puts_them_back(monkeypatch):
    monkeypatch.delenv(cpu_bind.ENV, raising=False)
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)  # a thread started before the bind
    other.start()
    want = cpu_bind.rank_cpus(2, 1, before, cpu_bind.numa_nodes())
    try:
        got = cpu_bind.bind(2, 1, 1, None)
        assert got == want
        if want is not None:
            assert os.sched_getaffinity(0) == set(want) == os.sched_getaffinity(other.native_id)
            assert torch.get_num_threads() == len(want)
            assert cpu_bind.bind(2, 1, 1, 3) == want  # a second group of the same process
            assert torch.get_num_threads() == 3
            cpu_bind.release()
            assert os.sched_getaffinity(0) == set(want)  # still held by the first
    finally:
        if want is not None:
            cpu_bind.release()
        stop.set()
    assert os.sched_getaffinity(0) == before == os.sched_getaffinity(other.native_id)
    assert torch.get_num_threads() == threads
