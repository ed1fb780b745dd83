"""Choosing the next token from logits: numpy on the CPU, vectorised over the batch.

Processing order (as vLLM): logit_bias, the allowed mask, penalties (repetition, frequency,
presence), then temperature, top-k, top-p, min-p (relative to the top probability),
renormalise, and draw with the request's own rng. Every step works row by row (elementwise ops
and per-row reductions), so a row's result never depends on the other rows of the batch: a
seeded request gets the same tokens alone or batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import MlcrunError
from .types import SamplingParams

# top-p sorts only the tokens whose weight is at least one of these fractions of the row's
# total (at most 1024, then 16384 tokens) when they hold enough mass; else the whole row.
_TOP_P_FRACTIONS = (2.0**-10, 2.0**-14)
# The draw is a two-level inverse CDF: a block by its mass, then a token inside it. A full
# float64 cumsum over a 150k vocabulary costs more than the rest of the sampler.
_DRAW_BLOCK = 1024
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


class SamplerState:
    """One per request: its rng and the token history the penalties need."""

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int]) -> None:
        self.params = params
        # default_rng wants a non-negative seed; OpenAI seeds may be negative.
        seed = None if params.seed is None else params.seed % 2**64
        self.rng: np.random.Generator = np.random.default_rng(seed)
        self.prompt_token_ids = np.array(prompt_token_ids, dtype=np.int64).reshape(-1)
        self.output_token_ids: list[int] = []
        self._counts: dict[int, int] = {}  # generated token -> how often
        self._prompt_unique: np.ndarray | None = None

    def append(self, token: int) -> None:
        """Record a generated token (for the penalties)."""
        token = int(token)
        self.output_token_ids.append(token)
        self._counts[token] = self._counts.get(token, 0) + 1

    def pop(self, n: int = 1) -> None:
        """Forget the last n generated tokens (rejected speculative tokens)."""
        if not 0 <= n <= len(self.output_token_ids):
            raise MlcrunError(f"cannot pop {n} of {len(self.output_token_ids)} generated tokens")
        for _ in range(n):
            token = self.output_token_ids.pop()
            self._counts[token] -= 1
            if not self._counts[token]:
                del self._counts[token]

    def output_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct generated token ids, their counts), for frequency/presence penalties."""
        n = len(self._counts)
        ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=n)
        counts = np.fromiter(self._counts.values(), dtype=np.float32, count=n)
        return ids, counts

    def seen_token_ids(self) -> np.ndarray:
        """Distinct ids of the prompt and generated tokens, for the repetition penalty."""
        if self._prompt_unique is None:
            self._prompt_unique = np.unique(self.prompt_token_ids)
        generated = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
        return np.union1d(self._prompt_unique, generated)


@dataclass
class SampleResult:
    token: int
    # Of the chosen token, under the raw model distribution. Computed only when the request
    # asked for logprobs (logprobs=0 gives just this); NaN otherwise, as it costs a
    # full-vocabulary exp per row.
    logprob: float
    # Top-N (N = params.logprobs) of the raw distribution, plus the chosen token; None when the
    # request did not ask for logprobs.
    top_logprobs: dict[int, float] | None
    # Why this row could not be sampled (then `token` is -1); the other rows are unaffected.
    error: str | None = None
    # With drafts: which drafted candidate `token` is (None: not a candidate, a fresh draw).
    accepted: int | None = None


def sample_batch(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    states: Sequence[SamplerState],
    allowed: Sequence[np.ndarray | None] | None = None,
    drafts: Sequence[tuple[Sequence[int], np.ndarray | None] | None] | None = None,
) -> list[SampleResult]:
    """One token per row of logits [B, V]; allowed[i] is an optional bool mask [V] for row i.
    A row that cannot be sampled gets a SampleResult with `error`; the others are drawn as if
    it were not there.

    drafts[i] = (candidates, q): tokens a drafter proposed for row i's position, drawn from q
    without replacement (None: chosen deterministically). The token is then chosen by the
    lossless acceptance rule (spec/accept.py), so it still has exactly the distribution plain
    sampling draws from, and SampleResult.accepted says which candidate it is.
    """
    if allowed is None and drafts is None and all(map(plain_greedy, params)):
        return _greedy(logits, params, states)  # the common case, without the machinery
    from .spec.accept import accept_greedy, accept_sampled  # (spec imports this module)

    x, errors = _process(logits, params, states, allowed)  # [B, V] float32
    greedy, sampled = _split(params)
    tokens = np.full(x.shape[0], -1, dtype=np.int64)
    accepted: dict[int, int | None] = {}
    if greedy.size:
        tokens[greedy] = _rows(x, greedy).argmax(axis=1)
        for i in greedy:
            if drafts is not None and drafts[i] is not None and drafts[i][0]:
                tokens[i], accepted[i] = accept_greedy(int(tokens[i]), drafts[i][0])
    if sampled.size:
        weights = _filtered_weights(_rows(x, sampled), [params[i] for i in sampled])
        for row, i in enumerate(sampled):
            if i in errors:
                continue
            draft = drafts[i] if drafts is not None else None
            try:
                if draft is not None and draft[0]:
                    p = weights[row] / weights[row].sum(dtype=np.float64)
                    tokens[i], accepted[i] = accept_sampled(p, draft[0], draft[1], states[i].rng)
                else:
                    tokens[i] = draw(weights[row], states[i].rng)
            except MlcrunError as err:
                errors[i] = str(err)
    results = _results(np.asarray(logits), params, tokens, errors)
    for i, j in accepted.items():
        results[i].accepted = j
    return results


