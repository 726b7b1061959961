"""Semantic-cache outcome over the OpenAI API: the ``x-sidecar-cache`` header, unary and streaming.

The shared launcher always passes ``--no-semantic-cache``, so this module starts
its own ``sidecar serve`` with the cache on (embedding model from the offline
PyPI copy of all-MiniLM-L6-v2).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT_S = float(os.environ.get("SIDECAR_TEST_START_TIMEOUT", "300"))


@pytest.fixture(scope="module")
def base():
    work = pathlib.Path(tempfile.mkdtemp(prefix="sidecar-openai-cache-"))
    port_file, log_path = work / "ports.json", work / "sidecar.log"
    cmd = [
        sys.executable,
        "-m",
        "sidecar",
        "serve",
        "--model",
        "demo",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--port-file",
        str(port_file),
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            if url is None and port_file.exists():
                url = f"http://127.0.0.1:{json.loads(port_file.read_text())['http_port']}"
            if url is not None:
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        else:
            pytest.fail(f"sidecar not serving within {START_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _chat(base: str, question: str, **kw) -> httpx.Response:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
        **kw,
    }
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def test_second_identical_question_is_a_cache_hit(base):
    first = _chat(base, "What is the capital of France?")
    assert first.status_code == 200 and first.headers["x-sidecar-cache"] == "miss"
    for _ in range(50):  # the answer is stored just after the response is sent
        again = _chat(base, "What is the capital of France?")
        if again.headers["x-sidecar-cache"] == "hit":
            break
        time.sleep(0.1)
    assert again.headers["x-sidecar-cache"] == "hit"
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    assert again.json()["usage"]["completion_tokens"] == first.json()["usage"]["completion_tokens"]

    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.headers["x-sidecar-cache"] == "hit"
        chunks = [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == first.json()["choices"][0]["message"]["content"]


def test_cache_control_skip_and_sampled_requests_bypass(base):
    assert _chat(base, "Name a prime number.", cache_control="skip").headers["x-sidecar-cache"] == "bypass"
    assert _chat(base, "Name a prime number.", temperature=0.8, seed=1).headers["x-sidecar-cache"] == "bypass"
    r = _chat(base, "A question nobody asked before?", cache_control="only")
    assert r.status_code == 404 and r.json()["error"]["code"] == "cache_miss"
