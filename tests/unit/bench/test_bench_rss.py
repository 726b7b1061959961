"""Peak RSS figures of the benches: a tool's own peak, and this process's peak per phase."""

import subprocess
import sys

from sidecar.bench import rss


def test_a_tool_run_reports_its_own_peak():
    # 96 MiB written (bytearray zero-fills), held a while so that the watcher sees it
    code = "import time; b = bytearray(96 << 20); print(len(b)); time.sleep(0.5)"
    out, rc, peak = rss.run_measured([sys.executable, "-c", code])
    assert rc == 0 and out.strip() == str(96 << 20)
    assert peak >= 96 << 20
    out, rc, small = rss.run_measured(
        [sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(3)"]
    )
    assert rc == 3 and small < peak - (64 << 20)


def test_peak_resets_between_phases():
    block = bytearray(128 << 20)
    high = rss.peak_rss_bytes()
    assert high >= 128 << 20
    del block
    assert rss.reset_peak() == sys.platform.startswith("linux")
    if sys.platform.startswith("linux"):
        assert rss.peak_rss_bytes() < high - (64 << 20)


def test_a_quant_worker_counts_its_own_peak_not_its_parents():
    # the bench's workers are children of a process whose peak may be far above theirs: the load figure
    # (peak after the load minus peak before it) must see the worker's own growth
    block = bytearray(256 << 20)
    code = (
        "from sidecar.bench.quant import _rss_peak_bytes as p; a = p(); "
        "b = bytearray(64 << 20); print(a, p() - a)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    base, grown = (int(v) for v in out.split())
    assert len(block) == 256 << 20 and base < 200 << 20
    assert grown >= 60 << 20