def probabilities(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    states: Sequence[SamplerState],
    allowed: Sequence[np.ndarray | None] | None = None,
) -> np.ndarray:
    """[B, V] float32: the exact distribution sample_batch draws from (one-hot when greedy)."""
    x = processed_logits(logits, params, states, allowed)
    greedy, sampled = _split(params)
    probs = np.zeros(x.shape, dtype=np.float32)
    if greedy.size:
        probs[greedy, _rows(x, greedy).argmax(axis=1)] = 1.0
    if sampled.size:
        weights = _filtered_weights(_rows(x, sampled), [params[i] for i in sampled])
        weights /= weights.sum(axis=1, keepdims=True, dtype=np.float64).astype(np.float32)
        probs[sampled] = weights
    return probs


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn in proportion to non-negative weights [V] (need not sum to 1)."""
    starts = _block_starts(weights.size)
    block_mass = np.add.reduceat(weights, starts, dtype=np.float64)  # [num_blocks]
    cdf = block_mass.cumsum()
    total = float(cdf[-1])
    if not total > 0:
        raise MlcrunError("cannot sample: every token has probability zero")
    target = rng.random() * total
    # The first block whose cdf exceeds target has mass; rounding may push past the end.
    b = min(int(cdf.searchsorted(target, side="right")), cdf.size - 1)
    while block_mass[b] == 0:
        b -= 1
    target -= cdf[b - 1] if b else 0.0
    begin = b * _DRAW_BLOCK
    block = weights[begin : begin + _DRAW_BLOCK]
    j = int(block.cumsum(dtype=np.float64).searchsorted(target, side="right"))
    if j >= block.size:  # rounding again: take the block's last token that has weight
        j = int(np.flatnonzero(block)[-1])
    return begin + j


_starts: dict[int, np.ndarray] = {}


def _block_starts(size: int) -> np.ndarray:
    """np.arange(0, size, _DRAW_BLOCK), made once per vocabulary size."""
    starts = _starts.get(size)
    if starts is None:
        starts = _starts[size] = np.arange(0, size, _DRAW_BLOCK)
        starts.flags.writeable = False
    return starts


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis; keeps a floating input's dtype."""
    x = np.asarray(x)
    dtype = x.dtype if np.issubdtype(x.dtype, np.floating) else np.float64
    return (x - _logsumexp(x)[..., None]).astype(dtype, copy=False)


def processed_logits(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    states: Sequence[SamplerState],
    allowed: Sequence[np.ndarray | None] | None = None,
) -> np.ndarray:
    """[B, V] float32 after logit_bias, the penalties and the allowed mask (before
    temperature); raises for the first row that cannot be processed.

    A copy when a row changed, else the input itself (as float32): do not write to it.
    """
    x, errors = _process(logits, params, states, allowed)
    if errors:
        raise MlcrunError(errors[min(errors)])
    return x


