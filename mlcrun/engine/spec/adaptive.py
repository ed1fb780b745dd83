"""How many tokens to draft this step: the K that maximises expected tokens per second.

A step that verifies K drafted tokens per request yields, for a request whose drafts are
accepted with per-token probability a, (1 - a^(K+1)) / (1 - a) tokens on average; it costs a
verify of K + 1 tokens per sequence at this batch size and the batch's depth plus K draft
steps. Both costs are measured on this machine (CostModel, see cost.py); a comes from each
request's running acceptance of the kind of draft it gets this step (prompt lookup: per match
length, Request.acceptance). K = 0 is plain decoding, so speculation backs off by itself where it
does not pay (e.g. at large batch sizes, where a decode step is already compute-bound, or on
text the drafter cannot predict). A request that has not drafted for a while drifts back to
the prior acceptance, so it is tried again.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 4.0  # pseudo-trials behind the prior
DECAY = 0.97  # per step: older outcomes count less
# A request that has not drafted for this many steps drafts a few tokens anyway, so its
# acceptance is measured rather than assumed (a prior that says "no" would never be tested).
PROBE_EVERY = 16
GAIN = 1.02  # speculation must beat plain decoding by this much: noise in the cost table
PROBE_LENGTH = 2


DEPTH_STEP = 32  # depths are costed in buckets of this many tokens


@dataclass
class CostModel:
    """Seconds per step, measured: `verify[b][n]` is one verify of n tokens per sequence at
    batch b (n = 1 is a plain decode step) with `depth` tokens cached per sequence; `draft[b]`
    one draft-model decode step at batch b (empty for drafters without a model). Other points
    are interpolated.

    `deep[n]` is the verify of n tokens per sequence of `deep_batch` sequences `deep_depth`
    tokens deep: attention grows with the tokens cached, so a verify's cost over a plain step
    grows too (SmolLM2 q4 on 2 cores of an AVX2 EPYC: a 5-token verify 1.72x a plain step at
    64 tokens, 1.89x at 512; on an AVX-512 one 1.22x at 64 and 1.67x at 350). A verify at
    another depth adds, per sequence, the cost per sequence and token of depth measured
    between the two points times the depth beyond `depth` (attention is linear in the depth
    and in the sequences).

    `deep_draft` is the draft model's decode step of those sequences (0: no draft model, or
    not measured), for the same per-token growth of a draft step: a draft model's attention
    grows with the depth as the target's does (a self-draft's is the target's own shape), so
    a table that priced drafts at `depth` alone found them cheap beside depth-priced verifies
    and drafted where it cost throughput (16 requests, SmolLM2 F32 with its q4 self-draft,
    2 threads of a Xeon: 0.65-0.76x plain decoding, drafts made and then not verified; priced
    at their depth, no drafts and 0.93-0.97x)."""

    verify: dict[int, dict[int, float]] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    depth: int = 0
    deep: dict[int, float] = field(default_factory=dict)
    deep_depth: int = 0
    deep_draft: float = 0.0
    deep_batch: int = 1
    # Interpolated costs, asked for every step: (batch, tokens, depth bucket) -> seconds,
    # 0 tokens = a draft.
    _memo: dict[tuple[int, int, int], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def verify_cost(self, batch: int, tokens: int, depth: int | None = None) -> float:
        """One verify of `tokens` tokens per sequence for `batch` sequences `depth` tokens deep
        on average (None: the table's own depth)."""
        extra = self.depth_bucket(depth)
        cost = self._memo.get((batch, tokens, extra))
        if cost is None:
            cost = _interpolate(_nearest(self.verify, batch), tokens)
            if extra:
                shallow = _interpolate(_nearest(self.verify, self.deep_batch), tokens)
                cost += self._deeper(batch, extra, shallow, _interpolate(self.deep, tokens))
            self._memo[batch, tokens, extra] = cost
        return cost

    def depth_bucket(self, depth: int | None) -> int:
        """The DEPTH_STEP buckets `depth` lies beyond the table's depth (0: costed as measured);
        verifies in the same bucket cost the same."""
        if depth is None or not self.deep or depth <= self.depth:
            return 0
        return -(-(depth - self.depth) // DEPTH_STEP)

    def _deeper(self, batch: int, extra: int, shallow: float, deep: float) -> float:
        """What `extra` depth buckets add to a step of `batch` sequences whose step of
        `deep_batch` sequences costs `shallow` at the table's depth and `deep` at deep_depth:
        the growth per token and sequence between the two (never negative, whatever noise
        they hold), per sequence."""
        span = (self.deep_depth - self.depth) * self.deep_batch
        per_token = max(0.0, (deep - shallow) / span)
        return batch * extra * DEPTH_STEP * per_token

    def draft_cost(self, batch: int, depth: int | None = None) -> float:
        """One draft-model decode step of `batch` sequences `depth` tokens deep on average."""
        if not self.draft:
            return 0.0
        extra = self.depth_bucket(depth) if self.deep_draft else 0
        cost = self._memo.get((batch, 0, extra))
        if cost is None:
            cost = _interpolate(self.draft, batch)
            if extra:
                shallow = _interpolate(self.draft, self.deep_batch)
                cost += self._deeper(batch, extra, shallow, self.deep_draft)
            self._memo[batch, 0, extra] = cost
        return cost

    def to_dict(self) -> dict:
        return {
            "verify": {
                str(b): {str(n): t for n, t in row.items()} for b, row in self.verify.items()
            },
            "draft": {str(b): t for b, t in self.draft.items()},
            "depth": self.depth,
            "deep": {str(n): t for n, t in self.deep.items()},
            "deep_depth": self.deep_depth,
            "deep_draft": self.deep_draft,
            "deep_batch": self.deep_batch,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        verify = {
            int(b): {int(n): float(t) for n, t in row.items()} for b, row in data["verify"].items()
        }
        return cls(
            verify,
            {int(b): float(t) for b, t in data.get("draft", {}).items()},
            int(data.get("depth", 0)),
            {int(n): float(t) for n, t in data.get("deep", {}).items()},
            int(data.get("deep_depth", 0)),
            float(data.get("deep_draft", 0.0)),
            int(data.get("deep_batch", 1)),
        )


def _nearest(table: dict[int, dict[int, float]], key: int) -> dict[int, float]:
    """Rows are interpolated linearly in the batch size."""
    keys = sorted(table)
    if key <= keys[0]:
        return table[keys[0]]
    if key >= keys[-1]:
        return {n: t * key / keys[-1] for n, t in table[keys[-1]].items()}  # beyond: linear
    i = bisect.bisect_left(keys, key)
    lo, hi = keys[i - 1], keys[i]
    w = (key - lo) / (hi - lo)
    return {n: (1 - w) * table[lo][n] + w * table[hi][n] for n in table[lo] if n in table[hi]}


def _interpolate(row: dict[int, float], x: int) -> float:
    xs = sorted(row)
    if x <= xs[0]:
        return row[xs[0]]
    if x >= xs[-1]:  # beyond the measured sizes: extend the last slope
        if len(xs) == 1:
            return row[xs[0]] * x / xs[0]
        a, b = xs[-2], xs[-1]
        return row[b] + (row[b] - row[a]) / (b - a) * (x - b)
    i = bisect.bisect_left(xs, x)
    a, b = xs[i - 1], xs[i]
    return row[a] + (row[b] - row[a]) * (x - a) / (b - a)


class Acceptance:
    """A request's running per-token acceptance: decayed counts behind a prior."""

    def __init__(self) -> None:
        self.accepted = 0.0
        self.trials = 0.0
        self.idle_steps = 0  # steps since it last drafted

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)

    def update(self, drafted: int, accepted: int) -> None:
        """After a step: `accepted` of `drafted` chain tokens were kept (the first rejected
        one ended the chain, so it counts as a trial too)."""
        self.accepted = self.accepted * DECAY + accepted
        self.trials = self.trials * DECAY + accepted + (1 if accepted < drafted else 0)
        self.idle_steps = 0

    def idle(self) -> None:
        self.accepted *= DECAY
        self.trials *= DECAY
        self.idle_steps += 1

    @property
    def probe_due(self) -> bool:
        return self.idle_steps >= PROBE_EVERY


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step yields with k drafts, each kept with probability `rate` while all
    before it were: 1 + rate + ... + rate^k."""
    if rate >= 1.0:
        return k + 1.0
    return (1 - rate ** (k + 1)) / (1 - rate)


def best_draft_length(
    rates: Sequence[float], costs: CostModel, max_k: int, depth: int | None = None
) -> int:
    """The K for this step's batch (requests with these acceptance rates, `depth` tokens deep
    on average) that maximises expected tokens per second; 0 when plain decoding is as good."""
    batch = len(rates)
    if not batch:
        return 0
    best_k, best = 0, batch / costs.verify_cost(batch, 1, depth)
    for k in range(1, max_k + 1):
        seconds = costs.verify_cost(batch, k + 1, depth) + k * costs.draft_cost(batch, depth)
        speed = sum(expected_tokens(r, k) for r in rates) / seconds
        if speed > best * GAIN:  # a clear gain, not noise in the cost table
            best_k, best = k, speed
    return best_k


def verify_pays(
    costs: CostModel, batch: int, nodes: int, tokens: float, depth: int, drafting: float = 0.0
) -> bool:
    """Whether one verify of `nodes` tree nodes over `batch` sequences `depth` tokens deep,
    yielding `tokens` tokens on expectation, beats a plain step by GAIN; `drafting`: the
    seconds its drafts still cost (0 once they are made). A verify is costed as at least 2
    tokens per sequence: it runs other kernels than a decode step, so a batch of mostly
    one-node trees costs more than the rows suggest."""
    verify = costs.verify_cost(batch, max(2, round(nodes / batch)), depth) + drafting
    return tokens / verify > GAIN * batch / costs.verify_cost(batch, 1, depth)


def batch_depth(batch: Sequence) -> int:
    """The tokens cached per sequence, on average, in a batch of requests."""
    return sum(r.num_computed for r in batch) // max(len(batch), 1)
