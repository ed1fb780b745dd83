"""The engine over a real compiled model: batching is invisible, memory pressure is survivable."""

import asyncio

import numpy as np
import pytest

from mlcrun import LLM, EngineConfig, SamplingParams
from mlcrun.engine.async_engine import AsyncEngine

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(artifacts):
    return artifacts("llama")


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, engine_config=EngineConfig(max_num_sequence=8))


def prompts(n, seed=0, shared=()):
    rng = np.random.default_rng(seed)
    return [
        list(shared) + rng.integers(3, 300, size=int(rng.integers(3, 30))).tolist()
        for _ in range(n)
    ]


def alone(llm, prompt, params=GREEDY):
    return llm.generate([prompt], params)[0].token_ids


def test_sixteen_prompts_batched_equal_alone(llm):
    ps = prompts(16)
    batched = llm.generate(ps, GREEDY)
    assert llm.engine.stats.preemptions == 0
    for prompt, out in zip(ps, batched):
        assert out.token_ids == alone(llm, prompt)


def test_seeded_sample_same_alone_and_in_batch(llm):
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    target = [1, 50, 60, 70]
    want = alone(llm, target, seeded)
    others = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)] * 5
    outs = llm.generate(prompts(5, 3) + [target], others + [seeded])
    assert outs[-1].token_ids == want


def test_prefix_cache_on_and_off_agree_and_report_cached_tokens(folder):
    shared = list(range(3, 40))
    ps = prompts(3, 4, shared=shared)
    on = LLM(folder, engine_config=EngineConfig(prefix_cache=True))
    off = LLM(folder, engine_config=EngineConfig(prefix_cache=False))
    outs_on = [on.generate([p], GREEDY)[0] for p in ps]
    outs_off = [off.generate([p], GREEDY)[0] for p in ps]
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    assert outs_on[0].metrics.cached_tokens == 0
    assert all(o.metrics.cached_tokens >= len(shared) for o in outs_on[1:])
    assert all(o.metrics.cached_tokens == 0 for o in outs_off)


def test_tiny_kv_budget_with_32_requests_matches_ample_budget(folder, llm):
    ps = prompts(32, 5)
    ample = llm.generate(ps, GREEDY)
    page = llm.engine_config.kv_cache_page_size
    tight = LLM(
        folder, engine_config=EngineConfig(max_num_sequence=8, max_total_sequence_length=6 * page)
    )
    outs = tight.generate(ps, GREEDY)
    assert tight.engine.stats.preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ample]


def test_stop_string_across_tokens_is_cut(llm):
    base = llm.generate(
        ["Once upon"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )[0]
    text = base.text
    assert len(text) >= 8
    stop = text[3:7]  # several byte-level tokens long
    out = llm.generate(
        ["Once upon"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]


def test_streaming_deltas_concatenate_to_the_decoded_text(llm):
    pieces, final = [], None
    for out in llm.stream(
        ["Hi"], SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True)
    ):
        pieces.append(out.delta_text)
        final = out
    assert final.finished
    assert "".join(pieces) == final.text == llm.tokenizer.decode(final.token_ids)


def test_bad_parameters_and_the_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({"max_tokens": 3, "bogus": 1})
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[5] * 400], GREEDY)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids == alone(llm, [1, 2, 3])


def test_async_engine_shares_batches_and_aborts(llm):
    ps = prompts(6, 7)
    want = [alone(llm, p) for p in ps]
    engine = AsyncEngine(llm.engine)

    async def one(i, prompt):
        tokens = []
        async for out in engine.generate(prompt, GREEDY, f"a{i}"):
            tokens += out.delta_token_ids
        return tokens

    async def aborted():
        seen = 0
        async for out in engine.generate(
            [1, 2, 3], SamplingParams(max_tokens=200, temperature=0), "gone"
        ):
            seen += 1
            if seen == 3:
                await engine.abort("gone")
            if out.finished:
                return out.finish_reason

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)), aborted())

    try:
        *results, reason = asyncio.run(main())
    finally:
        engine.shutdown()
    assert results == want
    assert reason == "abort"
    assert not llm.engine.has_unfinished()
