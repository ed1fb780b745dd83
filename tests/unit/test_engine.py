"""Every scheduling path of the engine, on the numpy FakeRunner."""

import pytest
from fake_runner import FakeRunner

from mlcrun.engine.config import EngineConfig
from mlcrun.engine.engine import Engine
from mlcrun.engine.types import SamplingParams
from mlcrun.errors import MlcrunError

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def make_engine(
    pages=64, seqs=4, chunk=16, page_size=4, prefix_cache=True, retained=8, runner=None, window=256
):
    runner = runner or FakeRunner()
    config = EngineConfig(
        max_num_sequence=seqs,
        max_total_sequence_length=pages * page_size,
        prefill_chunk_size=chunk,
        kv_cache_page_size=page_size,
        prefix_cache=prefix_cache,
        prefix_cache_max_retained=retained,
    )
    return Engine(runner, config, eos_token_ids=[0], context_window=window), runner


def run_all(engine, max_steps=10_000):
    outputs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                outputs[(out.request_id, out.index)] = out
    assert not engine.has_unfinished(), "engine did not finish"
    return outputs


def alone(prompt, params=GREEDY):
    engine, _ = make_engine(pages=256, seqs=1, chunk=256, prefix_cache=False)
    engine.add_request("x", prompt, params)
    return run_all(engine)[("x", 0)].token_ids


def prompt_of(n, seed):
    return [1 + (seed * 7 + i * 13) % 60 for i in range(n)]


def test_chunked_prefill_spans_steps():
    engine, runner = make_engine(chunk=8)
    prompt = prompt_of(25, 1)
    engine.add_request("a", prompt, GREEDY)
    out = run_all(engine)[("a", 0)]
    prefills = [lengths for kind, _, lengths in runner.calls if kind == "prefill"]
    assert prefills == [[8], [8], [8]]  # the 25th prompt token rides in the first decode call
    assert runner.calls[3][0] == "decode"
    assert out.token_ids == alone(prompt)


def test_decodes_run_first_while_a_long_prompt_is_chunked():
    engine, runner = make_engine(chunk=8)
    engine.add_request("short", prompt_of(3, 2), SamplingParams(max_tokens=20, temperature=0))
    engine.step()  # prefill "short", it now decodes every step
    engine.add_request("long", prompt_of(40, 3), GREEDY)
    runner.calls.clear()
    for _ in range(4):
        engine.step()
    kinds = [kind for kind, _, _ in runner.calls]
    assert kinds == ["decode", "prefill"] * 4
    outs = run_all(engine)
    assert outs[("short", 0)].token_ids == alone(
        prompt_of(3, 2), SamplingParams(max_tokens=20, temperature=0)
    )
    assert outs[("long", 0)].token_ids == alone(prompt_of(40, 3))


def test_preemption_recomputes_and_keeps_outputs():
    engine, _ = make_engine(pages=12, seqs=4, chunk=32, prefix_cache=False)
    prompts = {f"r{i}": prompt_of(9, i) for i in range(4)}
    params = SamplingParams(max_tokens=10, temperature=0)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    outs = run_all(engine)
    assert engine.stats.preemptions > 0
    for rid, prompt in prompts.items():
        assert outs[(rid, 0)].token_ids == alone(prompt, params), rid


