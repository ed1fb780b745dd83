"""No request can hurt another: a request's own failure (sampling, grammar, text) fails it
alone, a failed forward fails only the requests of that forward, the engine keeps serving, and
a request the KV budget cannot hold still gets an answer. All on the numpy FakeRunner."""

import asyncio

import numpy as np
import pytest
from fake_runner import BrokenDecoder, FakeRunner
from test_engine import alone, make_engine, prompt_of, run_all

from mlcrun.engine.async_engine import AsyncEngine
from mlcrun.engine.config import EngineConfig
from mlcrun.engine.engine import Engine
from mlcrun.engine.types import SamplingParams
from mlcrun.errors import MlcrunError

PARAMS = SamplingParams(max_tokens=10, temperature=0)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)


def solo(prompt, params):
    engine, _ = make_engine(pages=256, seqs=1, chunk=256, prefix_cache=False)
    engine.add_request("x", prompt, params)
    return run_all(engine)[("x", 0)].token_ids


def add_others(engine):
    """Four well-behaved requests (greedy and seeded); their solo outputs."""
    want = {}
    for i in range(4):
        params = PARAMS if i % 2 else SEEDED
        engine.add_request(f"ok{i}", prompt_of(6 + i, 20 + i), params)
        want[f"ok{i}"] = solo(prompt_of(6 + i, 20 + i), params)
    return want


def check_others(outs, want):
    for rid, tokens in want.items():
        assert outs[(rid, 0)].finish_reason in ("stop", "length"), outs[(rid, 0)]
        assert outs[(rid, 0)].token_ids == tokens, rid


class Grammar:
    """Allows everything, then breaks at its `at`-th token: `how` says in which way."""

    def __init__(self, at, how):
        self.at, self.how, self.n = at, how, 0

    def allowed(self, vocab_size):
        if self.n == self.at and self.how == "empty mask":
            return np.zeros(vocab_size, dtype=bool)
        if self.n == self.at and self.how == "raises in allowed":
            raise RuntimeError("grammar state corrupted")
        return np.ones(vocab_size, dtype=bool)

    def accept(self, token):
        self.n += 1
        if self.n == self.at and self.how == "raises in accept":
            raise ValueError("token not in grammar")
        return False


@pytest.mark.parametrize("how", ["empty mask", "raises in allowed", "raises in accept"])
def test_a_broken_grammar_fails_its_request_alone(how):
    engine, runner = make_engine(pages=64, seqs=8)
    want = add_others(engine)
    engine.add_request("bad", prompt_of(7, 3), SEEDED, constraint=lambda: Grammar(2, how))
    outs = run_all(engine)
    bad = outs[("bad", 0)]
    assert bad.finish_reason == "error" and bad.error
    assert len(bad.token_ids) <= 3
    check_others(outs, want)
    assert engine.stats.failed == 1
    engine.reset_prefix_cache()
    assert runner.get_num_available_pages() == runner.num_pages and not runner.seqs


def test_a_detokenizer_failure_fails_its_request_alone():
    runner = FakeRunner()
    bad_prompt = prompt_of(7, 3)
    config = EngineConfig(
        max_num_sequence=8,
        max_total_sequence_length=256,
        prefill_chunk_size=16,
        kv_cache_page_size=4,
    )
    engine = Engine(
        runner,
        config,
        eos_token_ids=[0],
        context_window=256,
        decoder_factory=lambda p: BrokenDecoder(3) if p == bad_prompt else BrokenDecoder(),
    )
    want = add_others(engine)
    engine.add_request("bad", bad_prompt, PARAMS)
    outs = run_all(engine)
    assert outs[("bad", 0)].finish_reason == "error"
    assert "UnicodeDecodeError" in outs[("bad", 0)].error or "utf-8" in outs[("bad", 0)].error
    check_others(outs, want)


