"""LLM() users get the weights and KV cache in transparent huge pages without the CLI's restart.

Each case runs in a fresh interpreter: torch fixes its allocator's huge-page choice at its first
allocation, so the order of imports and allocations is part of what is tested."""

import json
import os
import subprocess
import sys
from pathlib import Path

from sidecar.model import hugepages

ROOT = Path(__file__).resolve().parents[3]
MODE = hugepages.thp_mode()
THP_ON = MODE in ("always", "madvise")


def _python(code: str, **env: str) -> dict:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in (hugepages.ALLOCATOR_ENV, "SIDECAR_HUGE_PAGES", "GLIBC_TUNABLES")
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, "PYTHONPATH": str(ROOT), **env},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


ALLOCATOR = """
import json, os, sidecar
sidecar.LLM  # the engine package is imported: torch's allocator is asked for huge pages
import torch
from sidecar.model import hugepages
x = torch.ones(16 << 20, dtype=torch.uint8)
p = x.data_ptr()
r = next(v for (lo, hi), v in hugepages.anon_regions().items() if lo <= p < hi)
print(json.dumps({"env": os.environ.get("THP_MEM_ALLOC_ENABLE"), "huge": r["AnonHugePages"], "advised": r["advised"]}))
"""


def test_the_python_api_asks_torch_for_huge_pages():
    got = _python(ALLOCATOR)
    assert got["env"] == ("1" if THP_ON else None)
    if MODE == "madvise":
        # torch's allocator advised its block; how many huge pages the kernel finds for it depends on
        # free memory at that moment, the advice itself does not
        assert got["advised"] == 1


def test_the_user_can_keep_it_off_or_choose():
    off = _python(ALLOCATOR, SIDECAR_HUGE_PAGES="0")
    assert off["env"] is None
    if MODE == "madvise":
        assert off["huge"] == 0 and off["advised"] == 0
    assert _python(ALLOCATOR, THP_MEM_ALLOC_ENABLE="0")["env"] == "0"


COLLAPSE = """
import json, torch
torch.ones(1)  # torch's first allocation: its allocator stays on 4 KiB pages in this process
from sidecar.model import hugepages
before = hugepages.snapshot()
x = torch.ones(64 << 20, dtype=torch.uint8)  # resident, allocated in small pages
lazy = torch.empty(256 << 20, dtype=torch.uint8)  # mapped, never touched (a lazily committed KV pool)
def region(t):
    p = t.data_ptr()
    return next(v for (lo, hi), v in hugepages.anon_regions().items() if lo <= p < hi)
small_pages = region(x)["AnonHugePages"]
res = hugepages.advise_new(before)
print(json.dumps({"res": res, "before": small_pages, "after": region(x)["AnonHugePages"],
                  "advised": region(x)["advised"], "lazy_rss": region(lazy)["Rss"],
                  "lazy_advised": region(lazy)["advised"]}))
"""


def test_memory_already_allocated_is_collapsed_into_huge_pages():
    got = _python(COLLAPSE)
    if not THP_ON:
        assert got["res"]["state"].startswith("off")
        return
    assert got["res"]["state"] in ("advised", "collapsed")
    assert got["advised"] == 1 and got["lazy_advised"] == 1  # both carry MADV_HUGEPAGE now
    if MODE == "madvise":
        assert got["before"] == 0
    # Collapsing is best effort: the kernel refuses it (EAGAIN / ENOMEM) while no free huge page can be made.
    if got["res"]["collapse_refused"]:
        assert got["res"]["state"] == "advised" or got["res"]["collapsed"] >= 1
    else:
        assert got["after"] >= 48 << 20  # all but the region's unaligned ends
    assert got["lazy_rss"] < 64 << 20  # untouched memory is advised, not committed


def test_off_when_asked():
    got = _python(COLLAPSE, SIDECAR_HUGE_PAGES="0")
    assert got["res"]["state"] == "off (SIDECAR_HUGE_PAGES=0)" and got["after"] == got["before"]


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(str(f)) == "madvise"
    assert hugepages.thp_mode(str(tmp_path / "missing")) == ""


def test_the_engine_advises_what_it_loaded(demo_dir):
    # A fresh interpreter: in a process that loaded models before, a small model's memory can come from
    # mappings that already existed (and were left alone on purpose).
    code = (
        "import json; from sidecar import LLM; "
        f"print(json.dumps(LLM(model={str(demo_dir)!r}, dtype='float32', num_kv_blocks=64).engine.huge_pages))"
    )
    state = _python(code)
    if THP_ON:
        assert state["state"] in ("advised", "collapsed") and state["advised"] >= 1
    else:
        assert state["state"].startswith("off")
