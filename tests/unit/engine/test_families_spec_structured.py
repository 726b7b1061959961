"""N-gram speculation and structured output on the Qwen3, Gemma 2, Gemma 3 and Phi-3 checkpoints
(tests/unit/model/family_checkpoints.py): speculative greedy equal to plain greedy and to HF transformers token
for token (verification rows carry the q/k norms, Gemma's sqrt(hidden) embedding scale and its attention and
final soft-caps), and JSON-schema output that validates, from greedy and seeded sampling."""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import pytest

from sidecar import LLM, SamplingParams
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.engine.test_structured import HIDDEN, pool_whole
from tests.unit.model.family_checkpoints import FAMILIES, build_family_checkpoint

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
# HIDDEN without its unbounded-precision number: random weights may extend a fraction past any budget.
SCHEMA = copy.deepcopy(HIDDEN)
del SCHEMA["properties"]["score"]
SCHEMA["required"].remove("score")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("spec-families")
    return {k: build_family_checkpoint(k, root / k, demo_dir) for k in FAMILIES}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 900) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.mark.parametrize("kind", FAMILIES)
def test_ngram_speculation_equals_plain_greedy_and_hf(family_dirs, kind):
    d = family_dirs[kind]
    prompts = _prompts(8, seed=11)
    plain = [o.token_ids for o in LLM(model=str(d), dtype="float32").generate(prompts, GREEDY)]
    assert plain == hf_greedy(d, prompts, GREEDY.max_tokens)
    llm = LLM(
        model=str(d),
        dtype="float32",
        speculative="ngram",
        speculative_token_cost=0.0,  # verify every proposal: the most verification rows
        speculative_max_batch=64,
        block_size=8,
        max_num_batched_tokens=64,
    )
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    s = llm.stats()
    assert s["spec_decode_verifications"] > 0 and s["spec_decode_proposed_tokens"] > 0
    # Forty tokens bring these checkpoints into loops the n-gram table predicts, so proposals are accepted;
    # Phi-3's tiny checkpoint does not repeat, and there the check is that verification rows equal decode.
    if kind != "phi3":
        assert s["spec_decode_accepted_tokens"] > 0
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_tied", "gemma2", "gemma3"])
def test_json_schema_output_validates(family_dirs, kind):
    llm = LLM(model=str(family_dirs[kind]), dtype="float32", block_size=8)
    params = [SamplingParams(max_tokens=150, temperature=1.0, seed=i, structured=SCHEMA) for i in range(8)]
    params.append(SamplingParams(max_tokens=150, structured=SCHEMA))  # greedy under the mask
    prompts = ["hello", "a", "The weather", "x y z"] * 2 + ["hi"]
    outs = llm.generate(prompts, params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # seeds give different documents: the sampler ran under the mask
    free = llm.generate(prompts[-1:], SamplingParams(max_tokens=20))[0].text
    assert not free.startswith("{")  # the schema, not the model, made the JSON
    assert pool_whole(llm.engine)
