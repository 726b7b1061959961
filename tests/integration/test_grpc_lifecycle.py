"""Health while loading and draining, graceful SIGTERM with streams in flight, clean abort after the timeout."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def stream_in_thread(
    target: str, req: pb.GenerateRequest, first_chunk: threading.Event, out: dict
) -> threading.Thread:
    def run() -> None:
        chunks = []
        try:
            with grpc.insecure_channel(target) as ch:
                for c in pbg.InferenceStub(ch).GenerateStream(req, timeout=300):
                    chunks.append(c)
                    first_chunk.set()
            out["chunks"] = chunks
        except grpc.RpcError as exc:
            out["chunks"] = chunks
            out["error"] = (exc.code(), exc.details())
        finally:
            first_chunk.set()

    t = threading.Thread(target=run)
    t.start()
    return t


def wait_health(sc, want: int, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if sc.health() == want:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.02)
    pytest.fail(f"health never became {want}")


def test_not_serving_while_loading_then_serving(sidecar_launcher, tmp_path):
    # A fresh demo dir makes the server build the demo model, so loading takes a while.
    with sidecar_launcher(
        "--http-port", "-1", "--num-kv-blocks", "64", "--demo-dir", str(tmp_path / "demo"), wait_serving=False
    ) as sc:
        assert sc.health("sidecar.v1.Inference") == NOT_SERVING
        with grpc.insecure_channel(sc.grpc_target) as ch:
            with pytest.raises(grpc.RpcError) as exc:
                pbg.InferenceStub(ch).Generate(pb.GenerateRequest(prompt="hi"), timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in exc.value.details()
        wait_health(sc, SERVING, timeout=300)
        assert sc.health("sidecar.v1.Inference") == SERVING
        assert sc.stop() == 0


def test_sigterm_lets_streams_finish_and_refuses_new_calls(sidecar_launcher):
    with sidecar_launcher("--http-port", "-1", "--num-kv-blocks", "128", "--shutdown-timeout", "120") as sc:
        req = pb.GenerateRequest(
            prompt="Drain me gently", sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True)
        )
        outs = [dict() for _ in range(3)]
        firsts = [threading.Event() for _ in outs]
        threads = [stream_in_thread(sc.grpc_target, req, f, o) for f, o in zip(firsts, outs)]
        for f in firsts:
            assert f.wait(120)
        sc.signal(signal.SIGTERM)
        wait_health(sc, NOT_SERVING)
        with grpc.insecure_channel(sc.grpc_target) as ch:
            with pytest.raises(grpc.RpcError) as exc:
                pbg.InferenceStub(ch).Generate(pb.GenerateRequest(prompt="too late"), timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in exc.value.details()
        for t in threads:
            t.join(180)
        for o in outs:
            assert "error" not in o, o.get("error")
            assert o["chunks"][-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert sum(len(c.token_ids) for c in o["chunks"]) == 40
        sc.proc.wait(120)
        assert sc.proc.returncode == 0
        assert not sc.port_file.exists()


def test_shutdown_timeout_aborts_remaining_streams_cleanly(sidecar_launcher):
    with sidecar_launcher("--http-port", "-1", "--num-kv-blocks", "256", "--shutdown-timeout", "1") as sc:
        req = pb.GenerateRequest(
            prompt="Never ending", sampling=pb.SamplingParams(max_tokens=1900, ignore_eos=True)
        )
        out: dict = {}
        first = threading.Event()
        t = stream_in_thread(sc.grpc_target, req, first, out)
        assert first.wait(120)
        sc.signal(signal.SIGTERM)
        t.join(120)
        assert out["error"][0] == grpc.StatusCode.UNAVAILABLE
        assert "aborted at shutdown" in out["error"][1]
        assert 0 < sum(len(c.token_ids) for c in out["chunks"]) < 1900
        sc.proc.wait(60)
        assert sc.proc.returncode == 0


def test_second_signal_cuts_the_grace_period(sidecar_launcher):
    with sidecar_launcher("--http-port", "-1", "--num-kv-blocks", "256", "--shutdown-timeout", "600") as sc:
        req = pb.GenerateRequest(
            prompt="Keep going", sampling=pb.SamplingParams(max_tokens=1900, ignore_eos=True)
        )
        out: dict = {}
        first = threading.Event()
        t = stream_in_thread(sc.grpc_target, req, first, out)
        assert first.wait(120)
        sc.signal(signal.SIGTERM)
        wait_health(sc, NOT_SERVING)
        sc.signal(signal.SIGINT)
        t.join(120)
        assert out["error"][0] == grpc.StatusCode.UNAVAILABLE and "aborted at shutdown" in out["error"][1]
        sc.proc.wait(60)
        assert sc.proc.returncode == 0
