from sidecar.engine.spec.ngram import propose_ngram


def test_longest_most_recent_match_proposes_continuation():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] (n=2; n=3 [5,2,3] absent) last seen at index 5 -> followed by 7, 8, 5
    assert propose_ngram(toks, 3, max_n=3) == [7, 8, 5]


def test_no_match_and_k_bounds():
    assert propose_ngram([1, 2, 3, 4], 4) == []
    assert propose_ngram([5, 6, 5], 0) == []
    assert propose_ngram([5, 6, 5], 4) == [6, 5]


def test_loop_prefers_an_occurrence_followed_by_k_tokens():
    toks = [9, 4, 4, 4, 4, 4, 4, 4]
    # The latest [4, 4, 4, 4] is followed by one token only; an earlier one yields the full k.
    assert propose_ngram(toks, 3) == [4, 4, 4]
    assert propose_ngram([7, 1, 2, 1, 2, 1, 2], 4, max_n=2) == [1, 2, 1, 2]
