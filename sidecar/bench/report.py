"""Benchmark reports: a printed table, a JSON file and a PNG bar chart per run."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Optional, Sequence


def machine_info() -> dict[str, Any]:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from sidecar.model.hardware import cpu_isa

    info["cpu_isa"] = cpu_isa()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = " | ".join(c.ljust(w) for c, w in zip(columns, widths))
    sep = "-|-".join("-" * w for w in widths)
    body = "\n".join(" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells)
    return f"{line}\n{sep}\n{body}"


def write_report(
    out_dir: str,
    name: str,
    payload: dict[str, Any],
    bars: Optional[dict[str, dict[str, float]]] = None,
    ylabel: str = "",
) -> tuple[Path, Optional[Path]]:
    """Write ``<name>.json`` (payload + machine info + timestamp) and, given ``bars`` ({panel: {label: value}}),
    ``<name>.png`` with one bar panel per entry."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(payload, machine=machine_info(), timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    jpath = out / f"{name}.json"
    jpath.write_text(json.dumps(payload, indent=2, default=str))
    ppath = None
    if bars:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(bars), figsize=(5 * len(bars), 4), squeeze=False)
        for ax, (title, values) in zip(axes[0], bars.items()):
            labels = list(values)
            heights = [values[k] for k in labels]
            ax.bar(labels, heights, color=["#2a7ab9" if i == 0 else "#a0a0a0" for i in range(len(labels))])
            ax.set_title(title)
            ax.set_ylabel(ylabel)
            for i, h in enumerate(heights):
                ax.annotate(f"{h:.3g}", (i, h), ha="center", va="bottom", fontsize=8)
            ax.tick_params(axis="x", labelrotation=20)
        fig.tight_layout()
        ppath = out / f"{name}.png"
        fig.savefig(ppath, dpi=110)
        plt.close(fig)
    return jpath, ppath


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
