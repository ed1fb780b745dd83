"""What the server needs from the engine: the token-constraint hook (grammars), batching
stats, stats after abort, prefix-cache reset, and prompts under way never starved by the cache."""

import numpy as np
from test_engine import make_engine, prompt_of, run_all

from mlcrun.engine.types import SamplingParams


class Script:
    """Allows exactly `tokens`, in order, then reports completion (a toy grammar)."""

    def __init__(self, tokens):
        self.tokens, self.pos, self.accepted = list(tokens), 0, []

    def allowed(self, vocab_size):
        mask = np.zeros(vocab_size, dtype=bool)
        mask[self.tokens[self.pos]] = True
        return mask

    def accept(self, token):
        self.accepted.append(token)
        self.pos += 1
        return self.pos == len(self.tokens)


def test_constrained_requests_follow_their_mask_others_do_not():
    engine, _ = make_engine()
    made = []

    def factory():
        made.append(Script([5, 6, 7]))
        return made[-1]

    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2)
    engine.add_request("c", prompt_of(9, 1), sampled, constraint=factory)
    engine.add_request("free", prompt_of(9, 2), SamplingParams(max_tokens=6, temperature=0))
    out = run_all(engine)
    for i in range(2):  # each choice has its own constraint state
        assert out[("c", i)].token_ids == [5, 6, 7] and out[("c", i)].finish_reason == "stop"
    assert [s.accepted for s in made] == [[5, 6, 7], [5, 6, 7]]
    assert len(out[("free", 0)].token_ids) == 6  # unconstrained rows are untouched


def test_min_tokens_yields_to_a_grammar_that_allows_only_eos():
    engine, _ = make_engine()  # eos is token 0
    params = SamplingParams(max_tokens=8, temperature=0, min_tokens=4)
    engine.add_request("a", prompt_of(5, 3), params, constraint=lambda: Script([9, 0]))
    out = run_all(engine)[("a", 0)]
    assert out.token_ids == [9, 0] and out.finish_reason == "stop"


def test_step_sizes_show_batching_and_reset_frees_cached_pages():
    engine, runner = make_engine()
    for i in range(3):
        engine.add_request(f"r{i}", prompt_of(6, i), SamplingParams(max_tokens=5, temperature=0))
    run_all(engine)
    assert max(engine.stats.step_sizes) == 3
    assert sum(engine.stats.step_sizes.values()) > 1
    assert engine.stats.cached_sequences > 0
    assert engine.reset_prefix_cache() == 3
    assert engine.stats.cached_sequences == 0
    assert engine.stats.free_pages == engine.stats.total_pages == runner.get_num_available_pages()


def test_abort_updates_the_stats():
    engine, _ = make_engine()
    engine.add_request("a", prompt_of(6, 1), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.stats.running == 1
    engine.abort("a")
    assert engine.stats.running == 0 and engine.stats.free_pages == engine.stats.total_pages


def test_a_prompt_under_way_takes_pages_back_from_the_prefix_cache():
    # Found by the server fuzz: finished sequences kept for reuse held every page while a
    # chunked prompt waited for one, forever.
    engine, runner = make_engine(pages=16, seqs=4, chunk=8, page_size=4, retained=8)
    for i in range(3):
        engine.add_request(
            f"r{i}", prompt_of(12, i + 10), SamplingParams(max_tokens=4, temperature=0)
        )
        run_all(engine)
    assert engine.kv.num_retained == 3
    engine.add_request("long", prompt_of(40, 99), SamplingParams(max_tokens=4, temperature=0))
    out = run_all(engine, max_steps=200)[("long", 0)]
    assert len(out.token_ids) == 4 and engine.kv.num_retained < 4
