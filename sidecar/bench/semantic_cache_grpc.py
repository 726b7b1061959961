"""End-to-end semantic cache timing over gRPC (``sidecar bench semantic-cache --grpc``).

Starts ``python -m sidecar serve`` as a subprocess on free ports and times, from
the client: (1) exact cache hits of one question, (2) semantic hits of
paraphrases from the eval set (each paraphrase asked once, so its embedding is
really computed), (3) generating the same answer with ``cache_control=skip``
and ``max_tokens`` tokens (``ignore_eos``, greedy), the cost a hit saves.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from sidecar.bench.semantic_pairs import latency_summary, load_pairs

QUESTION = "How do I check which process is using port 8080 on Linux?"


@contextlib.contextmanager
def serve(model: str, extra_args: tuple = (), timeout_s: float = 600.0) -> Iterator[str]:
    """Yield the gRPC target of a fresh sidecar (started and stopped by the serving bench's launcher)."""
    from sidecar.bench.serve_load import launch

    with launch(model, list(extra_args), timeout_s) as ports:
        yield f"127.0.0.1:{ports['grpc_port']}"


def measure_grpc(args) -> dict:
    import grpc

    from sidecar.v1 import sidecar_pb2 as pb
    from sidecar.v1 import sidecar_pb2_grpc as pbg

    sampling = pb.SamplingParams(max_tokens=args.grpc_max_tokens, temperature=0.0, ignore_eos=True)

    def request(prompt: str, control=pb.CACHE_CONTROL_DEFAULT):
        return pb.GenerateRequest(prompt=prompt, sampling=sampling, cache_control=control)

    def timed(stub, req):
        t0 = time.perf_counter()
        resp = stub.Generate(req, timeout=600)
        return time.perf_counter() - t0, resp

    def warm_store(stub, prompt):
        """Generate once, then wait until the asynchronous store makes the prompt an exact hit."""
        stub.Generate(request(prompt), timeout=600)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                stub.Generate(request(prompt, pb.CACHE_CONTROL_ONLY), timeout=30)
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                time.sleep(0.02)
        raise RuntimeError(f"answer for {prompt!r} never became a cache hit")

    positives = [p for p in load_pairs(args.pairs) if p["label"] == "hit"]
    out: dict = {"model": args.model, "max_tokens": args.grpc_max_tokens}
    with serve(args.model) as target, grpc.insecure_channel(target) as ch:
        stub = pbg.InferenceStub(ch)
        warm_store(stub, QUESTION)
        exact = []
        for _ in range(args.grpc_requests):
            dt, resp = timed(stub, request(QUESTION))
            if resp.cache.status != pb.CACHE_STATUS_HIT_EXACT:
                raise RuntimeError(f"expected an exact hit, got cache status {resp.cache.status}")
            exact.append(dt)
        out["exact_hit"] = latency_summary(exact)

        sample = positives[: min(20, len(positives))]
        for p in sample:
            warm_store(stub, p["cached"])
        semantic, statuses = [], {}
        for p in sample:
            dt, resp = timed(stub, request(p["query"]))
            name = pb.CacheStatus.Name(resp.cache.status)
            statuses[name] = statuses.get(name, 0) + 1
            if resp.cache.status == pb.CACHE_STATUS_HIT_SEMANTIC:
                semantic.append(dt)
        out["semantic_statuses"] = statuses
        if semantic:
            out["semantic_hit"] = latency_summary(semantic)

        generate = [
            timed(stub, request(QUESTION, pb.CACHE_CONTROL_SKIP))[0]
            for _ in range(max(3, min(20, args.grpc_requests // 10)))
        ]
        out["generate"] = latency_summary(generate)
        out["speedup_p50"] = out["generate"]["p50_ms"] / out["exact_hit"]["p50_ms"]
    return out
