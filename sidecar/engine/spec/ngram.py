"""N-gram prompt lookup: propose what most often followed the sequence's last n tokens earlier in the
prompt and the output so far."""

from collections import Counter
from typing import List, Sequence, Tuple

from sidecar.engine.spec.state import SpecState

MAX_N = 6


def propose_ngram(tokens: Sequence[int], k: int, max_n: int = MAX_N, min_n: int = 1) -> List[int]:
    """Returns up to k proposed token ids; [] when no suffix of length min_n..max_n recurs earlier in
    `tokens` (``lookup_ngram`` without the match length)."""
    return lookup_ngram(tokens, k, max_n, min_n)[0]


def lookup_ngram(tokens: Sequence[int], k: int, max_n: int = MAX_N, min_n: int = 1) -> Tuple[List[int], int]:
    """Up to k proposed token ids and the length of the suffix match that proposed the first of them (0 with
    no proposal).

    The longest recurring suffix wins (it predicts best). Its earlier occurrences vote on the
    continuation one token at a time: the most frequent next token is proposed and only the
    occurrences that agree with it vote on the token after. A tie goes to the earliest occurrence:
    an answer that copies from its input (summaries, rewrites, extraction, code edits) copies the
    prompt, and the prompt comes first (on the input-grounded prompts of ``sidecar bench spec`` this
    predicted better than the most recent occurrence, which the output itself may have just varied).
    When every remaining occurrence runs into the end of the sequence (a loop whose period is shorter
    than k), the proposal so far is appended and the lookup repeats, so the loop is continued. One
    backward pass over the sequence per lookup: every earlier position holding the last token is a
    candidate match end, extended backwards up to max_n tokens."""
    out: List[int] = []
    seq, match = tokens, 0
    while len(out) < k:
        more, n = _vote(seq, k - len(out), max_n, min_n)
        if not more:
            break
        match = match or n
        out.extend(more)
        if len(out) < k:
            seq = list(seq) + more
    return out, match


def _vote(tokens: Sequence[int], k: int, max_n: int, min_n: int) -> Tuple[List[int], int]:
    L = len(tokens)
    if k <= 0 or L < 2:
        return [], 0
    last = tokens[L - 1]
    best_len, ends = 0, []
    for e in range(L - 2, -1, -1):
        if tokens[e] != last:
            continue
        m = 1
        limit = min(max_n, e + 1)
        while m < limit and tokens[e - m] == tokens[L - 1 - m]:
            m += 1
        if m > best_len:
            best_len, ends = m, [e]
        elif m == best_len:
            ends.append(e)  # most recent first
    if best_len < min_n:
        return [], 0
    out: List[int] = []
    for i in range(1, k + 1):
        ends = [e for e in ends if e + i < L]
        if not ends:
            break
        votes = Counter(tokens[e + i] for e in ends)
        top = max(votes.values())
        tok = next(
            tokens[e + i] for e in reversed(ends) if votes[tokens[e + i]] == top
        )  # the earliest of the tied
        out.append(tok)
        ends = [e for e in ends if tokens[e + i] == tok]
    return out, best_len


def replay(prompt: Sequence[int], output: Sequence[int], costs: Sequence[float]) -> tuple[int, int, float]:
    """Replays batch-1 n-gram speculation (``SpecDecoder.propose`` and greedy ``_verify`` for one running
    request) over a recorded greedy ``output`` of ``prompt``, counting steps instead of running them. The
    first token comes from the prompt's forward; at each decode step after it ``lookup_ngram`` proposes up
    to ``len(costs) - 1`` tokens (never past the output's end), the request's SpecState chooses how many to
    verify at prices ``costs`` (``costs[k]``: a step verifying k tokens, a plain step costing 1), and the
    proposal is accepted up to its first token that differs from the output, as greedy verification does.
    Returns (verifications, accepted tokens, the price of the decode steps in plain steps);
    ``(len(output) - 1) / price`` is the decode speedup the prices predict."""
    st, t, n = SpecState(list(costs)), 1, len(output)
    seq, verifications, accepted, price = list(prompt) + list(output), 0, 0, 0.0
    while t < n:
        cap = min(len(costs) - 1, n - t - 1)
        tokens: list[int] = []
        if cap > 0:
            tokens, match = lookup_ngram(seq[: len(prompt) + t], cap)
            tokens = tokens[: st.choose_k(costs, match)] if tokens else []
        a = 0
        while a < len(tokens) and tokens[a] == output[t + a]:
            a += 1
        if tokens:
            st.update(len(tokens), a)
            verifications += 1
            accepted += a
        price += costs[len(tokens)]
        t += a + 1
    return verifications, accepted, price


class NgramProposer:
    """Prompt lookup over each request's own tokens: no model, no state. The lookup is cheap, so the decoder
    runs it before choosing a proposal length (``lookup``), and the match length decides which acceptance
    estimate prices it (spec/state.py)."""

    looks_up_first = True
    replay = staticmethod(replay)

    def lookup(self, req, k: int) -> Tuple[List[int], int]:
        return lookup_ngram(req.all_token_ids, k)

    def propose(self, wants: Sequence[Tuple[object, int]]) -> None:
        for req, k in wants:
            req.spec_token_ids = propose_ngram(req.all_token_ids, k)

    def release(self, request_id: str) -> None:
        pass

    def counters(self) -> dict:
        return {}
