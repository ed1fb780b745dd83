"""The sampler: distributions (chi-square), penalties, masks, seeds, logprobs, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from stats_check import assert_draws_follow, chi2_sf

from mlcrun.engine.sampler import (
    SamplerState,
    check_vocab,
    draw,
    log_softmax,
    probabilities,
    processed_logits,
    sample_batch,
)
from mlcrun.engine.types import SamplingParams
from mlcrun.errors import MlcrunError


def test_chi2_sf_matches_tables():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-6)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-6)
    assert chi2_sf(124.34211340400407, 100) == pytest.approx(0.05, rel=1e-6)
    assert chi2_sf(0.21072103131565253, 2) == pytest.approx(0.9, rel=1e-6)


def draws(logits: np.ndarray, params: SamplingParams, num: int = 20_000, seed: int = 0):
    """num tokens drawn from one row of logits: a batch of 2000 rows, each with its own rng."""
    rows = 2000
    seeds = np.random.SeedSequence(seed).spawn(rows)
    states = [SamplerState(params, ()) for _ in range(rows)]
    for state, s in zip(states, seeds):
        state.rng = np.random.default_rng(s)
    batch = np.broadcast_to(logits, (rows, logits.size))
    out = []
    for _ in range(num // rows):
        out += [r.token for r in sample_batch(batch, [params] * rows, states)]
    return np.array(out)


# -- numpy references -------------------------------------------------------------------------


def softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def reference_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """softmax(logits / T), then top-k, top-p, min-p, renormalised (float64)."""
    probs = softmax(np.asarray(logits, dtype=np.float64) / temperature)
    if top_k:
        kth = np.sort(logits)[::-1][top_k - 1]
        probs = np.where(logits >= kth, probs, 0)
        probs /= probs.sum()
    if top_p < 1:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros(probs.size, dtype=bool)
        keep[order[before < top_p]] = True
        probs = np.where(keep, probs, 0)
        probs /= probs.sum()
    if min_p:
        probs = np.where(probs >= min_p * probs.max(), probs, 0)
        probs /= probs.sum()
    return probs


def random_logits(vocab: int, seed: int, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def probs_of(logits, params, state=None, allowed=None) -> np.ndarray:
    state = state or SamplerState(params, ())
    masks = None if allowed is None else [allowed]
    return probabilities(np.asarray(logits)[None], [params], [state], masks)[0]


# -- distributions ----------------------------------------------------------------------------

FILTERS = {
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.8),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=0.9, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "all": dict(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("name", FILTERS)
def test_draws_follow_the_filtered_distribution(name):
    kwargs = FILTERS[name]
    logits = random_logits(40, seed=1)
    expected = reference_distribution(logits, **kwargs)
    tokens = draws(logits, SamplingParams(**kwargs))
    assert_draws_follow(tokens, expected)
    if name != "temperature" and name != "hot":
        assert (expected == 0).any()  # the filter did cut something


@pytest.mark.parametrize("name", FILTERS)
def test_probabilities_equal_the_reference(name):
    kwargs = FILTERS[name]
    logits = random_logits(40, seed=2)
    got = probs_of(logits, SamplingParams(**kwargs))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference_distribution(logits, **kwargs), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.7, top_p=0.9),  # the nucleus is among the heaviest tokens
        dict(temperature=2.0, top_p=0.99),  # flat: top-p sorts the whole row
        dict(temperature=1.0, top_p=0.5, top_k=3000, min_p=0.01),
    ],
)
def test_probabilities_on_a_large_vocabulary(kwargs):
    logits = random_logits(151_936, seed=3, scale=3.0)
    got = probs_of(logits, SamplingParams(**kwargs))
    want = reference_distribution(logits, **kwargs)
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert got.sum(dtype=np.float64) == pytest.approx(1.0, abs=1e-5)


def test_large_vocabulary_draws_stay_in_the_nucleus():
    logits = random_logits(151_936, seed=4, scale=3.0)
    params = SamplingParams(temperature=0.8, top_p=0.7)
    expected = reference_distribution(logits, temperature=0.8, top_p=0.7)
    states = [SamplerState(params, ()) for _ in range(64)]
    for i, state in enumerate(states):
        state.rng = np.random.default_rng(i)
    tokens = [
        r.token for r in sample_batch(np.broadcast_to(logits, (64, 151_936)), [params] * 64, states)
    ]
    assert all(expected[t] > 0 for t in tokens)


def test_top_p_ties_keep_the_lowest_indices():
    logits = np.zeros(10, dtype=np.float32)
    got = probs_of(logits, SamplingParams(top_p=0.35))  # mass before the 5th token is 0.4
    np.testing.assert_allclose(got, [0.25] * 4 + [0] * 6, atol=1e-7)
    big = probs_of(np.zeros(151_936, np.float32), SamplingParams(top_p=0.5))
    assert np.flatnonzero(big).tolist() == list(range(151_936 // 2))


def test_top_k_keeps_ties_and_minus_one_means_off():
    logits = np.array([3, 1, 2, 2, 0], dtype=np.float32)
    got = probs_of(logits, SamplingParams(top_k=2))
    assert np.flatnonzero(got).tolist() == [0, 2, 3]  # the tie at the 2nd value stays
    assert SamplingParams(top_k=-1).top_k == 0
    assert (probs_of(logits, SamplingParams(top_k=-1)) > 0).all()


def test_draw_over_blocks_never_picks_zero_weights():
    rng = np.random.default_rng(5)
    weights = np.zeros(5000, dtype=np.float32)
    support = np.array([0, 1023, 1024, 2047, 3000, 4999])  # both sides of block edges
    weights[support] = [1, 2, 3, 4, 5, 6]
    tokens = np.array([draw(weights, rng) for _ in range(6000)])
    assert_draws_follow(tokens, weights / weights.sum())
    with pytest.raises(MlcrunError, match="probability zero"):
        draw(np.zeros(10, np.float32), rng)


def test_tiny_temperature_is_finite():
    logits = random_logits(50, seed=6)
    got = probs_of(logits, SamplingParams(temperature=1e-40))
    assert np.isfinite(got).all() and got[np.argmax(logits)] == 1


# -- greedy, masks ----------------------------------------------------------------------------


def test_greedy_is_the_argmax_of_processed_logits():
    logits = random_logits(100, seed=7)
    top = int(np.argmax(logits))
    greedy = SamplingParams(temperature=0)
    assert sample_batch(logits[None], [greedy], [SamplerState(greedy, ())])[0].token == top
    second = int(np.argsort(-logits)[1])
    biased = SamplingParams(temperature=0, logit_bias={second: 100})
    state = SamplerState(biased, ())
    assert sample_batch(logits[None], [biased], [state])[0].token == second
    assert np.flatnonzero(probs_of(logits, biased)).tolist() == [second]
    assert probs_of(logits, biased)[second] == 1


def test_allowed_mask_is_respected():
    logits = random_logits(64, seed=8)
    allowed = np.zeros(64, dtype=bool)
    allowed[[3, 17, 40]] = True
    params = SamplingParams(temperature=1.0)
    expected = np.where(allowed, softmax(logits), 0)
    tokens = draws_with_mask(logits, params, allowed)
    assert_draws_follow(tokens, expected / expected.sum())
    greedy = SamplingParams(temperature=0)
    result = sample_batch(logits[None], [greedy], [SamplerState(greedy, ())], [allowed])[0]
    assert result.token == int(np.argmax(np.where(allowed, logits, -np.inf)))
    np.testing.assert_allclose(
        probs_of(logits, params, allowed=allowed), expected / expected.sum(), atol=1e-6
    )
    with pytest.raises(MlcrunError, match="allows no token"):
        probs_of(logits, params, allowed=np.zeros(64, dtype=bool))
    with pytest.raises(MlcrunError, match="shape"):
        probs_of(logits, params, allowed=np.ones(63, dtype=bool))


def draws_with_mask(logits, params, allowed, rows=500, steps=20):
    states = [SamplerState(params, ()) for _ in range(rows)]
    for i, state in enumerate(states):
        state.rng = np.random.default_rng(100 + i)
    batch = np.broadcast_to(logits, (rows, logits.size))
    tokens = []
    for _ in range(steps):
        results = sample_batch(batch, [params] * rows, states, [allowed] * rows)
        tokens += [r.token for r in results]
    return np.array(tokens)


def test_mixed_rows_mask_only_their_own_row():
    logits = np.stack([random_logits(30, seed=9), random_logits(30, seed=10)])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    states = [SamplerState(p, ()) for p in params]
    only_5 = np.zeros(30, dtype=bool)
    only_5[5] = True
    probs = probabilities(logits, params, states, [only_5, None])
    assert probs[0, 5] == 1 and probs[0].sum() == 1
    np.testing.assert_allclose(probs[1], softmax(logits[1]), atol=1e-6)


# -- penalties and bias -----------------------------------------------------------------------


def test_penalties_and_bias_change_exactly_the_right_logits():
    vocab = 32
    logits = random_logits(vocab, seed=11, scale=3.0)
    prompt = [1, 2, 2, 5, 9]
    generated = [5, 7, 7, 7, 12]
    params = SamplingParams(
        temperature=1.0,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.7,
        logit_bias={0: 4.0, 7: -2.5, 31: 1.0},
    )
    state = SamplerState(params, prompt)
    for t in generated:
        state.append(t)

    want = logits.copy()
    for token, bias in {0: 4.0, 7: -2.5, 31: 1.0}.items():
        want[token] += np.float32(bias)
    for token in set(prompt) | set(generated):  # repetition: prompt and generated tokens
        want[token] = want[token] / 1.3 if want[token] > 0 else want[token] * 1.3
    for token in set(generated):  # frequency and presence: generated tokens only
        want[token] -= np.float32(0.5 * generated.count(token) + 0.7)

    got = processed_logits(logits[None], [params], [state])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    untouched = sorted(set(range(vocab)) - set(prompt) - set(generated) - {0, 7, 31})
    assert np.array_equal(got[untouched], logits[untouched])
    assert (logits[[1, 2, 5, 9, 7, 12]] > 0).any() and (logits[[1, 2, 5, 9, 7, 12]] < 0).any()
    np.testing.assert_allclose(probs_of(logits, params, state), softmax(want), atol=1e-6)


def test_frequency_and_presence_ignore_the_prompt():
    logits = random_logits(16, seed=12)
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    state = SamplerState(params, [3, 3, 4])
    got = processed_logits(logits[None], [params], [state])[0]
    assert np.array_equal(got, logits)
    state.append(4)
    state.append(4)
    got = processed_logits(logits[None], [params], [state])[0]
    assert got[4] == pytest.approx(logits[4] - 3.0)
    assert np.array_equal(np.delete(got, 4), np.delete(logits, 4))
    state.pop(2)
    assert np.array_equal(processed_logits(logits[None], [params], [state])[0], logits)
    with pytest.raises(MlcrunError, match="pop"):
        state.pop(1)


def test_processing_does_not_touch_the_input():
    logits = random_logits(16, seed=13)[None]
    before = logits.copy()
    params = SamplingParams(repetition_penalty=2.0, logit_bias={1: 5}, top_p=0.5, min_p=0.2)
    state = SamplerState(params, [1, 2, 3])
    probabilities(logits, [params], [state])
    sample_batch(logits, [params], [state], [np.ones(16, dtype=bool)])
    assert np.array_equal(logits, before)


# -- seeds ------------------------------------------------------------------------------------


def test_seeded_request_is_independent_of_its_batch():
    vocab, steps = 1000, 40
    steps_logits = [random_logits(vocab, seed=100 + s, scale=2.5) for s in range(steps)]
    seeded = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=200, seed=1234, repetition_penalty=1.1
    )
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, top_k=5, frequency_penalty=0.3),
        SamplingParams(temperature=1.2, min_p=0.05, logprobs=3),
        SamplingParams(temperature=0.7, top_p=0.5),
    ]

    def run(batch_params, row):
        states = [SamplerState(p, [1, 2, 3]) for p in batch_params]
        rng = np.random.default_rng(99)
        tokens = []
        for logits in steps_logits:
            noise = rng.standard_normal((len(batch_params), vocab)).astype(np.float32)
            batch = logits + noise
            batch[row] = logits
            results = sample_batch(batch, batch_params, states)
            for state, result in zip(states, results):
                state.append(result.token)
            tokens.append(results[row].token)
        return tokens

    alone = run([seeded], 0)
    batched = run(others[:3] + [seeded] + others[3:], 3)
    assert alone == batched
    assert len(set(alone)) > 5
    assert run([SamplingParams(**{**_kwargs(seeded), "seed": 1235})], 0) != alone
    assert run([seeded], 0) == alone


def _kwargs(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def test_negative_seeds_work():
    a = SamplerState(SamplingParams(seed=-5), ()).rng.random()
    b = SamplerState(SamplingParams(seed=-5), ()).rng.random()
    assert a == b


# -- logprobs ---------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_distribution():
    logits = random_logits(500, seed=14, scale=3.0)
    raw_lp = log_softmax(logits.astype(np.float64))
    best5 = set(np.argsort(-logits)[:5].tolist())
    params = SamplingParams(temperature=1.5, logprobs=5, repetition_penalty=1.5, logit_bias={3: 50})
    state = SamplerState(params, [int(np.argmax(logits))])
    for _ in range(20):
        result = sample_batch(logits[None], [params], [state])[0]
        assert result.logprob == pytest.approx(raw_lp[result.token], abs=1e-5)
        assert best5 <= set(result.top_logprobs) and result.token in result.top_logprobs
        assert len(result.top_logprobs) == (5 if result.token in best5 else 6)
        for token, lp in result.top_logprobs.items():
            assert lp == pytest.approx(raw_lp[token], abs=1e-5)
        assert list(result.top_logprobs)[:5] == sorted(best5, key=lambda t: -logits[t])


def test_logprobs_zero_and_none():
    logits = random_logits(50, seed=15)
    zero = SamplingParams(temperature=0, logprobs=0)
    result = sample_batch(logits[None], [zero], [SamplerState(zero, ())])[0]
    assert list(result.top_logprobs) == [result.token]
    assert result.logprob == pytest.approx(log_softmax(logits.astype(np.float64))[result.token])
    off = SamplingParams(temperature=0)
    result = sample_batch(logits[None], [off], [SamplerState(off, ())])[0]
    assert result.top_logprobs is None and math.isnan(result.logprob)


def test_log_softmax():
    x = np.array([[1.0, 2.0, 3.0], [0.0, -np.inf, 0.0]], dtype=np.float32)
    got = log_softmax(x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(np.exp(got).sum(axis=1), 1, rtol=1e-6)
    np.testing.assert_allclose(got[0], x[0] - np.log(np.exp(x[0]).sum()), rtol=1e-6)
    assert got[1, 1] == -np.inf and got[1, 0] == pytest.approx(np.log(0.5))


# -- shapes and validation -------------------------------------------------------------------------


def test_shape_errors():
    params = SamplingParams()
    with pytest.raises(MlcrunError, match="batch, vocab"):
        sample_batch(np.zeros(5, np.float32), [params], [SamplerState(params, ())])
    with pytest.raises(MlcrunError, match="rows of logits"):
        sample_batch(np.zeros((2, 5), np.float32), [params], [SamplerState(params, ())])


def test_check_vocab():
    check_vocab(SamplingParams(logit_bias={9: 1}, stop_token_ids=[9]), 10)
    with pytest.raises(MlcrunError, match="logit_bias"):
        check_vocab(SamplingParams(logit_bias={10: 1}), 10)
    with pytest.raises(MlcrunError, match="stop_token_ids"):
        check_vocab(SamplingParams(stop_token_ids=[10]), 10)


# -- SamplingParams validation ----------------------------------------------------------------

INVALID = [
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=2.5)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.1)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.5)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("frequency_penalty", dict(frequency_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-2.1)),
    ("presence_penalty", dict(presence_penalty=-3)),
    ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=-1)),
    ("n", dict(n=0)),
    ("logit_bias", dict(logit_bias={1: 101})),
    ("logit_bias", dict(logit_bias={1: -100.5})),
    ("logit_bias", dict(logit_bias={-1: 1})),
    ("logit_bias", dict(logit_bias={"x": 1})),
    ("logit_bias", dict(logit_bias={1: "high"})),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=[3])),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=10, max_tokens=5)),
    ("seed", dict(seed="7")),
    ("ignore_eos", dict(ignore_eos="yes")),
]


@pytest.mark.parametrize(
    "field,kwargs", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)]
)
def test_validation_names_the_field(field, kwargs):
    with pytest.raises(MlcrunError, match=field) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)


def test_valid_params_are_normalised_frozen_and_hashable():
    p = SamplingParams(
        top_k=-1,
        logit_bias={"7": 1, 3: -2.5},
        stop="###",
        stop_token_ids=[2, 3],
        min_p=1.0,
        top_p=1.0,
        frequency_penalty=-2,
        presence_penalty=2,
        logprobs=20,
        seed=0,
    )
    assert p.top_k == 0
    assert p.logit_bias == ((3, -2.5), (7, 1.0))
    assert p.stop == ("###",) and p.stop_token_ids == (2, 3)
    assert hash(p) == hash(SamplingParams(**_kwargs(p)))
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_from_dict():
    p = SamplingParams.from_dict(
        {"temperature": 0.5, "stop": ["a", "b"], "logit_bias": {"11": 2}, "n": 2}
    )
    assert p.temperature == 0.5 and p.stop == ("a", "b") and p.logit_bias == ((11, 2.0),)
    with pytest.raises(MlcrunError, match="bogus.*top_q|top_q.*bogus") as info:
        SamplingParams.from_dict({"temperature": 0.5, "top_q": 0.9, "bogus": 1})
    assert "temperature" not in str(info.value).split(";")[0]
    with pytest.raises(MlcrunError, match="temperature"):
        SamplingParams.from_dict({"temperature": -1})
