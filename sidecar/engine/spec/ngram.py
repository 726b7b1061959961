"""N-gram prompt lookup: propose the tokens that followed the latest earlier
occurrence of the sequence's last n tokens (prompt and output so far)."""
from typing import List, Sequence, Tuple


def propose_ngram(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> List[int]:
    """Returns up to k proposed token ids; [] when no suffix of length min_n..max_n
    recurs earlier in `tokens`. Longer matches win (they predict better); among equal
    lengths one that is followed by k tokens wins (in a loop of period p the latest
    occurrence is followed by only p tokens), then the most recent (it reflects the
    current context).

    One backward pass over the sequence: every earlier position holding the last token
    is a candidate match end, extended backwards up to max_n tokens."""
    L = len(tokens)
    if k <= 0 or L < 2:
        return []
    last = tokens[L - 1]
    best: tuple = (0, 0)
    best_end = -1
    for e in range(L - 2, -1, -1):
        if tokens[e] != last:
            continue
        m = 1
        limit = min(max_n, e + 1)
        while m < limit and tokens[e - m] == tokens[L - 1 - m]:
            m += 1
        score = (m, min(k, L - 1 - e))
        if score > best:
            best, best_end = score, e
            if score == (max_n, k):
                break
    best_len = best[0]
    if best_len < min_n:
        return []
    return list(tokens[best_end + 1:best_end + 1 + k])


class NgramProposer:
    """Prompt lookup over each request's own tokens: no model, no state."""

    def propose(self, wants: Sequence[Tuple[object, int]]) -> None:
        for req, k in wants:
            req.spec_token_ids = propose_ngram(req.all_token_ids, k)

    def release(self, request_id: str) -> None:
        pass

    def counters(self) -> dict:
        return {}
