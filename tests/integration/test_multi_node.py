"""Two "nodes" on loopback: node 0 is ``sidecar serve --nnodes 2 --node-rank 0 --master-port P`` (it serves),
node 1 ``sidecar serve ... --node-rank 1`` (it only runs its rank, taking its inputs over the rendezvous
store). Pipeline stages by flags, tensor-parallel ranks by torchrun's environment variables; answers equal one
process's, a rank killed on node 1 mid-stream ends the stream with an error and both nodes exit non-zero, and
a vanished node 1 (its agent gone, its rank stopped) is ended by the heartbeat watchdog within seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile

import openai
import psutil
import pytest
from openai import OpenAI

from sidecar import LLM, SamplingParams

PROMPT = "Pipeline stages on two hosts"
MODEL_ARGS = ("--model", "demo", "--device", "cpu", "--dtype", "float32")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _second_node(split: tuple, port: int, env: dict | None = None, flags: bool = True):
    """Node 1's ``sidecar serve``: by flags, or (``flags`` False) by torchrun's variables in ``env``."""
    rdzv = ("--nnodes", "2", "--node-rank", "1", "--master-port", str(port)) if flags else ()
    log = tempfile.NamedTemporaryFile(prefix="sidecar-node1-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve", *MODEL_ARGS, *split, *rdzv],
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        log.close()
        os.unlink(log.name)


def _reference(max_tokens: int) -> str:
    llm = LLM(model="demo", dtype="float32", device="cpu", num_kv_blocks=64)
    return llm.generate(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].text


def _complete(server, **kw):
    client = OpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(
        model="demo", prompt=PROMPT, temperature=0.0, extra_body={"ignore_eos": True}, **kw
    )


def test_pipeline_stages_on_two_nodes_answer_and_fail_together(sidecar_launcher):
    port = _free_port()
    split = ("--pipeline-parallel-size", "2")
    with _second_node(split, port) as node1:
        with sidecar_launcher(
            *MODEL_ARGS[2:], *split, "--num-kv-blocks", "64", "--nnodes", "2", "--master-port", str(port)
        ) as server:
            assert _complete(server, max_tokens=10).choices[0].text == _reference(10)
            (rank1,) = [
                p for p in psutil.Process(node1.pid).children() if "spawn_main" in " ".join(p.cmdline())
            ]
            stream = _complete(server, max_tokens=900, stream=True)
            got = 0
            with pytest.raises(openai.APIError) as e:
                for _ in stream:
                    got += 1
                    if got == 3:
                        os.kill(rank1.pid, signal.SIGKILL)
            assert "rank 1" in str(e.value.body or e.value.message)
            server.proc.wait(60)
            assert server.proc.returncode == 1
            assert "pipeline-parallel worker rank 1" in server.log()
            assert "exited with code -9" in server.log()
        node1.wait(60)
        assert node1.returncode == 1


def test_tensor_parallel_ranks_rendezvous_through_torchrun_variables():
    """Node 1 takes its place from torchrun's variables; node 0 is an in-process LLM (its rank 1 is remote, so
    it spawns nothing). Closing node 0 ends node 1 cleanly."""
    port = _free_port()
    torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "1"}
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with _second_node(("--tensor-parallel-size", "2"), port, env=torchrun, flags=False) as node1:
        llm = LLM(
            model="demo",
            dtype="float32",
            device="cpu",
            num_kv_blocks=64,
            tensor_parallel_size=2,
            nnodes=2,
            master_port=port,
        )
        try:
            assert llm.engine.tp.procs[1].pid is not None  # joined from node 1
            assert llm.generate(PROMPT, params)[0].text == _reference(10)
        finally:
            llm.engine.tp.close()
        node1.wait(60)
        assert node1.returncode == 0


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_a_vanished_host_is_ended_by_the_watchdog_not_the_collective_timeout(monkeypatch, split):
    """Node 1's agent is killed and its rank stopped: nothing reports an exit or ends it, and its connections
    stay open and silent (a host gone from the network). Rank 0's all-reduce (tensor) or its send / receive
    (pipeline) would wait for the collective timeout (made long here); it waits in slices instead, and ends
    once the heartbeat watchdog ends the rank."""
    import threading

    from sidecar.engine import tp

    monkeypatch.setattr(tp, "COLLECTIVE_TIMEOUT_S", 600.0)
    port = _free_port()
    torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "1"}
    with _second_node((f"--{split}-parallel-size", "2"), port, env=torchrun, flags=False) as node1:
        llm = LLM(
            model="demo",
            dtype="float32",
            device="cpu",
            num_kv_blocks=64,
            nnodes=2,
            master_port=port,
            **{f"{split}_parallel_size": 2},
        )
        eng = llm.engine
        (rank1,) = [p for p in psutil.Process(node1.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        try:
            rid = eng.add_request(None, [5, 6, 7, 8], SamplingParams(max_tokens=200, ignore_eos=True))
            outs = {o.request_id: o for o in eng.step()}
            node1.kill()
            node1.wait(30)
            rank1.suspend()

            def drive() -> None:
                while eng.has_unfinished_requests():
                    outs.update((o.request_id, o) for o in eng.step())

            driver = threading.Thread(target=drive, daemon=True)
            driver.start()
            driver.join(120)  # a fifth of the collective timeout
            assert not driver.is_alive(), "rank 0 waited on the vanished rank's collective"
            assert outs[rid].finish_reason == "abort"
            assert f"{split}-parallel worker rank 1" in outs[rid].abort_reason
            assert "after its heartbeat stopped for" in outs[rid].abort_reason
            assert eng.tp.watchdog.hung.keys() == {1}
        finally:
            rank1.kill()  # its connections close: nothing of the group is left waiting
            eng.tp.close()
