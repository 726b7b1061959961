"""Peak resident memory of each system a bench runs: this process per phase, or a baseline's process.

The kernel keeps a process's peak RSS (``VmHWM`` in /proc/PID/status). Within this process the peak is
reset before each system runs (writing 5 to /proc/self/clear_refs), so each figure is that system's own
peak with the interpreter and libraries it needs included; where the reset is refused the figure is the
process's peak so far. A tool run to completion is watched while it runs.
"""

from __future__ import annotations

import resource
import subprocess
import threading
from typing import Optional, Union

MIB = 2**20


def peak_rss_bytes(pid: Union[int, str] = "self") -> Optional[int]:
    """``VmHWM`` of a live process (ours by default), None when /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if pid == "self":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return None


def reset_peak() -> bool:
    """Restart this process's peak-RSS count from its current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_measured(cmd: list[str], interval: float = 0.02, **popen) -> tuple[str, int, int]:
    """Run ``cmd`` to completion: (its stdout, exit code, its peak RSS in bytes). The peak is the child's
    ``VmHWM``, read every ``interval`` seconds while it runs (its ``wait4`` usage would not do: a child
    started from this process inherits this process's peak at ``exec``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **popen)
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval):
            now = peak_rss_bytes(proc.pid)
            if now:
                peak[0] = max(peak[0], now)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = proc.stdout.read()
        proc.wait()
    finally:
        done.set()
        watcher.join()
        proc.stdout.close()
    return out, proc.returncode, peak[0]


def mib(nbytes: Optional[int]) -> Optional[float]:
    return None if nbytes is None else nbytes / MIB
