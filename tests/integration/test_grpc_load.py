"""100 concurrent streaming clients: only intended RESOURCE_EXHAUSTED errors, no leaked KV blocks."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg

CLIENTS = 100
MAX_SEQS = 16
MAX_WAITING = 24


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher(
        "--http-port",
        "-1",
        "--num-kv-blocks",
        "160",
        "--max-num-seqs",
        str(MAX_SEQS),
        "--max-waiting-requests",
        str(MAX_WAITING),
        "--max-num-batched-tokens",
        "512",
    ) as sc:
        yield sc


def request(rng: random.Random, i: int) -> pb.GenerateRequest:
    shared = "You are a helpful assistant for the load test. " if rng.random() < 0.5 else ""
    return pb.GenerateRequest(
        prompt=f"{shared}Client {i} asks question {rng.randint(0, 999)}",
        sampling=pb.SamplingParams(
            max_tokens=rng.randint(4, 24), temperature=0.8, seed=rng.randint(0, 2**31), ignore_eos=True
        ),
    )


async def all_blocks_free(stub) -> pb.EngineStats:
    for _ in range(600):
        s = await stub.GetStats(pb.GetStatsRequest())
        if s.num_free_kv_blocks == s.num_kv_blocks and s.num_running == 0 and s.num_waiting == 0:
            return s
        await asyncio.sleep(0.05)
    pytest.fail(f"KV blocks leaked: {s}")


def test_burst_beyond_queue_is_refused_at_once_with_retry_after(server):
    async def main():
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            stub = pbg.InferenceStub(ch)
            req = pb.GenerateRequest(
                prompt="burst", sampling=pb.SamplingParams(max_tokens=32, ignore_eos=True)
            )
            results = await asyncio.gather(
                *(stub.Generate(req) for _ in range(CLIENTS)), return_exceptions=True
            )
            ok = [r for r in results if isinstance(r, pb.Completion)]
            refused = [r for r in results if not isinstance(r, pb.Completion)]
            for e in refused:
                assert isinstance(e, grpc.aio.AioRpcError), e
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
                assert "queue is full" in e.details()
                assert int(dict(e.trailing_metadata())["retry-after-ms"]) > 0
            assert refused, "100 simultaneous requests must overflow max_num_seqs + max_waiting_requests"
            assert len(ok) >= MAX_SEQS and all(len(r.token_ids) == 32 for r in ok)
            await all_blocks_free(stub)

    asyncio.run(main())


def test_100_concurrent_streaming_clients_bounded_time(server):
    duration_s = 8.0

    async def client(stub, i: int, stats: dict) -> None:
        rng = random.Random(i)
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            req = request(rng, i)
            cancel_after = rng.randint(1, 3) if rng.random() < 0.15 else None
            call = stub.GenerateStream(req, timeout=120)
            chunks = 0
            try:
                async for chunk in call:
                    chunks += 1
                    if cancel_after is not None and chunks >= cancel_after:
                        call.cancel()
                        stats["cancelled"] += 1
                        break
                    if chunk.finish_reason:
                        assert chunk.usage.completion_tokens == req.sampling.max_tokens
                        stats["completed"] += 1
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    stats["refused"] += 1
                    await asyncio.sleep(int(dict(e.trailing_metadata())["retry-after-ms"]) / 1000.0)
                else:
                    stats["errors"].append((e.code(), e.details()))

    async def main():
        channels = [grpc.aio.insecure_channel(server.grpc_target) for _ in range(4)]
        try:
            stubs = [pbg.InferenceStub(ch) for ch in channels]
            stats = {"completed": 0, "cancelled": 0, "refused": 0, "errors": []}
            await asyncio.gather(*(client(stubs[i % 4], i, stats) for i in range(CLIENTS)))
            assert stats["errors"] == []
            assert stats["completed"] > 0
            final = await all_blocks_free(stubs[0])
            assert final.num_running == 0 and final.num_waiting == 0
            return stats
        finally:
            for ch in channels:
                await ch.close()

    stats = asyncio.run(main())
    print("load stats:", {k: v for k, v in stats.items() if k != "errors"})
