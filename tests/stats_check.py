"""A chi-square goodness-of-fit test without scipy, for the sampling tests."""

from __future__ import annotations

import math

import numpy as np

P_THRESHOLD = 1e-3


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi2(dof): the regularised upper incomplete gamma Q(dof/2, x/2)."""
    a, x = dof / 2, x / 2
    if x <= 0:
        return 1.0
    log_prefix = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for the lower function P
        term = total = 1 / a
        n = a
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1 - total * math.exp(log_prefix))
    # Lentz's continued fraction for Q
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_prefix) * h


def assert_draws_follow(tokens: np.ndarray, expected: np.ndarray) -> None:
    """Tokens outside expected's support never drawn; a chi-square test on the rest."""
    counts = np.bincount(tokens, minlength=expected.size)
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens {np.flatnonzero(counts * ~support)}"
    want = expected[support] / expected[support].sum() * tokens.size
    got = counts[support]
    small = want < 5  # pool the rare tokens into one bin, as chi-square needs
    if small.any():
        want = np.append(want[~small], want[small].sum())
        got = np.append(got[~small], got[small].sum())
    if want.size < 2:
        return
    stat = float(((got - want) ** 2 / want).sum())
    p_value = chi2_sf(stat, want.size - 1)
    assert p_value > P_THRESHOLD, f"chi2={stat:.1f}, dof={want.size - 1}, p={p_value:.2e}"
