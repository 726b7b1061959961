"""Multi-turn conversations over a fleet of replicas: session affinity vs round-robin vs one replica.

Starts ``--replicas`` ``sidecar serve`` processes (semantic cache off, so every turn reaches the engine)
and runs the same ``--conversations`` conversations of ``--turns`` turns, each turn resending the whole
conversation over the gRPC Chat RPC, ``--concurrency`` conversations at a time, routed three ways:

- ``one``: every call to replica 0 (what a single replica achieves);
- ``affinity``: consistent hashing of the conversation id over the replicas (the ring of the Java client's
  ``sidecar_session_affinity`` balancer: 160 points per replica, FNV-1a + splitmix64), so every turn of a
  conversation lands where its earlier turns' KV blocks are;
- ``round-robin``: each call to the next replica, as a client without affinity balances.

Each routing runs under its own cache salt, so no run reuses another's KV blocks while the prompts stay
identical token for token. Reported per routing: the cached share of prompt tokens (the replicas' own
``usage.cached_tokens``) over all turns and over turns after the first, and the share of later turns that
landed on the replica of their previous turn. Target: affinity within 10% of one replica's share.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

POINTS = 160  # ring points per replica, as in the Java balancer
_MASK = (1 << 64) - 1
MODES = ("one", "affinity", "round-robin")

_WORDS = (
    "brake chain wheel saddle pedal frame fork tyre valve spoke hub gear cable lever bell light rack "
    "mudguard pump helmet lock bottle cleat derailleur cassette crank headset stem grip tube rim"
).split()


def ring_hash(text: str) -> int:
    """64-bit FNV-1a of the UTF-8 bytes with a splitmix64 finaliser, as a signed 64-bit value (Java's long)."""
    h = 0xCBF29CE484222325
    for b in text.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & _MASK
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & _MASK
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & _MASK
    h ^= h >> 31
    return h - (1 << 64) if h >= 1 << 63 else h


class HashRing:
    """Consistent hashing of keys over replicas named by address: a key goes to the replica owning the first
    ring point at or after its hash (wrapping), so adding or removing a replica moves ~1/N of the keys."""

    def __init__(self, replicas: list[str], points: int = POINTS) -> None:
        if not replicas:
            raise ValueError("replicas: at least one is required")
        ring = {}
        for i, name in enumerate(replicas):
            for p in range(points):
                ring[ring_hash(f"{name}#{p}")] = i
        self._keys = sorted(ring)
        self._owner = [ring[k] for k in self._keys]

    def pick(self, key: str) -> int:
        i = bisect.bisect_left(self._keys, ring_hash(key))
        return self._owner[i % len(self._keys)]


class RoundRobin:
    """Each call to the next replica, whatever the key (thread-safe)."""

    def __init__(self, n: int) -> None:
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._n = n

    def pick(self, key: str) -> int:
        with self._lock:
            return next(self._next) % self._n


class OneReplica:
    def pick(self, key: str) -> int:
        return 0


def router(mode: str, replicas: list[str]):
    if mode == "affinity":
        return HashRing(replicas)
    if mode == "round-robin":
        return RoundRobin(len(replicas))
    if mode == "one":
        return OneReplica()
    raise ValueError(f"routing: must be one of {', '.join(MODES)}, got {mode!r}")


@dataclass(frozen=True)
class TurnRecord:
    conversation: str
    turn: int
    replica: int
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float = 0.0


def summarise(records: list[TurnRecord]) -> dict:
    """Cached share of prompt tokens overall and after each conversation's first turn, calls per replica, and
    the share of later turns that stayed on the replica of their previous turn."""

    def share(rows: list[TurnRecord]) -> float:
        prompt = sum(r.prompt_tokens for r in rows)
        return sum(r.cached_tokens for r in rows) / prompt if prompt else 0.0

    later = [r for r in records if r.turn > 0]
    where = {(r.conversation, r.turn): r.replica for r in records}
    stayed = sum(where.get((r.conversation, r.turn - 1)) == r.replica for r in later)
    calls: dict[int, int] = {}
    for r in records:
        calls[r.replica] = calls.get(r.replica, 0) + 1
    ttft = sorted(r.ttft_ms for r in later)
    return {
        "turns": len(records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "cached_share": share(records),
        "cached_share_after_first_turn": share(later),
        "same_replica_as_previous_turn": stayed / len(later) if later else 0.0,
        "calls_per_replica": dict(sorted(calls.items())),
        "ttft_p50_ms_after_first_turn": ttft[len(ttft) // 2] if ttft else 0.0,
    }


def conversations(n: int, turns: int, system_words: int, question_words: int, seed: int) -> list[dict]:
    """Deterministic scripts: a system prompt shared by all (a support desk's) and each conversation's questions."""
    rng = random.Random(seed)
    system = "You are the support desk of a bicycle shop. " + " ".join(
        rng.choice(_WORDS) for _ in range(system_words)
    )
    return [
        {
            "id": f"conversation-{i}",
            "system": system,
            "questions": [
                f"Question {t + 1} of customer {i}: "
                + " ".join(rng.choice(_WORDS) for _ in range(question_words))
                for t in range(turns)
            ],
        }
        for i in range(n)
    ]


def converse(
    script: dict, pick: Callable[[str], int], call: Callable[[int, list[dict]], tuple]
) -> list[TurnRecord]:
    """One conversation: every turn sends the whole history to ``pick(conversation id)``; ``call(replica,
    messages)`` returns (answer text, prompt tokens, cached tokens, ttft ms)."""
    history = [{"role": "system", "content": script["system"]}]
    out = []
    for t, q in enumerate(script["questions"]):
        history.append({"role": "user", "content": q})
        replica = pick(script["id"])
        text, prompt, cached, ttft = call(replica, history)
        history.append({"role": "assistant", "content": text})
        out.append(TurnRecord(script["id"], t, replica, prompt, cached, ttft))
    return out


def run_routing(
    mode: str, scripts: list[dict], replicas: list[str], call: Callable, concurrency: int
) -> list:
    pick = router(mode, replicas).pick
    with ThreadPoolExecutor(concurrency) as pool:
        return [r for rows in pool.map(lambda s: converse(s, pick, call), scripts) for r in rows]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3, help="sidecar serve processes")
    p.add_argument(
        "--model",
        default="demo",
        help="model every replica serves ('demo', or a path/name; "
        "SmolLM2-135M-Instruct is the trained default)",
    )
    p.add_argument("--routing", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="conversations running at once")
    p.add_argument("--system-words", type=int, default=40)
    p.add_argument("--question-words", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer (greedy, EOS ignored)")
    p.add_argument("--num-kv-blocks", type=int, default=2048, help="KV blocks per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--launch-arg", action="append", default=[], help="extra `sidecar serve` flag (repeatable)"
    )
    p.add_argument("--out", default="bench-results")


def _grpc_call(stubs: list, max_tokens: int, salt: str) -> Callable[[int, list[dict]], tuple]:
    from sidecar.v1 import sidecar_pb2 as pb

    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def call(replica: int, messages: list[dict]) -> tuple:
        req = pb.ChatRequest(
            messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
            sampling=sampling,
            cache_salt=salt,
        )
        c = stubs[replica].Chat(req, timeout=600)
        return c.text, c.usage.prompt_tokens, c.usage.cached_tokens, c.timing.ttft_ms

    return call


def run(args: argparse.Namespace) -> int:
    import grpc

    from sidecar.bench.report import format_table, write_report
    from sidecar.bench.serve_load import launch
    from sidecar.v1 import sidecar_pb2_grpc as pbg

    modes = [m.strip() for m in args.routing.split(",") if m.strip()]
    for m in modes:
        router(m, ["x"])  # names the bad routing before anything starts
    if args.replicas < 1:
        raise ValueError("--replicas: must be >= 1")
    scripts = conversations(args.conversations, args.turns, args.system_words, args.question_words, args.seed)
    extra = ["--no-semantic-cache", "--num-kv-blocks", str(args.num_kv_blocks), *args.launch_arg]
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        ports = [stack.enter_context(launch(args.model, extra)) for _ in range(args.replicas)]
        addresses = [f"127.0.0.1:{p['grpc_port']}" for p in ports]
        stubs = [pbg.InferenceStub(stack.enter_context(grpc.insecure_channel(a))) for a in addresses]
        for run_no, mode in enumerate(modes):
            t0 = time.perf_counter()
            rows = run_routing(
                mode,
                scripts,
                addresses,
                _grpc_call(stubs, args.max_tokens, f"fleet-{run_no}-{mode}"),
                args.concurrency,
            )
            results[mode] = dict(summarise(rows), routing=mode, seconds=time.perf_counter() - t0)
            r = results[mode]
            print(
                f"{mode:12s}: cached share {r['cached_share']:.1%} (after turn 1: "
                f"{r['cached_share_after_first_turn']:.1%}), same replica as previous turn "
                f"{r['same_replica_as_previous_turn']:.0%}, calls per replica {r['calls_per_replica']}",
                flush=True,
            )
    summary = _ratios(results)
    cols = [
        "routing",
        "turns",
        "prompt_tokens",
        "cached_tokens",
        "cached_share",
        "cached_share_after_first_turn",
        "same_replica_as_previous_turn",
        "ttft_p50_ms_after_first_turn",
        "seconds",
    ]
    print(format_table(list(results.values()), cols))
    if summary:
        print(format_table([summary], list(summary)))
    jpath, ppath = write_report(
        args.out,
        "fleet",
        {
            "command": "sidecar bench fleet",
            "args": {k: v for k, v in vars(args).items() if k != "_run"},
            "results": results,
            "summary": summary,
        },
        bars={
            "cached share of prompt tokens": {m: r["cached_share"] for m, r in results.items()},
            "after the first turn": {m: r["cached_share_after_first_turn"] for m, r in results.items()},
        },
    )
    print(f"wrote {jpath} and {ppath}")
    return 0


def _ratios(results: dict[str, dict]) -> dict:
    """Affinity's and round-robin's cached share relative to one replica's (1.0 = as good as one replica)."""
    one: Optional[dict] = results.get("one")
    if not one or not one["cached_share"]:
        return {}
    out = {}
    for mode in ("affinity", "round-robin"):
        if mode in results:
            out[f"{mode}_vs_one_replica"] = results[mode]["cached_share"] / one["cached_share"]
    if "affinity" in results:
        out["affinity_within_10pct_of_one_replica"] = out["affinity_vs_one_replica"] >= 0.9
    return out
