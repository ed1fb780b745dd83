"""A seeded scheduler fuzz on a compiled model: a tiny KV budget, the prefix cache on (retained
parents evicted while their forked children decode), n > 1, seeded sampling and greedy,
preemption, arrivals over time and random aborts. Every request that is not aborted produces
exactly what it produces alone, and every KV page comes back."""

import numpy as np
import pytest

from mlcrun import LLM, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def folder(artifacts):
    return artifacts("llama")


@pytest.fixture(scope="module")
def solo(folder):
    """Runs one request alone, on an ample cache with no prefix cache."""
    llm = LLM(folder, engine_config=EngineConfig(max_num_sequence=4, prefix_cache=False))
    cache = {}

    def run(prompt, params):
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = [o.token_ids for o in llm.generate([prompt], params)]
        return cache[key]

    return run


def workload(rng, count):
    """Requests sharing a few long prefixes (so they fork each other and retained sequences),
    some with n > 1, some seeded-sampled; (arrival step, prompt, params)."""
    prefixes = [rng.integers(3, 300, size=int(rng.integers(20, 40))).tolist() for _ in range(3)]
    out = []
    for _ in range(count):
        prefix = prefixes[int(rng.integers(len(prefixes)))]
        prompt = prefix + rng.integers(3, 300, size=int(rng.integers(1, 12))).tolist()
        sampled = rng.random() < 0.5
        params = SamplingParams(
            max_tokens=int(rng.integers(4, 24)),
            temperature=0.8 if sampled else 0.0,
            top_p=0.9,
            seed=int(rng.integers(1 << 30)) if sampled else None,
            n=int(rng.choice([1, 1, 2, 3])) if sampled else 1,
            ignore_eos=True,
        )
        out.append((int(rng.integers(0, 40)), prompt, params))
    return sorted(out, key=lambda r: r[0])


@pytest.mark.parametrize("seed", range(3))
def test_scheduler_fuzz_matches_solo_runs_and_returns_every_page(folder, solo, seed):
    rng = np.random.default_rng(seed)
    page = 16
    llm = LLM(
        folder,
        engine_config=EngineConfig(
            max_num_sequence=6,
            max_total_sequence_length=10 * page,  # 160 tokens for up to 6 sequences
            prefill_chunk_size=48,
            prefix_cache=True,
            prefix_cache_max_retained=4,
        ),
    )
    engine = llm.engine
    total = engine.kv.total_pages
    parents, parents_removed_under_children = {}, 0
    fork, remove = llm.model.fork_sequence, llm.model.remove_sequence

    def record_fork(parent, child, pos=-1):
        parents[child] = parent
        fork(parent, child, pos)

    def record_remove(seq_id):
        nonlocal parents_removed_under_children
        live = {r.seq_id for r in engine.scheduler.running}
        parents_removed_under_children += any(parents.get(c) == seq_id for c in live)
        remove(seq_id)

    llm.model.fork_sequence, llm.model.remove_sequence = record_fork, record_remove
    arrivals = workload(rng, 24)
    requests, outputs, aborted = {}, {}, set()
    step = 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            _, prompt, params = arrivals.pop(0)
            rid = f"r{len(requests)}"
            requests[rid] = (prompt, params)
            engine.add_request(rid, prompt, params)
        if engine.requests and rng.random() < 0.04:
            victim = str(rng.choice(sorted(engine.requests)))
            aborted.add(victim)
            for out in engine.abort(victim):
                outputs[(out.request_id, out.index)] = out
        for out in engine.step():
            if out.finished:
                outputs[(out.request_id, out.index)] = out
        step += 1
        assert step < 5000, "the engine did not finish"

    assert engine.stats.preemptions > 0, "the budget was meant to force preemptions"
    assert parents_removed_under_children > 0, "meant to drop parents of running forks"
    assert any(o.metrics and o.metrics.cached_tokens for o in outputs.values())
    compared = 0
    for rid, (prompt, params) in requests.items():
        choices = [outputs[(rid, i)] for i in range(params.n)]
        if rid in aborted:
            assert all(o.finish_reason in ("abort", "length") for o in choices)
            continue
        assert [o.finish_reason for o in choices] == ["length"] * params.n, rid
        assert [o.token_ids for o in choices] == solo(prompt, params), rid
        compared += 1
    assert compared >= len(requests) // 2
    assert engine.reset_prefix_cache() >= 0
    assert engine.kv.free_pages() == total, "KV pages leaked"
    assert llm.model.get_num_available_pages() == total