def test_abort_mid_prefill_and_mid_decode_frees_pages():
    engine, runner = make_engine(chunk=8, prefix_cache=False)
    total = runner.get_num_available_pages()
    engine.add_request("prefilling", prompt_of(30, 4), GREEDY)
    engine.add_request("decoding", prompt_of(3, 5), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert runner.get_num_available_pages() < total
    aborted = engine.abort("prefilling") + engine.abort("decoding")
    assert [o.finish_reason for o in aborted] == ["abort", "abort"]
    assert not engine.has_unfinished()
    assert runner.get_num_available_pages() == total and not runner.seqs
    engine.add_request("after", prompt_of(5, 6), GREEDY)  # still serving
    assert run_all(engine)[("after", 0)].token_ids == alone(prompt_of(5, 6))


def test_prefix_hit_forks_cached_prefix():
    engine, runner = make_engine(chunk=64)
    shared = prompt_of(21, 7)
    engine.add_request("first", shared + [5, 6], GREEDY)
    first = run_all(engine)[("first", 0)]
    engine.add_request("second", shared + [9, 9, 9], GREEDY)
    runner.calls.clear()
    second = run_all(engine)[("second", 0)]
    assert second.metrics.cached_tokens == 21
    assert runner.calls[0] == ("prefill", [runner.calls[0][1][0]], [3])  # only the new suffix
    assert first.token_ids == alone(shared + [5, 6])
    assert second.token_ids == alone(shared + [9, 9, 9])


def test_prefix_cache_off_recomputes():
    engine, runner = make_engine(chunk=64, prefix_cache=False)
    engine.add_request("first", prompt_of(21, 7), GREEDY)
    run_all(engine)
    engine.add_request("second", prompt_of(21, 7), GREEDY)
    out = run_all(engine)[("second", 0)]
    assert out.metrics.cached_tokens == 0 and not runner.seqs


def test_retained_sequences_are_bounded_and_evicted_for_room():
    engine, runner = make_engine(pages=20, chunk=64, retained=2)
    for i in range(5):
        engine.add_request(
            f"r{i}", prompt_of(10, 10 + i), SamplingParams(max_tokens=3, temperature=0)
        )
        run_all(engine)
    assert engine.kv.num_retained == 2 and len(runner.seqs) == 2
    # A request needing most of the cache evicts the retained ones instead of failing.
    engine.add_request("big", prompt_of(60, 99), SamplingParams(max_tokens=10, temperature=0))
    out = run_all(engine)[("big", 0)]
    assert out.token_ids == alone(prompt_of(60, 99), SamplingParams(max_tokens=10, temperature=0))


def test_page_exhaustion_with_64_queued_requests():
    engine, runner = make_engine(pages=24, seqs=8, chunk=32)
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = {f"q{i}": prompt_of(5 + i % 11, i) for i in range(64)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    outs = run_all(engine)
    assert len(outs) == 64
    for rid, prompt in prompts.items():
        assert outs[(rid, 0)].token_ids == alone(prompt, params), rid
        assert outs[(rid, 0)].finish_reason in ("stop", "length")


def test_n_greater_than_one_forks_the_prompt():
    engine, runner = make_engine(chunk=64, prefix_cache=False)
    prompt = prompt_of(13, 8)
    engine.add_request("n", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3))
    outs = run_all(engine)
    assert sorted(i for _, i in outs) == [0, 1, 2]
    prefilled = sum(sum(lengths) for kind, _, lengths in runner.calls if kind == "prefill")
    assert prefilled == 13 + 2  # the prompt once, then one token per forked sibling
    assert len({tuple(o.token_ids) for o in outs.values()}) > 1  # different seeds


def test_bad_requests_fail_clearly_and_the_engine_keeps_serving():
    engine, _ = make_engine(window=32)
    engine.add_request("ok", prompt_of(4, 1), GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("long", prompt_of(40, 1), GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(MlcrunError, match="already in use"):
        engine.add_request("ok", prompt_of(4, 1), GREEDY)
    assert run_all(engine)[("ok", 0)].token_ids == alone(prompt_of(4, 1))


def test_eos_stops_and_ignore_eos_continues():
    engine, _ = make_engine(runner=FakeRunner(eos_after=8))
    engine.add_request("stop", prompt_of(5, 1), SamplingParams(max_tokens=20, temperature=0))
    engine.add_request(
        "go", prompt_of(5, 1), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )
    outs = run_all(engine)
    assert outs[("stop", 0)].finish_reason == "stop" and outs[("stop", 0)].token_ids[-1] == 0
    assert len(outs[("stop", 0)].token_ids) == 4
    assert outs[("go", 0)].finish_reason == "length" and len(outs[("go", 0)].token_ids) == 20


def _too_many(seqs: int, chunk: int) -> str:
    """The refusal of more sequences than a prefill chunk holds, naming the CLI options too."""
    serve = r"\(serve --max-num-seqs, bench -c\)"
    return rf"max_num_sequence {seqs} {serve} is over the prefill chunk of {chunk} tokens"


def test_more_sequences_than_a_prefill_chunk_are_refused():
    """A decode step of every running sequence is one forward, and the KV cache's workspaces
    hold one prefill chunk of tokens: more sequences than that are refused when the config
    is resolved, whichever side the numbers come from."""
    model = dict(context_window=256, max_batch=8, prefill_chunk=64, page_size=16)
    ok = EngineConfig(max_num_sequence=64).resolve(**model, kv_bytes_per_token=1)
    assert (ok.max_num_sequence, ok.prefill_chunk_size) == (64, 64)
    with pytest.raises(MlcrunError, match=_too_many(65, 64)):
        EngineConfig(max_num_sequence=65).resolve(**model, kv_bytes_per_token=1)
    with pytest.raises(MlcrunError, match=_too_many(8, 4)):
        EngineConfig(mode="server", prefill_chunk_size=4).resolve(**model, kv_bytes_per_token=1)


def test_a_models_chunk_limit_caps_the_chunk_before_the_sequences_are_checked():
    """A model that takes fewer tokens per forward (Gemma 3's sliding window: `chunk_limit`)
    gets that chunk, and more sequences than it are refused, not left to fail at decode."""
    model = dict(context_window=256, max_batch=8, prefill_chunk=64, page_size=16)
    capped = EngineConfig(max_num_sequence=15).resolve(
        **model, kv_bytes_per_token=1, chunk_limit=15
    )
    assert (capped.max_num_sequence, capped.prefill_chunk_size) == (15, 15)
    given = EngineConfig(prefill_chunk_size=8).resolve(
        **model, kv_bytes_per_token=1, chunk_limit=15
    )
    assert given.prefill_chunk_size == 8  # a smaller chunk asked for stays
    with pytest.raises(MlcrunError, match=_too_many(16, 15)):
        EngineConfig(max_num_sequence=16).resolve(**model, kv_bytes_per_token=1, chunk_limit=15)


def test_a_kv_budget_smaller_than_the_window_caps_it(caplog):
    engine, runner = make_engine(pages=2, seqs=2, chunk=16, prefix_cache=False)
    assert engine.context_window == 8  # 2 pages of 4 tokens
    assert "capped at 8" in caplog.text
    with pytest.raises(MlcrunError, match="context window"):
        engine.add_request("huge", prompt_of(20, 1), GREEDY)
    engine.add_request("small", prompt_of(3, 2), SamplingParams(max_tokens=3, temperature=0))
    outs = run_all(engine, max_steps=100)
    assert outs[("small", 0)].token_ids == alone(
        prompt_of(3, 2), SamplingParams(max_tokens=3, temperature=0)
    )
    assert runner.get_num_available_pages() == runner.num_pages
