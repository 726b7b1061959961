"""``sidecar serve --tensor-parallel-size 2`` (demo model, gloo on CPU): an OpenAI request answers with the
tokens one process computes, and a worker killed mid-stream ends the stream with an error and the server
with a non-zero exit."""

from __future__ import annotations

import os
import signal
import time

import openai
import psutil
import pytest
from openai import OpenAI

from sidecar import LLM, SamplingParams

PROMPT = "Tensor parallel decoding splits every layer"


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher("--tensor-parallel-size", "2", "--dtype", "float32", "--num-kv-blocks", "64") as sc:
        yield sc


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0, timeout=120)


def _worker(server) -> psutil.Process:
    """The spawned rank 1 (multiprocessing's resource tracker is a child too)."""
    kids = [
        p
        for p in psutil.Process(server.proc.pid).children()
        if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert len(kids) == 1, [p.cmdline() for p in kids]
    return kids[0]


def test_completion_equals_one_process(client):
    r = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    llm = LLM(model="demo", dtype="float32", device="cpu", num_kv_blocks=64)
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert r.choices[0].text == ref.text
    assert r.usage.completion_tokens == 12


def test_killed_worker_ends_the_stream_and_the_server(server, client):
    """Last in this module: the server exits."""
    worker = _worker(server)
    stream = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=900, stream=True, extra_body={"ignore_eos": True}
    )
    got = 0
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            got += 1
            if got == 3:
                os.kill(worker.pid, signal.SIGKILL)
    assert "rank 1" in str(e.value.body or e.value.message)
    server.proc.wait(60)
    assert server.proc.returncode == 1
    assert "tensor-parallel worker rank 1" in server.log()
    deadline = time.monotonic() + 10
    while worker.is_running() and time.monotonic() < deadline:
        time.sleep(0.1)
