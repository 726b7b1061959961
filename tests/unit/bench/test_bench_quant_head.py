"""``sidecar bench quant`` measures the head precision ``LLM()`` defaults to and names both systems' heads."""

from __future__ import annotations

import argparse

import gguf
import pytest

from sidecar.bench.quant import add_arguments, gguf_head_type, head_precision
from sidecar.config import DEFAULT_MODEL, EngineConfig
from sidecar.model.gguf import find_gguf


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_default_head_setting_is_llms():
    assert _args().quantize_lm_head == EngineConfig().quantize_lm_head == "auto"
    assert _args("--no-quantize-lm-head").quantize_lm_head == "none"
    assert _args("--quantize-lm-head", "same").quantize_lm_head == "same"
    with pytest.raises(SystemExit):
        _args("--quantize-lm-head", "int3")


@pytest.mark.parametrize(
    "mode,setting,head",
    [("int4", "auto", "int8"), ("int8", "auto", "int8"), ("bf16", "auto", "bf16"), ("int4", "same", "int4")]
    + [("int4", "none", "bf16"), ("int8", "int4", "int4")],
)
def test_head_precision(mode, setting, head):
    assert head_precision(mode, setting) == head


def test_gguf_head_type_reads_the_file():
    path = find_gguf(DEFAULT_MODEL)
    names = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "output.weight" not in names  # SmolLM2 ties its head to the embedding
    assert gguf_head_type(path) == f"{names['token_embd.weight']} (tied token_embd)"
