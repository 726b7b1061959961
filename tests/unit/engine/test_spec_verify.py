import torch

from sidecar.engine.sampling_rng import KeyedDraws
from sidecar.engine.spec.verify import verify_greedy, verify_sampled


def test_greedy_accepts_prefix_and_takes_target_token():
    assert verify_greedy([4, 5, 6], [4, 5, 9, 1]) == (2, 9)
    assert verify_greedy([4, 5], [4, 5, 7]) == (2, 7)
    assert verify_greedy([], [3]) == (0, 3)


def test_point_mass_rejection_preserves_target_distribution():
    # First emitted token must follow p[0] whatever the deterministic proposal is.
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    counts = torch.zeros(3)
    n = 20000
    for stream in range(n):  # one request (stream) per trial, all at the same position
        acc, tok = verify_sampled([1], p, None, KeyedDraws(stream, 7))
        counts[1 if acc == 1 else tok] += 1
    chi2 = (((counts - n * p[0]) ** 2) / (n * p[0])).sum().item()
    assert chi2 < 13.8  # chi-square, 2 dof: P(false failure) ~ 0.001


def test_draft_rejection_preserves_target_distribution():
    # A proposal drawn from q is accepted with min(1, p/q), else the residual max(0, p - q) is drawn:
    # the emitted token follows p whatever q is.
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(3)
    n = 20000
    for stream in range(n):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        acc, tok = verify_sampled([x], p, q, KeyedDraws(stream, 3))
        counts[x if acc == 1 else tok] += 1
    chi2 = (((counts - n * p[0]) ** 2) / (n * p[0])).sum().item()
    assert chi2 < 13.8  # chi-square, 2 dof: P(false failure) ~ 0.001


def test_keyed_verification_is_reproducible_and_keyed_by_position():
    p = torch.full((3, 50), 1 / 50, dtype=torch.float64)
    runs = {verify_sampled([4, 9], p, None, KeyedDraws(11, 20)) for _ in range(3)}
    assert len(runs) == 1  # a pure function of (stream, position)
    bonus = {verify_sampled([], p, None, KeyedDraws(11, pos))[1] for pos in range(40)}
    assert len(bonus) > 15  # other positions draw other tokens
