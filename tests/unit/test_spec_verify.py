import torch

from sidecar.engine.spec.verify import verify_greedy, verify_sampled


def test_greedy_accepts_prefix_and_takes_target_token():
    assert verify_greedy([4, 5, 6], [4, 5, 9, 1]) == (2, 9)
    assert verify_greedy([4, 5], [4, 5, 7]) == (2, 7)
    assert verify_greedy([], [3]) == (0, 3)


def test_point_mass_rejection_preserves_target_distribution():
    # First emitted token must follow p[0] whatever the deterministic proposal is.
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    n = 20000
    for _ in range(n):
        acc, tok = verify_sampled([1], p, None, gen)
        counts[1 if acc == 1 else tok] += 1
    chi2 = (((counts - n * p[0]) ** 2) / (n * p[0])).sum().item()
    assert chi2 < 13.8  # chi-square, 2 dof: P(false failure) ~ 0.001