def test_sampling_parameters_outside_sane_ranges_are_refused_at_the_door():
    for field, value in [
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e300),
        ("temperature", 1e300),
        ("top_k", 2**70),
    ]:
        with pytest.raises(MlcrunError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(MlcrunError, match="logit_bias"):
        SamplingParams(logit_bias={"²": 1.0})  # isdigit() accepts it, int() does not


def unchecked(params, **values):
    """SamplingParams with values past the door's checks, to test the sampler's own guard."""
    for name, value in values.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize(
    "extreme",
    [
        dict(repetition_penalty=1e-300),
        dict(temperature=1e300),
        dict(temperature=1e-300),
        dict(repetition_penalty=1e300, frequency_penalty=2.0),
    ],
)
def test_extreme_parameters_never_make_nan_and_never_hurt_the_batch(extreme):
    """The cases that once aborted every request in flight ("cannot sample"): the extreme
    request now samples a real token (respecting min_tokens' mask), the others are
    unaffected."""
    engine, _ = make_engine(pages=64, seqs=8)
    want = add_others(engine)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1, min_tokens=8)
    engine.add_request("extreme", prompt_of(5, 9) * 2, unchecked(params, **extreme))
    outs = run_all(engine)
    out = outs[("extreme", 0)]
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert 0 not in out.token_ids  # EOS stayed masked until min_tokens
    check_others(outs, want)


@pytest.mark.parametrize("seed", range(4))
def test_random_forward_failures_fail_only_that_forward(seed):
    rng = np.random.default_rng(seed)
    engine, runner = make_engine(pages=40, seqs=4, chunk=12)
    prompts = {f"r{i}": prompt_of(int(rng.integers(3, 20)), i) for i in range(12)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, PARAMS)
    outs = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        if rng.random() < 0.15:
            runner.fail_next = RuntimeError("injected")
        for out in engine.step():
            if out.finished:
                outs[(out.request_id, 0)] = out
        runner.fail_next = None  # a step without a forward leaves it unused
    assert not engine.has_unfinished()
    failed = {rid for (rid, _), o in outs.items() if o.finish_reason == "error"}
    # Exactly the requests of the broken forwards failed (a sequence is one request's).
    assert failed and len(failed) == sum(len(ids) for ids in runner.failed_calls)
    for rid, prompt in prompts.items():
        out = outs[(rid, 0)]
        if out.finish_reason == "error":
            assert "injected" in out.error
        else:
            assert out.token_ids == alone(prompt, PARAMS), rid
    # The engine keeps serving, and every page came back.
    engine.add_request("after", prompt_of(5, 99), PARAMS)
    assert run_all(engine)[("after", 0)].token_ids == alone(prompt_of(5, 99), PARAMS)
    engine.reset_prefix_cache()
    assert runner.get_num_available_pages() == runner.num_pages and not runner.seqs


def test_the_issue_repro_a_kv_budget_of_8_tokens_still_answers():
    """EngineConfig(max_total_sequence_length=8, kv_cache_page_size=4) with a 6-token prompt
    and max_tokens=50: the window is capped at the budget, the request finishes "length"."""
    runner = FakeRunner()
    config = EngineConfig(
        max_num_sequence=2, max_total_sequence_length=8, kv_cache_page_size=4, prefill_chunk_size=8
    )
    engine = Engine(runner, config, eos_token_ids=[0], context_window=64)
    engine.add_request("a", prompt_of(6, 1), SamplingParams(max_tokens=50, temperature=0))
    out = run_all(engine)[("a", 0)]
    assert out.finish_reason == "length" and len(out.token_ids) == 2

    async def via_async_engine():
        engine = Engine(FakeRunner(), config, eos_token_ids=[0], context_window=64)
        async_engine = AsyncEngine(engine)
        try:
            params = SamplingParams(max_tokens=50, temperature=0)
            outs = [o async for o in async_engine.generate(prompt_of(6, 1), params, "a")]
        finally:
            async_engine.shutdown()
        return outs[-1]

    last = asyncio.run(asyncio.wait_for(via_async_engine(), timeout=60))
    assert last.finish_reason == "length" and last.token_ids == out.token_ids


def test_a_request_alone_and_still_too_large_finishes_with_an_output():
    """Pages held outside this engine (e.g. by a second cache) leave too few for a request
    even alone: it finishes "length" with what it has, and the next request is served."""
    engine, runner = make_engine(pages=6, seqs=2, chunk=16, prefix_cache=False)
    held = [runner._alloc() for _ in range(4)]  # 3 of 7 pages stay for the engine
    engine.add_request("big", prompt_of(9, 1), SamplingParams(max_tokens=20, temperature=0))
    out = run_all(engine, max_steps=100)[("big", 0)]
    assert out.finish_reason == "length"
    assert (
        out.token_ids
        == alone(prompt_of(9, 1), SamplingParams(max_tokens=20, temperature=0))[
            : len(out.token_ids)
        ]
    )
    for page in held:
        runner.refcount[page] = 0
    engine.add_request("next", prompt_of(4, 2), PARAMS)
    assert run_all(engine)[("next", 0)].token_ids == alone(prompt_of(4, 2), PARAMS)
