from sidecar.engine.spec.ngram import propose_ngram


def test_longest_match_proposes_continuation():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] (n=2; n=3 [5,2,3] absent) seen twice, once each followed by 9, 1, 2 and 7, 8, 5:
    # a tie, which goes to the earliest occurrence
    assert propose_ngram(toks, 3, max_n=3) == [9, 1, 2]
    assert propose_ngram(toks + [7], 3, max_n=3) == [8, 5, 2]  # [2, 3, 7] occurs once


def test_no_match_and_k_bounds():
    assert propose_ngram([1, 2, 3, 4], 4) == []
    assert propose_ngram([5, 6, 5], 0) == []
    assert propose_ngram([5, 6, 5], 4) == [6, 5, 6, 5]  # [5] recurs once; the loop 5, 6 is continued


def test_loop_prefers_an_occurrence_followed_by_k_tokens():
    toks = [9, 4, 4, 4, 4, 4, 4, 4]
    # The latest [4, 4, 4, 4] is followed by one token only; an earlier one yields the full k.
    assert propose_ngram(toks, 3) == [4, 4, 4]
    assert propose_ngram([7, 1, 2, 1, 2, 1, 2], 4, max_n=2) == [1, 2, 1, 2]


def test_earlier_occurrences_vote_on_the_continuation():
    # [3, 4] occurs three times before the end: twice followed by 5, 6 and most recently by 8, 9.
    toks = [3, 4, 5, 6, 0, 3, 4, 5, 6, 1, 3, 4, 8, 9, 2, 3, 4]
    assert propose_ngram(toks, 2) == [5, 6]
    # Only the occurrences that agree with a proposed token vote on the next one.
    toks = [1, 5, 7, 0, 1, 5, 7, 0, 1, 6, 2, 0, 1, 6, 3, 0, 1, 6, 3, 9, 1]
    assert propose_ngram(toks, 2, max_n=1) == [6, 3]
    # A tie goes to the earliest occurrence (in the prompt, for an answer that copies from it).
    assert propose_ngram([2, 7, 1, 2, 8, 0, 2], 1) == [7]


def test_a_longer_match_outvotes_shorter_ones():
    toks = [1, 2, 3, 4, 9, 5, 3, 4, 7, 6, 3, 4, 7, 1, 2, 3, 4]
    # [3, 4] is followed by 7 twice and by 9 once, but only the occurrence of [1, 2, 3, 4] counts.
    assert propose_ngram(toks, 1) == [9]


def test_a_short_loop_is_continued_past_the_end_of_the_sequence():
    # The longest match (six 4s) is the latest occurrence, followed by a single token: the lookup
    # repeats on the extended sequence and continues the loop.
    assert propose_ngram([9, 4, 4, 4, 4, 4, 4, 4, 4], 5) == [4, 4, 4, 4, 4]
    assert propose_ngram([7, 1, 2, 3, 1, 2, 3], 5) == [1, 2, 3, 1, 2]
