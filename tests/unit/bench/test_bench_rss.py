"""Peak RSS figures of the benches: a tool's own peak, and this process's peak per phase."""

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
