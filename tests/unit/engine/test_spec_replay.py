"""The n-gram replay behind ``sidecar bench spec``'s replayed speedup: batch-1 speculation counted in
steps over a recorded greedy output must make the engine's own choices (the same verifications and accepted
tokens)."""

from __future__ import annotations

import random

from sidecar import LLM, SamplingParams
from sidecar.engine.spec.ngram import replay


def test_a_copy_is_verified_in_full_proposals_after_the_first_token():
    para = list(range(10, 40))
    # token 0 from the prompt's forward; step 1 proposes 11..14 on a one-token match (free steps: k = 4),
    # then 4 tokens and the target's own a step until 3 are left before the end
    assert replay([1, 2] + para, para, [1.0] * 5) == (6, 23, 6.0)


def test_replay_makes_the_engines_choices(demo_dir):
    rng = random.Random(5)
    phrase = [rng.randrange(3, 250) for _ in range(7)]
    prompts = [(phrase * 6)[:40], [rng.randrange(3, 250) for _ in range(30)] + phrase * 2]
    llm = LLM(
        model=str(demo_dir),
        dtype="float32",
        speculative="ngram",
        num_speculative_tokens=4,
        speculative_token_cost=0.125,  # prices 1 + k / 8, exact in binary and in the stats' rounding
        speculative_max_batch=8,
    )
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    costs = llm.stats()["spec_decode_step_costs"]
    assert costs == [1.0, 1.125, 1.25, 1.375, 1.5]
    verified = 0
    for p in prompts:  # one request at a time: batch 1, as the replay
        before = llm.stats()
        out = llm.generate([p], params)[0]
        after = llm.stats()
        v, a, price = replay(out.prompt_token_ids, out.token_ids, costs)
        assert v == after["spec_decode_verifications"] - before["spec_decode_verifications"]
        assert a == after["spec_decode_accepted_tokens"] - before["spec_decode_accepted_tokens"]
        assert price <= len(out.token_ids) - 1
        verified += v
    assert verified > 0
