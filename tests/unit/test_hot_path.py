"""The decode hot path's shortcuts give exactly what the general paths give: the greedy argmax
without the sampler's machinery, the block draw, stats snapshots, the engine's unstacked logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fake_runner import FakeRunner

from mlcrun.engine.config import EngineConfig
from mlcrun.engine.engine import Engine, EngineStats
from mlcrun.engine.sampler import SamplerState, draw, probabilities, sample_batch
from mlcrun.engine.types import SamplingParams
from mlcrun.errors import MlcrunError

GREEDY = SamplingParams(temperature=0)


def _states(params, prompt=(1, 2, 3)):
    return [SamplerState(p, prompt) for p in params]


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_greedy_shortcut_equals_the_general_path(rows):
    rng = np.random.default_rng(rows)
    logits = rng.standard_normal((rows, 1000)).astype(np.float32)
    logits[0, 17] = logits[0, 400] = logits[0].max() + 1  # a tie: the first index wins
    params = [GREEDY] * rows
    fast = sample_batch(logits, params, _states(params))
    # An all-True mask changes nothing but takes the general path.
    general = sample_batch(logits, params, _states(params), [np.ones(1000, bool)] * rows)
    assert [r.token for r in fast] == [r.token for r in general]
    assert [r.token for r in fast] == logits.argmax(axis=1).tolist()
    assert fast[0].token == 17
    for r in fast:
        assert math.isnan(r.logprob) and r.top_logprobs is None and r.error is None
        assert r.accepted is None and type(r.token) is int
    probs = probabilities(logits, params, _states(params))
    assert probs.argmax(axis=1).tolist() == [r.token for r in fast]


def test_greedy_shortcut_keeps_the_checks():
    logits = np.zeros((2, 8), np.float32)
    with pytest.raises(MlcrunError, match="rows of logits"):
        sample_batch(logits, [GREEDY], _states([GREEDY]))
    with pytest.raises(MlcrunError, match=r"\[batch, vocab\]"):
        sample_batch(np.zeros(8, np.float32), [GREEDY], _states([GREEDY]))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0, repetition_penalty=2.0),
        SamplingParams(temperature=0, logit_bias={5: 100.0}),
        SamplingParams(temperature=0, frequency_penalty=1.5),
    ],
)
def test_greedy_rows_that_need_processing_still_get_it(params):
    logits = np.linspace(0, 1, 8, dtype=np.float32)[None]
    out = sample_batch(logits, [params], _states([params], prompt=(7,)))[0]
    if params.logprobs is not None:
        assert out.token == 7 and set(out.top_logprobs) == {7, 6}
    elif params.repetition_penalty != 1:
        assert out.token == 6  # 7 is in the prompt: penalised
    elif params.logit_bias:
        assert out.token == 5
    else:  # nothing generated yet: no frequency penalty
        assert out.token == 7


def test_mixed_batches_are_unchanged_by_the_shortcut():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 300)).astype(np.float32)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3), GREEDY]
    a = sample_batch(logits, params, _states(params))
    b = sample_batch(logits, params, _states(params))
    assert [r.token for r in a] == [r.token for r in b]
    assert a[0].token == int(logits[0].argmax()) and a[2].token == int(logits[2].argmax())


def _draw_reference(weights, rng):
    """draw() as first written (np.arange starts, np.cumsum / np.searchsorted calls)."""
    block_size = 1024
    starts = np.arange(0, weights.size, block_size)
    block_mass = np.add.reduceat(weights, starts, dtype=np.float64)
    cdf = np.cumsum(block_mass)
    if not cdf[-1] > 0:
        raise MlcrunError("cannot sample: every token has probability zero")
    target = rng.random() * cdf[-1]
    b = min(int(np.searchsorted(cdf, target, side="right")), cdf.size - 1)
    while block_mass[b] == 0:
        b -= 1
    target -= cdf[b - 1] if b else 0.0
    block = weights[starts[b] : starts[b] + block_size]
    j = int(np.searchsorted(np.cumsum(block, dtype=np.float64), target, side="right"))
    if j >= block.size:
        j = int(np.flatnonzero(block)[-1])
    return int(starts[b]) + j


@pytest.mark.parametrize("vocab", [7, 1024, 1500, 49152])
def test_draw_takes_the_same_tokens_for_the_same_seed(vocab):
    rng = np.random.default_rng(vocab)
    weights = rng.random(vocab).astype(np.float32) ** 8
    weights[rng.random(vocab) < 0.3] = 0  # empty stretches, whole blocks too
    if vocab > 1024:
        weights[1024:2048] = 0
    for seed in range(200):
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        assert draw(weights, a) == _draw_reference(weights, b)
        assert a.random() == b.random()  # the same draws consumed


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1e-30, 100.0])
def test_temperature_weights_are_those_of_the_original_formula(temperature):
    """_filtered_weights for temperature-only rows, bit for bit as first written (an array of
    clamped inverse temperatures applied when any differs from 1), so seeds keep their tokens."""
    from mlcrun.engine.sampler import _filtered_weights

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 3000)) * 4).astype(np.float32)
    x[1, :100] = -np.inf  # masked tokens
    params = [SamplingParams(temperature=temperature), SamplingParams(temperature=1.0)]
    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    with np.errstate(over="ignore"):
        want = x - x.max(axis=1, keepdims=True)
        inv = np.array([min(max(1.0 / p.temperature, tiny), big) for p in params], np.float32)
        if np.any(inv != 1):
            want *= inv[:, None]
    np.exp(want, out=want)
    np.testing.assert_array_equal(_filtered_weights(x, params), want)


def test_stats_snapshot_is_an_independent_copy():
    stats = EngineStats(running=2, waiting=1, free_pages=7, step_sizes={1: 3})
    snap = stats.snapshot()
    assert snap == stats and snap is not stats
    stats.running, stats.step_sizes[1] = 5, 9
    assert snap.running == 2 and snap.step_sizes == {1: 3}
    assert isinstance(snap, EngineStats)


def _engine(runner, **kw):
    config = EngineConfig(max_num_sequence=4, max_total_sequence_length=512, **kw).resolve(
        context_window=256, max_batch=4, prefill_chunk=64, page_size=16, kv_bytes_per_token=1
    )
    return Engine(runner, config, eos_token_ids=[0], context_window=256)


def _run(engine, prompts, params):
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_batched_decode_samples_the_unstacked_logits_as_stacked_ones(monkeypatch):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, min_tokens=3, ignore_eos=True),
    ]
    fast = _run(_engine(FakeRunner(vocab_size=64)), prompts, params)
    original = Engine._sample

    def stacked(self, ready, drafts=None, now=None, logits=None):
        return original(self, ready, drafts, now)  # always stacks the rows itself

    monkeypatch.setattr(Engine, "_sample", stacked)
    assert _run(_engine(FakeRunner(vocab_size=64)), prompts, params) == fast
    alone = [
        _run(_engine(FakeRunner(vocab_size=64)), [pr], [p])[0] for pr, p in zip(prompts, params)
    ]
    assert alone == fast


def test_requests_that_do_not_stream_get_only_their_final_output():
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    finals = {}
    for stream in (True, False):
        engine = _engine(FakeRunner(vocab_size=64))
        engine.add_request("a", [1, 2, 3], params, stream=stream)
        engine.add_request("b", [4, 5], params)  # streams
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        a = [o for o in outs if o.request_id == "a"]
        assert [o.finished for o in a] == ([False] * 8 + [True] if stream else [True])
        assert [o.finished for o in outs if o.request_id == "b"] == [False] * 8 + [True]
        assert len(a[-1].token_ids) == 9
        finals[stream] = a[-1].token_ids
    assert finals[True] == finals[False]
