"""Which proposals speculation makes: the n-gram lookup's match length picks the acceptance estimate that
prices a proposal, so failed short-match guesses never hold back a copy that has started."""

from __future__ import annotations

from sidecar import SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine.request import Request
from sidecar.engine.spec.decoder import SpecDecoder
from sidecar.engine.spec.ngram import lookup_ngram
from sidecar.engine.spec.state import MAX_COOLDOWN_STEPS, STRONG_MATCH, SpecState

COSTS = [1.0, 1.15, 1.3, 1.45, 1.6]


def test_lookup_reports_the_match_length():
    toks = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4]
    assert lookup_ngram(toks, 2) == ([5, 6], 3)  # [2, 3, 4] recurs
    assert lookup_ngram([7, 1, 8, 1], 1) == ([8], 1)
    assert lookup_ngram([1, 2, 3], 2) == ([], 0)


def test_failed_weak_guesses_leave_strong_matches_speculating():
    st = SpecState(COSTS)
    for _ in range(12):  # a preamble the prompt does not hold: one-token matches keep guessing wrong
        if st.choose_k(match_len=1):
            st.update(1, 0)
    assert st.weak.cooldown > 0 and st.choose_k(match_len=1) == 0  # weak guesses are backed off
    assert st.choose_k(match_len=STRONG_MATCH) == 4  # the copy starts: full proposals at once
    for _ in range(MAX_COOLDOWN_STEPS):  # and stays on while drafts are mostly right
        st.update(4, 4 if st.strong.successes < 100 else 3)
        assert st.choose_k(match_len=6) == 4
    st.update(4, 3)
    assert st.weak.cooldown > 0  # the strong outcomes do not move the weak estimate


def test_decoder_proposes_on_every_step_of_a_copy_after_failed_guesses():
    cfg = EngineConfig(speculative="ngram", num_speculative_tokens=4, speculative_token_cost=0.15)
    dec = SpecDecoder(cfg, kv=None, max_model_len=4096)
    para = list(range(100, 140))
    req = Request("r", [1, 2, 3, 50, 60, 70] + para, SamplingParams(max_tokens=200))
    req.num_computed_tokens = req.num_tokens - 1
    st = req.spec_state = SpecState(dec.costs)
    for _ in range(12):
        st.choose_k(match_len=1)
        st.update(1, 0)  # weak guesses failed before the copy
    proposed_steps = 0
    for tok in [9, 100, 101, 102] + para[3:]:  # the answer's own opening token, then the copy
        req.output_token_ids.append(tok)
        req.all_token_ids.append(tok)
        req.num_computed_tokens = req.num_tokens - 1
        dec.propose([req])
        if req.spec_token_ids:
            proposed_steps += 1
            rest = para[para.index(tok) + 1 :]
            assert req.spec_token_ids[: len(rest)] == rest[: len(req.spec_token_ids)]
            st.update(len(req.spec_token_ids), len(req.spec_token_ids))
    # Every step after the third copied token holds a strong match and proposes.
    assert proposed_steps >= len(para) - 3
