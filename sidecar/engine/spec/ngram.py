"""N-gram prompt lookup: propose the tokens that followed the latest earlier
occurrence of the sequence's last n tokens (prompt and output so far)."""
from typing import List, Sequence


def propose_ngram(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> List[int]:
    """Returns up to k proposed token ids; [] when no suffix of length min_n..max_n
    recurs earlier in `tokens`. Longer matches are tried first (they predict better);
    among equal lengths the most recent occurrence wins (it reflects the current context)."""
    if k <= 0:
        return []
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = list(tokens[L - n:])
        # Start positions whose n-gram ends before the suffix itself begins to overlap the end.
        for start in range(L - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + k])
                if follow:
                    return follow
    return []
