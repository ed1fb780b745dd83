"""Lossless acceptance of drafted tokens at one position of a token tree.

The target's distribution `p` is exactly what plain sampling would draw from at this position
(penalties, masks, temperature, top-k/p, min-p applied). The drafted candidates are tried in
order; candidate j was drawn from the draft distribution q_j (or chosen deterministically,
q_j = one-hot). Candidate j is accepted with probability min(1, p_j(c) / q_j(c)); when it is
rejected the target's residual becomes p_{j+1} = norm(max(p_j - q_j, 0)). When every candidate
is rejected the token is drawn from the last residual. For one candidate this is the standard
speculative-sampling rule; for several it is recursive rejection sampling, and when the
candidates were drawn from q without replacement (a draft model's alternatives at a tree
node), q_j is q with the earlier candidates removed and renormalised. Either way the token has
exactly the distribution p.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..sampler import draw


def accept_sampled(
    p: np.ndarray,
    candidates: Sequence[int],
    q: np.ndarray | None,
    rng: np.random.Generator,
) -> tuple[int, int | None]:
    """(token, index of the accepted candidate, or None when the token is a residual draw).

    p [V]: the target's probabilities (sum 1). q [V]: the draft distribution the candidates
    were drawn from, in order and without replacement; None when they were chosen
    deterministically (prompt lookup, a greedy draft): then each q_j is one-hot.
    """
    residual = p.astype(np.float64)
    if q is not None:
        q = q.astype(np.float64)
    for j, token in enumerate(candidates):
        total = residual.sum()
        if not total > 0:
            break  # rounding ate the residual (p == q): nothing left to correct
        p_c = residual[token] / total
        if q is None:  # one-hot q_j: accept with probability p_j(c)
            if rng.random() < p_c:
                return int(token), j
            residual[token] = 0.0
            continue
        q_c = q[token]
        if q_c > 0 and rng.random() < min(1.0, p_c / q_c):
            return int(token), j
        residual = np.maximum(residual / total - q, 0.0)
        q[token] = 0.0  # the next candidate was drawn without this one
        q_total = q.sum()
        if q_total > 0:
            q /= q_total
    if not residual.sum() > 0:
        residual = p.astype(np.float64)
    return draw(residual, rng), None


def accept_greedy(p_argmax: int, candidates: Sequence[int]) -> tuple[int, int | None]:
    """Greedy: a candidate is kept only when it is the target's argmax."""
    for j, token in enumerate(candidates):
        if token == p_argmax:
            return int(token), j
    return int(p_argmax), None
