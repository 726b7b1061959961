"""glibc's thresholds for a CPU engine's step-sized blocks (sidecar.model.heap)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sidecar.model import heap

glibc_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")

# Allocates a block of MiB mebibytes through torch, in the main thread or a thread of its own, and prints whether
# glibc mapped it on its own (the IS_MMAPPED bit of the chunk's size word, just before the block; a mapped block is
# unmapped on free and faulted in again next time) or served it from a heap.
_PROBE = textwrap.dedent("""
    import ctypes, json, os, sys, threading
    import torch
    from sidecar.model import heap
    state = heap.keep_step_blocks() if os.environ["KEEP"] == "1" else {"state": "not asked"}
    mib, in_thread, mapped = int(sys.argv[1]), sys.argv[2] == "1", []
    def work():
        for i in range(3):
            block = torch.empty((mib << 20) + 4096, dtype=torch.uint8)
            block.fill_(i)
            mapped.append(bool(ctypes.c_size_t.from_address(block.data_ptr() - 8).value & 2))
            del block
    torch.set_num_threads(1)
    if in_thread:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    else:
        work()
    print(json.dumps({"state": state, "mapped": mapped}))
""")


def _probe(mib: int, in_thread: bool, thp: str, keep: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(KEEP=keep, THP_MEM_ALLOC_ENABLE=thp, SIDECAR_KEEP_FREED="1")
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, str(mib), "1" if in_thread else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@glibc_linux
@pytest.mark.parametrize("mib,in_thread", [(20, False), (40, False), (20, True), (40, True)])
@pytest.mark.parametrize("thp", ["0", "1"])  # torch's plain blocks, and its 2 MiB-aligned huge-page blocks
def test_a_step_sized_block_comes_from_the_heap(mib, in_thread, thp):
    kept = _probe(mib, in_thread, thp, "1")
    assert kept["state"]["state"] == "kept"
    assert kept["mapped"] == [False] * 3
    if not in_thread:  # glibc's own threshold (128 KiB at start) maps the first such block
        assert _probe(mib, in_thread, thp, "0")["mapped"][0] is True


def test_the_users_choice_and_the_opt_out_are_kept():
    assert heap._refusal({"SIDECAR_KEEP_FREED": "0"}) == "SIDECAR_KEEP_FREED=0"
    assert "MALLOC_MMAP_THRESHOLD_" in heap._refusal({"MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert "glibc.malloc.trim_threshold" in heap._refusal(
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=0"}
    )
    if sys.platform.startswith("linux"):
        # the CLI's own huge-page tunable is not a choice about these thresholds
        assert heap._refusal({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) == ""


@glibc_linux
def test_an_opted_out_process_keeps_glibcs_defaults():
    env = dict(os.environ, SIDECAR_KEEP_FREED="0")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from sidecar.model import heap; "
            "print(json.dumps([heap.keep_step_blocks(), heap.keep_step_blocks()]))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    first, again = json.loads(run.stdout)
    assert first == again == {"state": "off (SIDECAR_KEEP_FREED=0)"}


@glibc_linux
def test_a_cpu_engine_sets_them_when_it_has_loaded(demo_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["SIDECAR_KEEP_FREED"] = "1"
    code = (
        "import json, sys; from sidecar.config import EngineConfig; from sidecar.engine.engine import LLMEngine; "
        "e = LLMEngine(EngineConfig(model=sys.argv[1], num_kv_blocks=16)); print(json.dumps(e.heap))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(demo_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {
        "state": "kept",
        "mmap_threshold": heap.MMAP_THRESHOLD,
        "trim_threshold": heap.TRIM_THRESHOLD,
    }
