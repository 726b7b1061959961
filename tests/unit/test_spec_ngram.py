from sidecar.engine.spec.ngram import propose_ngram


def test_longest_most_recent_match_proposes_continuation():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] (n=2; n=3 [5,2,3] absent) last seen at index 5 -> followed by 7, 8, 5
    assert propose_ngram(toks, 3, max_n=3) == [7, 8, 5]


def test_no_match_and_k_bounds():
    assert propose_ngram([1, 2, 3, 4], 4) == []
    assert propose_ngram([5, 6, 5], 0) == []
    assert propose_ngram([5, 6, 5], 4) == [6, 5]
