"""Grammar stall probe (``sidecar bench grammar-stall``): does one tenant's heavy constraint hold up everyone else?

Against a real server (launched, or ``--target``), each probe sends one request from tenant A whose
output constraint is expensive to check or compile -- a 312 KB ``guided_json`` (anyOf of 2,000 objects)
with n=16 on chat and on /v1/completions with 4 prompts, 128 tools of 50 properties, the regex
``(x{1000}){1000}``, anyOf schemas of 4,000 and 1,500 objects, a valid 500-object anyOf decoding with
n=16 -- while two loops run beside it: GET /health every ``--health-interval`` seconds, and tenant B's
4-token chat requests back to back. Per probe the report gives A's status and time, /health p50 / p99 /
max, B's latencies (max, p50, count) and the 1-minute load average before and after. JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from sidecar.bench.report import machine_info
from sidecar.bench.serve_load import launch
from sidecar.config import DEFAULT_MODEL

KEY_A, KEY_B = "stall-a", "stall-b"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model the launched sidecar serves")
    p.add_argument(
        "--target",
        default=None,
        help="host:port of a running HTTP server started with --api-key stall-a:a --api-key stall-b:b",
    )
    p.add_argument(
        "--launch-arg", action="append", default=[], metavar="ARG", help="extra `sidecar serve` argument"
    )
    p.add_argument("--probe", action="append", default=[], help="run only these probes (repeatable)")
    p.add_argument("--health-interval", type=float, default=0.02)
    p.add_argument(
        "--settle-s", type=float, default=1.0, help="the loops keep measuring this long after a probe"
    )
    p.add_argument("--out", default="bench-results")


def _obj(i: int) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": [f"field_{i}", f"value_{i}"],
        "properties": {
            f"field_{i}": {"type": "string", "maxLength": 20},
            f"value_{i}": {"type": "integer", "minimum": 0},
        },
    }


def _chat(**kw: Any) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "Give me one record."}], **kw}


def _tools(n: int, props: int) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{t}",
                "description": f"tool number {t}",
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"p{t}_{k}": {"type": "string", "description": f"property {k}"} for k in range(props)
                    },
                    "required": [f"p{t}_0"],
                },
            },
        }
        for t in range(n)
    ]


def probes() -> dict[str, tuple[str, dict]]:
    big = {"anyOf": [_obj(i) for i in range(2000)]}
    return {
        "idle_5s": ("", {}),  # no constraint: the same loops with nothing else running, for comparison
        "json_anyof2000_chat_n16": _chat(guided_json=big, n=16, max_tokens=32),
        "json_anyof2000_completions_4x16": (
            "/v1/completions",
            {"prompt": ["a", "b", "c", "d"], "n": 16, "guided_json": big, "max_tokens": 32},
        ),
        "tools_128x50": _chat(tools=_tools(128, 50), tool_choice="required", max_tokens=32),
        "regex_x1000x1000": (
            "/v1/completions",
            {"prompt": "x", "guided_regex": "(x{1000}){1000}", "max_tokens": 32},
        ),
        "json_anyof4000": _chat(
            guided_json={
                "anyOf": [
                    {"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(4000)
                ]
            },
            max_tokens=32,
        ),
        "json_anyof1500_under_budget": _chat(
            guided_json={
                "anyOf": [
                    {"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(1500)
                ]
            },
            max_tokens=32,
        ),
        "json_anyof500_valid_n16": _chat(
            guided_json={"anyOf": [_obj(i) for i in range(500)]}, n=16, max_tokens=32
        ),
    }


def _pct(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class _Loop(threading.Thread):
    """Calls ``fn`` back to back (pausing ``pause_s``) and records (start, latency, ok) until stopped."""

    def __init__(self, fn: Callable[[], bool], pause_s: float) -> None:
        super().__init__(daemon=True)
        self.fn, self.pause_s = fn, pause_s
        self.samples: list[tuple[float, float, bool]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                ok = self.fn()
            except Exception:
                ok = False
            self.samples.append((t, time.monotonic() - t, ok))
            self.stop.wait(self.pause_s)

    def window(self, t0: float, t1: float) -> list[tuple[float, float, bool]]:
        """Samples that overlapped [t0, t1]."""
        return [s for s in self.samples if s[0] <= t1 and s[0] + s[1] >= t0]


def _run_probe(base: str, model: str, name: str, path: str, body: dict, args: argparse.Namespace) -> dict:
    import httpx

    a = httpx.Client(base_url=base, timeout=600, headers={"authorization": f"Bearer {KEY_A}"})
    b = httpx.Client(base_url=base, timeout=600, headers={"authorization": f"Bearer {KEY_B}"})
    h = httpx.Client(base_url=base, timeout=600)
    calls = iter(range(10**9))

    def small() -> bool:  # a new prompt each time, never from the semantic cache
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"hi {next(calls)}"}],
            "max_tokens": 4,
            "temperature": 0,
            "cache_control": "skip",
        }
        return b.post("/v1/chat/completions", json=body).status_code == 200

    health = _Loop(lambda: h.get("/health").status_code == 200, args.health_interval)
    other = _Loop(small, 0.0)
    load_before = os.getloadavg()[0]
    health.start()
    other.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    if path:
        r = a.post(path, json={"model": model, **body})
    else:
        time.sleep(5.0)
        r = httpx.Response(200, json={"choices": []})
    t1 = time.monotonic()
    time.sleep(args.settle_s)
    health.stop.set()
    other.stop.set()
    health.join()
    other.join()
    hs = [s[1] for s in health.window(t0, t1)]
    bs = [s[1] for s in other.window(t0, t1)]
    try:
        err = r.json().get("error") if r.status_code != 200 else None
        finish = [c.get("finish_reason") for c in r.json().get("choices", [])] if r.status_code == 200 else []
    except ValueError:
        err, finish = r.text[:300], []
    for c in (a, b, h):
        c.close()
    return {
        "probe": name,
        "status": r.status_code,
        "probe_s": t1 - t0,
        "error": err,
        "finish_reasons": sorted(set(f for f in finish if f)),
        "health_n": len(hs),
        "health_p50_ms": 1e3 * (_pct(hs, 0.5) or 0),
        "health_p99_ms": 1e3 * (_pct(hs, 0.99) or 0),
        "health_max_ms": 1e3 * max(hs, default=0),
        "health_failures": sum(not s[2] for s in health.window(t0, t1)),
        "other_n": len(bs),
        "other_p50_s": _pct(bs, 0.5),
        "other_max_s": max(bs, default=None),
        "other_failures": sum(not s[2] for s in other.window(t0, t1)),
        "load_1m_before": load_before,
        "load_1m_after": os.getloadavg()[0],
    }


def _drive(base: str, model: str, args: argparse.Namespace) -> list[dict]:
    chosen = {k: v for k, v in probes().items() if not args.probe or k in args.probe}
    out = []
    for name, (path, body) in chosen.items():
        row = _run_probe(base, model, name, path, body, args)
        out.append(row)
        print(
            f"{name}: {row['status']} in {row['probe_s']:.2f}s | /health p50 {row['health_p50_ms']:.1f} "
            f"p99 {row['health_p99_ms']:.1f} max {row['health_max_ms']:.1f} ms (n={row['health_n']}) | "
            f"other tenant max {row['other_max_s'] or 0:.2f}s p50 {row['other_p50_s'] or 0:.2f}s "
            f"(n={row['other_n']}) | load {row['load_1m_before']:.2f}->{row['load_1m_after']:.2f} | "
            f"{(json.dumps(row['error']) if row['error'] else row['finish_reasons'])[:160]}",
            flush=True,
        )
    return out


def run(args: argparse.Namespace) -> int:
    unknown = set(args.probe) - set(probes())
    if unknown:
        raise ValueError(f"probe: unknown {sorted(unknown)}; known: {sorted(probes())}")
    if args.target is not None:
        rows = _drive(f"http://{args.target}", args.model, args)
    else:
        keys = ["--api-key", f"{KEY_A}:tenant-a", "--api-key", f"{KEY_B}:tenant-b"]
        with launch(args.model, keys + list(args.launch_arg)) as ports:
            rows = _drive(f"http://127.0.0.1:{ports['http_port']}", args.model, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar_stall.json").write_text(
        json.dumps({"rows": rows, "model": args.model, "machine": machine_info()}, indent=2)
    )
    print(f"wrote {out / 'grammar_stall.json'}")
    return 0