def _process(logits, params, states, allowed) -> tuple[np.ndarray, dict[int, str]]:
    """processed_logits, with the rows that failed (row -> message) instead of raising."""
    x = np.asarray(logits, dtype=np.float32)
    _check_shapes(x, params, states, allowed)
    copied, errors = False, {}
    for i, p in enumerate(params):
        mask = None if allowed is None else allowed[i]
        penalised = p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
        if p.logit_bias or mask is not None or penalised:
            if not copied:
                x, copied = x.copy(), True
            try:
                _process_row(x[i], p, states[i], mask)
            except MlcrunError as err:
                errors[i] = str(err)
                x[i] = 0.0  # keeps the vectorised steps finite; the row is not sampled
    return x, errors


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Refuse token ids the model does not have (call when a request is admitted)."""
    for name, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise MlcrunError(f"{name}: token id {bad[0]} is outside the vocabulary ({vocab_size})")


# -- internals --------------------------------------------------------------------------------


def plain_greedy(p: SamplingParams) -> bool:
    """Greedy, and nothing to do before the argmax or after it."""
    return (
        p.temperature == 0
        and p.logprobs is None
        and not p.logit_bias
        and p.repetition_penalty == 1
        and not p.frequency_penalty
        and not p.presence_penalty
    )


def _greedy(logits, params, states) -> list[SampleResult]:
    """sample_batch for rows that are all plain_greedy (no mask, no drafts): the argmax of
    each row, with the same checks and the same results as the general path."""
    x = np.asarray(logits, dtype=np.float32)  # as _process: the argmax of the float32 values
    _check_shapes(x, params, states, None)
    nan = float("nan")
    return [SampleResult(t, nan, None) for t in x.argmax(axis=1).tolist()]


def _check_shapes(x: np.ndarray, params, states, allowed) -> None:
    if x.ndim != 2:
        raise MlcrunError(f"logits must be [batch, vocab], got shape {x.shape}")
    if len(params) != x.shape[0] or len(states) != x.shape[0]:
        raise MlcrunError(
            f"{x.shape[0]} rows of logits for {len(params)} params and {len(states)} states"
        )
    if allowed is not None and len(allowed) != x.shape[0]:
        raise MlcrunError(f"{x.shape[0]} rows of logits for {len(allowed)} allowed masks")


def _split(params: Sequence[SamplingParams]) -> tuple[np.ndarray, np.ndarray]:
    """(greedy row indices, sampled row indices)."""
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if len(greedy) == len(params):
        return np.arange(len(params)), np.empty(0, np.int64)
    if not greedy:
        return np.empty(0, np.int64), np.arange(len(params))
    is_greedy = np.zeros(len(params), dtype=bool)
    is_greedy[greedy] = True
    return np.flatnonzero(is_greedy), np.flatnonzero(~is_greedy)


def _rows(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """x[idx] without a copy when idx is every row (idx is sorted and distinct)."""
    return x if idx.size == x.shape[0] else x[idx]


def _process_row(row: np.ndarray, p: SamplingParams, state: SamplerState, mask) -> None:
    """Apply logit_bias, the penalties and the mask to one row [V], in place. Finite logits
    stay finite (clamped to float32's range) and masked ones become -inf, so nothing later can
    compute inf - inf."""
    vocab = row.size
    if p.logit_bias:
        ids = np.array([t for t, _ in p.logit_bias], dtype=np.int64)
        bias = np.array([b for _, b in p.logit_bias], dtype=np.float32)
        inside = ids < vocab
        row[ids[inside]] += bias[inside]  # ids are distinct, so fancy += adds each once
    if p.repetition_penalty != 1:
        ids = state.seen_token_ids()
        ids = ids[ids < vocab]
        seen = row[ids]
        with np.errstate(over="ignore", divide="ignore"):  # clamped below
            row[ids] = np.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        ids, counts = state.output_counts()
        inside = ids < vocab
        row[ids[inside]] -= p.frequency_penalty * counts[inside] + p.presence_penalty
    np.clip(row, -_FLOAT32_MAX, _FLOAT32_MAX, out=row)
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (vocab,):
            raise MlcrunError(f"allowed mask has shape {mask.shape}, expected ({vocab},)")
        if not mask.any():
            raise MlcrunError("the allowed mask allows no token")
        row[~mask] = -np.inf


def _filtered_weights(x: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Unnormalised probabilities [S, V] float32 after temperature, top-k, top-p and min-p.

    x [S, V] is not modified. The top token always keeps weight exactly 1.
    """
    num_rows, vocab = x.shape
    # Clamped to float32's finite range: a tiny temperature gives 0 * big = 0 for the top
    # token (not 0 * inf), a huge one keeps -inf * small = -inf for masked tokens (not NaN).
    inv_temp = [min(max(1.0 / p.temperature, _FLOAT32_TINY), _FLOAT32_MAX) for p in params]
    with np.errstate(over="ignore"):
        # A difference beyond float32 is -inf (weight 0); so is a product beyond it.
        weights = x - x.max(axis=1, keepdims=True)
        if any(np.float32(t) != 1 for t in inv_temp):
            weights *= np.array(inv_temp, np.float32)[:, None]
    np.exp(weights, out=weights)

    # top-k: drop logits below the k-th largest (ties with it stay), grouped by k.
    top_k = np.array([p.top_k for p in params])
    for k in np.unique(top_k[(top_k > 0) & (top_k < vocab)]) if top_k.any() else ():
        rows = np.flatnonzero(top_k == k)
        sub = _rows(x, rows)
        kth = np.partition(sub, vocab - k, axis=1)[:, vocab - k]  # [rows]
        keep = sub >= kth[:, None]
        if rows.size == num_rows:
            weights *= keep  # a multiply beats masked stores on a random mask
        else:
            weights[rows] *= keep

    for i, p in enumerate(params):
        if p.top_p < 1:
            _top_p_row(weights[i], p.top_p)

    if not any(p.min_p > 0 for p in params):
        return weights
    min_p = np.array([p.min_p for p in params], dtype=np.float32)
    rows = np.flatnonzero(min_p > 0)
    if rows.size:
        sub = _rows(weights, rows)
        keep = sub >= min_p[rows, None] * sub.max(axis=1, keepdims=True)
        if rows.size == num_rows:
            weights *= keep
        else:
            weights[rows] *= keep
    return weights


def _top_p_row(weights: np.ndarray, top_p: float) -> None:
    """Keep the fewest most likely tokens holding >= top_p of the mass; zero the rest, in place.

    A token is kept when the mass strictly before it (sorted by weight, descending; ties by
    index) is below top_p, so the top token always stays. Sorts values only (no argsort), and
    only the heaviest tokens when they hold enough mass.
    """
    total = float(weights.sum(dtype=np.float64))
    target = top_p * total
    for fraction in _TOP_P_FRACTIONS:
        head = weights[weights >= np.float32(fraction * total)]  # at most 1/fraction tokens
        if head.sum(dtype=np.float64) >= target:
            break
    else:
        head = weights  # the nucleus reaches below the heads: sort them all
    ascending = np.sort(head)
    n = _nucleus_size(ascending[::-1], target)
    cut = ascending[-n]  # the lightest kept weight
    if not cut > 0:
        return
    greater = ascending.size - int(np.searchsorted(ascending, cut, side="right"))
    tied = ascending.size - greater - int(np.searchsorted(ascending, cut, side="left"))
    weights *= weights >= cut  # a multiply beats masked stores on a random mask
    if tied > n - greater:  # keep only the first (by index) of the tokens tied at the cut
        weights[np.flatnonzero(weights == cut)[n - greater :]] = 0


def _nucleus_size(descending: np.ndarray, target: float) -> int:
    """How many leading weights have a mass strictly before them below target (at least 1)."""
    starts = np.arange(0, descending.size, _DRAW_BLOCK)
    cdf = np.cumsum(np.add.reduceat(descending, starts, dtype=np.float64))  # [num_blocks]
    # Blocks before b end below target; those after b start at or above it.
    b = min(int(np.searchsorted(cdf, target, side="left")), cdf.size - 1)
    before = cdf[b - 1] if b else 0.0
    block = descending[starts[b] : starts[b] + _DRAW_BLOCK]
    mass_before = before + np.concatenate(([0.0], np.cumsum(block[:-1], dtype=np.float64)))
    return max(1, int(starts[b]) + int(np.searchsorted(mass_before, target, side="left")))


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) over the last axis, as float64 (-inf rows give -inf)."""
    top = np.max(x, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0)
    total = np.exp(x - top).sum(axis=-1).astype(np.float64)  # pairwise: float32 is enough
    with np.errstate(divide="ignore"):
        return np.log(total) + top[..., 0].astype(np.float64)


def _top_logprobs(row: np.ndarray, lse: float, chosen: int, n: int) -> dict[int, float]:
    """Top-n logprobs of one raw row [V] (best first), plus the chosen token's."""
    n = min(n, row.size)
    out: dict[int, float] = {}
    if n:
        nth = np.partition(row, row.size - n)[row.size - n]  # the n-th largest logit
        top = np.flatnonzero(row >= nth)  # n of them, or more with ties
        top = top[np.argsort(-row[top], kind="stable")[:n]]
        out = {int(t): float(row[t]) - lse for t in top}
    out.setdefault(chosen, float(row[chosen]) - lse)
    return out


def _results(raw: np.ndarray, params, tokens: np.ndarray, errors) -> list[SampleResult]:
    """SampleResults, with logprobs from the raw logits [B, V] for the rows that ask."""
    if not errors and all(p.logprobs is None for p in params):
        nan = float("nan")
        return [SampleResult(t, nan, None) for t in tokens.tolist()]
    wanted = np.array(
        [p.logprobs is not None and i not in errors for i, p in enumerate(params)], dtype=bool
    )
    lse = np.full(len(params), np.nan)
    if wanted.any():
        lse[wanted] = _logsumexp(_rows(raw, np.flatnonzero(wanted)))
    results = []
    for i, p in enumerate(params):
        token = int(tokens[i])
        if i in errors:
            results.append(SampleResult(-1, float("nan"), None, errors[i]))
        elif p.logprobs is None:
            results.append(SampleResult(token, float("nan"), None))
        else:
            top = _top_logprobs(raw[i], float(lse[i]), token, p.logprobs)
            results.append(SampleResult(token, top[token], top))
    return results
