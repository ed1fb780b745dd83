"""Speculative decoding on the numpy FakeRunner: the acceptance rule is lossless, greedy output
is token-for-token plain decoding's in every mode, sampled output has plain sampling's
distribution, both KV caches hold exactly the accepted tokens, drafts never cost a
preemption, and failures stay with their requests."""

import dataclasses
import hashlib
import itertools
import types

import numpy as np
import pytest
from checkpoints import write_tokenizer
from fake_runner import BrokenDecoder, FakeRunner
from stats_check import assert_draws_follow

from mlcrun.engine.config import EngineConfig
from mlcrun.engine.engine import Engine
from mlcrun.engine.request import Request
from mlcrun.engine.spec import cost
from mlcrun.engine.spec.accept import accept_sampled
from mlcrun.engine.spec.adaptive import CostModel, best_draft_length, expected_tokens
from mlcrun.engine.spec.ngram import CANDIDATES, CONTEXT_MAX, NgramDrafter
from mlcrun.engine.types import SamplingParams
from mlcrun.errors import MlcrunError
from mlcrun.tokenizer import Tokenizer

# -- the acceptance rule on synthetic distributions --------------------------------------------

P = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0, 0.0])
Q = np.array([0.1, 0.1, 0.3, 0.3, 0.05, 0.05, 0.1, 0.0])


def without_replacement(q, k, rng):
    left, out = q.copy(), []
    for _ in range(k):
        token = int(rng.choice(q.size, p=left / left.sum()))
        out.append(token)
        left[token] = 0
    return out


@pytest.mark.parametrize(
    "case",
    ["one drawn from q", "three drawn from q", "p equals q", "deterministic", "deterministic x3"],
)
def test_the_acceptance_rule_keeps_the_target_distribution(case):
    rng = np.random.default_rng(1)
    tokens, accepted = [], 0
    for _ in range(30_000):
        if case == "one drawn from q":
            cands, q = without_replacement(Q, 1, rng), Q
        elif case == "three drawn from q":
            cands, q = without_replacement(Q, 3, rng), Q
        elif case == "p equals q":
            cands, q = without_replacement(P, 2, rng), P
        elif case == "deterministic":
            cands, q = [3], None
        else:
            cands, q = [6, 2, 0], None  # a candidate the target never picks comes first
        token, j = accept_sampled(P, cands, q, rng)
        tokens.append(token)
        accepted += j is not None
    assert_draws_follow(np.array(tokens), P)
    if case == "one drawn from q":  # the known acceptance rate: sum of min(p, q)
        want = np.minimum(P, Q).sum()
        assert abs(accepted / 30_000 - want) < 4 * np.sqrt(want * (1 - want) / 30_000)
    if case == "p equals q":
        assert accepted == 30_000


# -- engine harness ------------------------------------------------------------------------------


class NoisyRunner(FakeRunner):
    """A poor draft: the target's logits plus noise, so its argmax often differs."""

    def __init__(self, noise=2.0, **kw):
        super().__init__(**kw)
        self.noise = noise

    def logits(self, history):
        base = super().logits(history)
        digest = hashlib.sha256(np.asarray(history, np.int64).tobytes() + b"draft").digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        return base + rng.normal(0, self.noise, base.size).astype(np.float32)


def make(mode="none", k=3, width=1, draft=None, vocab=64, seqs=16, pages=400, script=None,
         window=256, eos_after=None, costs=None, decoder=None, prefix_cache=True):  # fmt: skip
    runner = FakeRunner(vocab_size=vocab, script=script, script_from=0, eos_after=eos_after)
    config = EngineConfig(
        max_num_sequence=seqs,
        max_total_sequence_length=pages * 4,
        prefill_chunk_size=64,
        kv_cache_page_size=4,
        prefix_cache=prefix_cache,
        speculative_mode=mode,
        spec_draft_length=k,
        spec_tree_width=width,
        draft_model="d" if mode == "draft" else None,
    )
    if mode in ("draft", "self") and draft is None:
        draft = FakeRunner(vocab_size=vocab, script=script, script_from=0, eos_after=eos_after)
    engine = Engine(
        runner,
        config,
        eos_token_ids=[0],
        context_window=window,
        draft_runner=draft,
        cost_model=costs or FLAT,
        decoder_factory=decoder,
    )
    return engine, runner, draft


FLAT = CostModel(verify={1: {1: 1.0, 9: 1.2}, 64: {1: 2.0, 9: 3.0}}, draft={1: 0.05, 64: 0.1})


def run_all(engine, runner=None, draft=None, aborts=()):
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[(out.request_id, out.index)] = out
        check_caches(engine, runner, draft)
    return outs


def check_caches(engine, runner, draft):
    """Both caches hold exactly each running request's computed tokens."""
    if runner is None:
        return
    for req in engine.scheduler.running:
        assert runner.seqs[req.seq_id] == req.tokens[: req.num_computed]
        if draft is not None:
            assert draft.seqs[req.seq_id] == req.tokens[: req.num_draft_computed]


def prompts(n, seed=0, vocab=64):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        motif = rng.integers(1, vocab, size=int(rng.integers(2, 5))).tolist()
        out.append(motif * int(rng.integers(2, 5)) + rng.integers(1, vocab, size=3).tolist())
    return out


def generate(engine, runner, draft, ps, params):
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    return run_all(engine, runner, draft)


COPYING = [5, 9, 13, 17, 21, 25, 29, 33] * 20  # a model that repeats itself: drafts hit


@pytest.mark.parametrize(
    "mode,k,width,noise",
    [
        ("ngram", 3, 1, None),
        ("ngram", 0, 3, None),
        ("draft", 3, 1, 0.0),
        ("draft", 0, 3, 2.0),
        ("self", 4, 2, 1.0),
    ],
)
@pytest.mark.parametrize("script", [None, COPYING], ids=["random", "copying"])
def test_greedy_output_is_plain_decodings_in_every_mode(mode, k, width, noise, script):
    ps = prompts(16, seed=3)
    params = [
        SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=bool(i % 3))
        for i, m in enumerate(np.random.default_rng(0).integers(1, 40, size=16))
    ]
    plain = generate(*make(script=script, eos_after=40, window=60), ps, params)
    draft = NoisyRunner(noise, script=script, script_from=0, eos_after=40) if noise else None
    engine, runner, draft = make(mode, k, width, draft, script=script, eos_after=40, window=60)
    spec = generate(engine, runner, draft, ps, params)
    for key, out in plain.items():
        assert spec[key].token_ids == out.token_ids, key
        assert spec[key].finish_reason == out.finish_reason, key
    if script is COPYING:
        assert engine.stats.spec_accepted > 0
    engine.reset_prefix_cache()
    assert runner.get_num_available_pages() == runner.num_pages and not runner.seqs
    if draft is not None:
        assert not draft.seqs and draft.get_num_available_pages() == draft.num_pages


@pytest.mark.parametrize("script", [None, COPYING], ids=["random", "copying"])
def test_greedy_requests_the_sampler_changes_speculate_as_plain(script):
    """Greedy requests whose token is not the raw argmax (min_tokens masking EOS, penalties,
    logit_bias) or that ask for logprobs take the sampler at every drafted position; plain
    argmax requests beside them in the same verify take their whole tree from one argmax (one
    of them only once its min_tokens are reached). Both give plain decoding's tokens,
    logprobs and finish reasons."""
    extra = [
        {"min_tokens": 35},
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 1.0},
        {"logit_bias": {5: 30.0}},
        {"logprobs": 2},
        {},
        {"stop_token_ids": (9,)},
        {"min_tokens": 2},
    ]
    ps = prompts(len(extra), seed=7)
    params = [SamplingParams(max_tokens=45, temperature=0, **x) for x in extra]
    plain = generate(*make(script=script, eos_after=40, window=80), ps, params)
    engine, runner, _ = make("ngram", 3, script=script, eos_after=40, window=80)
    spec = generate(engine, runner, None, ps, params)
    assert spec.keys() == plain.keys()
    for key, out in plain.items():
        assert spec[key].token_ids == out.token_ids, key
        assert spec[key].finish_reason == out.finish_reason, key
        assert spec[key].logprobs == out.logprobs, key
    if script is COPYING:
        assert engine.stats.spec_accepted > 0


@pytest.mark.parametrize("at", [2, 6, 9])
def test_a_request_failing_inside_a_verified_tree_fails_alone(at):
    """A greedy request whose text fails on one of its accepted drafts fails alone: the
    requests verified beside it keep plain decoding's tokens, and the caches keep nothing of
    it once it is gone."""
    ps = prompts(4, seed=11)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = generate(*make(script=COPYING), ps, params)
    decoder = lambda p: BrokenDecoder(at) if p == ps[1] else BrokenDecoder()  # noqa: E731
    engine, runner, _ = make("ngram", 4, script=COPYING, decoder=decoder)
    spec = generate(engine, runner, None, ps, params)
    assert spec[("r1", 0)].finish_reason == "error"
    assert "utf-8" in spec[("r1", 0)].error
    for i in (0, 2, 3):
        assert spec[(f"r{i}", 0)].token_ids == plain[(f"r{i}", 0)].token_ids
    assert engine.stats.spec_accepted > 0
    engine.reset_prefix_cache()
    assert runner.get_num_available_pages() == runner.num_pages and not runner.seqs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return Tokenizer.from_dir(folder)


@pytest.mark.parametrize("stop", ["lo w", "world", "d!"])
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_stop_strings_end_speculated_text_exactly_as_plain(tokenizer, mode, stop):
    script = tokenizer.encode("hello world! " * 6, add_special_tokens=False)
    decoder = lambda p: tokenizer.stream(prefix_ids=p[-4:])  # noqa: E731
    params = SamplingParams(max_tokens=60, temperature=0, stop=(stop,))
    prompt = script[:20]
    outs = []
    for m in ("none", mode):
        engine, runner, draft = make(m, 6, 1, vocab=320, script=[*script, *script], decoder=decoder)
        engine.add_request("r", prompt, params)
        outs.append(run_all(engine, runner, draft)[("r", 0)])
    assert outs[1].text == outs[0].text and outs[1].finish_reason == outs[0].finish_reason == "stop"
    assert outs[1].token_ids == outs[0].token_ids


# -- sampling is lossless inside the engine ------------------------------------------------------


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("mode,width", [("draft", 1), ("draft", 2), ("ngram", 1)])
def test_sampled_tokens_have_plain_samplings_joint_distribution(mode, width):
    """Three tokens after a fixed prompt, over many seeds: their joint distribution is the
    product of the target's softmaxes (computed exactly from the FakeRunner)."""
    vocab, prompt = 4, [1, 2, 3, 1, 2, 3, 1, 2]
    target = FakeRunner(vocab_size=vocab, eos=99 % vocab)
    exact = {}
    for seq in itertools.product(range(vocab), repeat=3):
        p, history = 1.0, list(prompt)
        for t in seq:
            logits = target.logits(history)
            p *= softmax(logits)[t]
            history.append(t)
        exact[seq] = p
    cells = sorted(exact)
    expected = np.array([exact[c] for c in cells])
    index = {c: i for i, c in enumerate(cells)}
    draws = []
    for batch in range(10):
        draft = NoisyRunner(1.5, vocab_size=vocab, eos=99 % vocab) if mode == "draft" else None
        engine, runner, draft = make(mode, 2, width, draft, vocab=vocab, seqs=64, pages=2000)
        engine.runner.eos = draft.eos if draft else 99 % vocab
        for i in range(200):
            params = SamplingParams(max_tokens=3, temperature=1.0, seed=batch * 1000 + i,
                                    ignore_eos=True)  # fmt: skip
            engine.add_request(f"r{i}", prompt, params)
        outs = run_all(engine, runner, draft)
        draws += [index[tuple(o.token_ids)] for o in outs.values()]
        assert engine.stats.spec_steps > 0
    assert_draws_follow(np.array(draws), expected)


# -- scheduling ----------------------------------------------------------------------------------


def test_drafts_never_cost_a_preemption():
    ps = prompts(8, seed=5)
    params = SamplingParams(max_tokens=30, temperature=0)
    runs = []
    for mode in ("none", "ngram"):
        engine, runner, _ = make(mode, 8, 1, script=COPYING, pages=80, seqs=8)
        runs.append(generate(engine, runner, None, ps, params))
        assert engine.stats.preemptions == 0  # the cache only just holds them all
    assert {k: o.token_ids for k, o in runs[1].items()} == {
        k: o.token_ids for k, o in runs[0].items()
    }


@pytest.mark.parametrize("free,k", [(2, 8), (1, 7), (0, 3), (-1, 0)])
def test_draft_lengths_shrink_to_the_free_pages(free, k):
    engine, runner, _ = make("ngram", 8, 1, script=COPYING, pages=64)
    engine.add_request("r", COPYING[:20], SamplingParams(max_tokens=50, temperature=0))
    engine.step()  # prefilled: 20 tokens in 5 pages, the first sampled token is pending
    (req,) = engine.scheduler.running
    while runner.get_num_available_pages() > max(free + 1, 0):
        runner._alloc()  # pages taken elsewhere
    # The pending token needs a 6th page; 1 + K tokens from position 20 fit in it and `free`
    # more (4 tokens a page).
    granted, reserved = engine.scheduler._reserve_drafts([req], reserved=1)
    assert granted.get(req, 0) == k
    assert reserved - 1 <= max(free, 0)  # never more pages than are free


def test_drafts_are_clamped_to_max_tokens_and_the_context_window():
    for params, window in [
        (SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), 256),
        (SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), 40),
    ]:
        outs = []
        for mode in ("none", "ngram"):
            engine, runner, _ = make(mode, 8, 3, script=COPYING, window=window)
            engine.add_request("r", COPYING[:24], params)
            outs.append(run_all(engine, runner)[("r", 0)])
        assert outs[1].token_ids == outs[0].token_ids
        assert outs[1].finish_reason == "length"
        assert len(outs[1].token_ids) == min(params.max_tokens, window - 24)


def test_forks_from_the_prefix_cache_keep_both_caches_exact():
    shared = COPYING[:30]
    params = SamplingParams(max_tokens=20, temperature=0)
    engine, runner, draft = make("draft", 4, 1, script=COPYING, seqs=4)
    first = generate(engine, runner, draft, [shared + [3, 4]], params)
    engine.add_request("second", shared + [7, 8, 9], params)
    second = run_all(engine, runner, draft)[("second", 0)]
    assert second.metrics.cached_tokens >= 28
    plain_engine, plain_runner, _ = make(script=COPYING, prefix_cache=False)
    want = generate(plain_engine, plain_runner, None, [shared + [7, 8, 9]], params)
    assert second.token_ids == want[("r0", 0)].token_ids
    assert first[("r0", 0)].token_ids


# -- adaptive K ---------------------------------------------------------------------------------


def test_best_draft_length_backs_off_where_verifying_costs_as_much_as_it_saves():
    cheap = CostModel(verify={1: {1: 1.0, 2: 1.05, 9: 1.4}, 16: {1: 2.0, 2: 2.1, 9: 3.0}})
    compute_bound = CostModel(verify={1: {1: 1.0, 9: 1.4}, 16: {1: 2.0, 2: 4.0, 9: 18.0}})
    assert best_draft_length([0.8], cheap, 8) >= 4
    assert best_draft_length([0.8] * 16, compute_bound, 8) == 0
    assert best_draft_length([0.05], cheap, 8) == 0  # nothing gets accepted
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_best_draft_length_drafts_less_deep_in_the_cache():
    """Where each verified token's attention over a deep cache costs a tenth of a decode step,
    the same acceptance drafts fewer tokens 512 tokens deep than at the table's depth, and
    none 2048 deep; a table without a deep point drafts alike at every depth."""
    shallow = {1: 1.0, 2: 1.05, 5: 1.2, 9: 1.4}
    deep = {n: t + 0.1 * n * (512 - 64) / 64 for n, t in shallow.items()}
    table = CostModel(verify={1: shallow}, depth=64, deep=deep, deep_depth=512)
    flat = CostModel(verify={1: shallow})
    near, far, farther = (best_draft_length([0.7], table, 8, d) for d in (64, 512, 2048))
    assert near >= 3 and 0 < far < near and farther == 0, (near, far, farther)
    assert best_draft_length([0.7], flat, 8, 2048) == best_draft_length([0.7], flat, 8) == near


def test_prompt_lookup_keeps_an_acceptance_per_match_length():
    """The adaptive K of a prompt-lookup request follows the acceptance of the match it has
    now: after one-token matches that kept failing it drafts less than after a four-token
    match whose drafts held; a step whose last token matches nothing earlier drafts nothing
    and leaves every acceptance as it was."""
    engine, _, _ = make("ngram", 0)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]  # ends with a 4-gram seen before
    req = Request("r", tokens, SamplingParams())
    assert NgramDrafter(4).kind(req) == 4
    for _ in range(30):
        req.acceptances.setdefault(1, type(req.acceptance)()).update(4, 0)
        req.acceptances.setdefault(4, type(req.acceptance)()).update(4, 4)
    long = engine._draft_lengths([req])[req]
    assert req.draft_kind == 4 and long >= 4
    req.append(5), req.append(9)  # "... 5 9": only the 1-gram "9" occurred before
    assert engine._draft_lengths([req]).get(req, 0) < long
    assert req.draft_kind == 1
    req.append(63)  # never seen: nothing to draft, nothing recorded
    before = {n: (a.accepted, a.trials, a.idle_steps) for n, a in req.acceptances.items()}
    assert engine._draft_lengths([req]) == {}
    assert {n: (a.accepted, a.trials, a.idle_steps) for n, a in req.acceptances.items()} == before


def test_adaptive_speculation_backs_off_on_unpredictable_text_and_stays_exact():
    ps = prompts(4, seed=9)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = generate(*make(), ps, params)
    # a hopeless draft whose steps cost a third of the target's
    costs = CostModel(verify={1: {1: 1.0, 9: 1.8}, 64: {1: 2.0, 9: 6.0}}, draft={1: 0.3, 64: 0.6})
    engine, runner, draft = make("draft", 0, 1, NoisyRunner(6.0), costs=costs)
    spec = generate(engine, runner, draft, ps, params)
    assert {k: o.token_ids for k, o in spec.items()} == {k: o.token_ids for k, o in plain.items()}
    drafting_steps = engine.stats.spec_steps / 4
    assert drafting_steps < 20  # it stopped drafting for most of the 40 tokens


class CountingRunner(FakeRunner):
    """A draft that counts the tokens it is fed."""

    fed = 0

    def _begin(self, kind, seq_ids, lengths):
        self.fed += sum(lengths)
        return super()._begin(kind, seq_ids, lengths)


# Drafting pays at batch 1 and never from batch 4 on (a verify costs what it saves).
BATCH_BOUND = CostModel(
    verify={1: {1: 1.0, 2: 1.02, 9: 1.2}, 4: {1: 1.0, 2: 2.0, 9: 9.0}, 64: {1: 16.0, 9: 144.0}},
    draft={1: 0.01, 4: 0.04, 64: 0.64},
)


# Drafting pays 16 tokens deep at any batch and never from 17 on, even drafts always right: a
# verify's attention, and a draft step's, grow steeply with the depth.
DEPTH_BOUND = CostModel(
    verify={1: {1: 1.0, 2: 1.02, 9: 1.2}},
    draft={1: 0.01},
    depth=16,
    deep={1: 2.0, 2: 4.2, 9: 20.0},
    deep_depth=48,
    deep_draft=0.5,
)


def _assert_the_draft_model_does_no_work(ps, params, costs=BATCH_BOUND):
    """Draft mode under `costs` gives plain decoding's answers without feeding the draft
    model a token or running a speculative step."""
    plain = generate(*make(script=COPYING), ps, params)
    draft = CountingRunner(vocab_size=64, script=COPYING, script_from=0)
    engine, runner, draft = make("draft", 0, 1, draft, script=COPYING, costs=costs)
    spec = generate(engine, runner, draft, ps, params)
    assert {k: o.token_ids for k, o in spec.items()} == {k: o.token_ids for k, o in plain.items()}
    assert draft.fed == 0 and engine.stats.spec_steps == 0


def test_where_drafting_cannot_pay_the_draft_model_does_no_work():
    # no prompt prefilled into it, no probes: 6 requests stay at batch 6
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    _assert_the_draft_model_does_no_work(prompts(6, seed=11), params)


# 4 requests: drafts that are always right pay (1 each: 8 tokens for 5 + 2), at the prior no
# draft length does, and a probe of 2 drafts each with its 2 draft steps (12 tokens for 8 + 4)
# does not either: at the prior its verify alone would not (7.8 tokens for 8).
PROBE_DEAR = CostModel(verify={4: {1: 4.0, 2: 5.0, 3: 8.0, 9: 20.0}}, draft={4: 2.0})


def test_no_probe_is_drafted_where_its_verify_would_not_pay():
    """A probe is drafted only where its verify, drafts all kept, pays with its drafting:
    what the step's verify is then asked. Drafted on the premise of drafts that are always
    right alone and then priced at the prior, probes were made, dropped unverified, and made
    again every step (the draft model took catch-ups and draft steps for nothing)."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    _assert_the_draft_model_does_no_work(prompts(4, seed=5), params, PROBE_DEAR)


def test_prompt_lookup_looks_nothing_up_where_no_draft_could_pay():
    """At batch 4 and more (BATCH_BOUND) even drafts that are always right would not pay:
    those steps decode plainly without a lookup; the last requests, alone, draft again."""
    ps = [COPYING[i : i + 12] for i in range(6)]
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (60, 8, 9, 10, 11, 12)
    ]
    plain = generate(*make(script=COPYING), ps, params)
    engine, runner, _ = make("ngram", 0, 1, script=COPYING, costs=BATCH_BOUND)
    running_at_lookup = []
    kind = engine.drafter.kind
    engine.drafter.kind = lambda req: (
        running_at_lookup.append(len(engine.scheduler.running)) or kind(req)
    )
    spec = generate(engine, runner, None, ps, params)
    assert {k: o.token_ids for k, o in spec.items()} == {k: o.token_ids for k, o in plain.items()}
    assert running_at_lookup and max(running_at_lookup) < 4
    assert engine.stats.spec_steps > 0 and engine.stats.spec_accepted > 20


def test_a_lagging_draft_catches_up_when_drafting_starts_to_pay():
    """Four requests decode plainly (batch 4); once the short ones finish, the long one
    drafts: its draft catches up on everything it lacks. A later request forks the retained
    sequence: the target's whole prefix, the draft's shorter one, both exact."""
    ps = [COPYING[i : i + 12] for i in (0, 3, 5, 7)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (60, 5, 6, 7)]
    plain = generate(*make(script=COPYING), ps, params)
    engine, runner, draft = make("draft", 0, 1, script=COPYING, costs=BATCH_BOUND)
    spec = generate(engine, runner, draft, ps, params)  # check_caches runs after every step
    assert {k: o.token_ids for k, o in spec.items()} == {k: o.token_ids for k, o in plain.items()}
    assert engine.stats.spec_steps > 0 and engine.stats.spec_accepted > 20
    for name in ("s0", "s1", "s2", "s3"):  # keep batch 4 so the draft is not prefilled
        engine.add_request(name, ps[0] + spec[("r0", 0)].token_ids[:30] + [3], params[1])
    outs = run_all(engine, runner, draft)
    assert outs[("s0", 0)].metrics.cached_tokens == 12 + 30
    want = generate(
        *make(script=COPYING, prefix_cache=False),
        [ps[0] + spec[("r0", 0)].token_ids[:30] + [3]],
        params[1],
    )
    assert outs[("s0", 0)].token_ids == want[("r0", 0)].token_ids


def test_a_draft_never_catches_up_on_more_than_the_request_has_left():
    """At the tail of a batch the last request runs alone and drafting would pay, but its
    draft skipped a 40-token prompt and 8 outputs at batch 4: with 22 tokens left, catching
    up costs more than drafting saves, so it decodes plainly (and its answer is plain's)."""
    ps = [COPYING[:40], COPYING[3:15], COPYING[5:17], COPYING[7:19]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 5, 6, 8)]
    _assert_the_draft_model_does_no_work(ps, params)


def test_a_draft_does_not_catch_up_while_its_batch_fills():
    """Six 60-token prompts prefill one chunk at a time: the first requests decode alone for a
    few steps, where drafting would pay, but the batch they are about to join (six) does not
    draft, so their drafts never catch up on the prompts they skipped."""
    ps = [COPYING[i : i + 60] for i in range(6)]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    _assert_the_draft_model_does_no_work(ps, params)


def test_prompts_too_deep_for_drafting_to_pay_are_not_fed_to_the_draft_model():
    """Two 40-token prompts decode where no draft pays (DEPTH_BOUND), though one would at the
    cost table's own depth: the draft model takes neither prompt, nor a catch-up, nor a probe
    (priced at the table's depth, the prompts were prefilled into it for nothing)."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    _assert_the_draft_model_does_no_work([COPYING[:40], COPYING[2:42]], params, DEPTH_BOUND)


class TimedRunner(FakeRunner):
    """A runner on a fake clock: per sequence a decode step takes 1 and a verify of n tokens
    1 + 0.1 (n - 1); the decode and verify calls numbered in `burst` take twice as long (other
    work on the machine)."""

    def __init__(self, clock, burst, **kwargs) -> None:
        super().__init__(**kwargs)
        self.clock, self.burst, self.timed = clock, burst, 0

    def _spend(self, seconds: float) -> None:
        self.clock.now += seconds * (2 if self.timed in self.burst else 1)
        self.timed += 1

    def batch_decode(self, embeddings, seq_ids):
        self._spend(len(seq_ids))
        return super().batch_decode(embeddings, seq_ids)

    def batch_verify(self, embeddings, seq_ids, lengths, token_tree_parent_ptr):
        self._spend(sum(1 + 0.1 * (n - 1) for n in lengths))
        return super().batch_verify(embeddings, seq_ids, lengths, token_tree_parent_ptr)


def _timed_config(monkeypatch, sequences: int, tokens: int, mode: str = "ngram") -> tuple:
    """A fake clock that cost.py times with, and an engine config for TimedRunners."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(cost, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    config = EngineConfig(
        max_num_sequence=sequences,
        max_total_sequence_length=tokens,
        prefill_chunk_size=64,
        kv_cache_page_size=4,
        speculative_mode=mode,
        draft_model="d" if mode == "draft" else None,
    )
    return clock, config


def test_step_costs_are_measured_round_by_round(monkeypatch):
    """Six consecutive calls twice as slow, wherever they fall in the measurement, leave the
    cost table exact: every step is timed once per round and its fastest round counts, so no
    step has all its timed calls inside the burst (timed call by call, a burst over one step's
    calls made that step alone look twice as slow)."""
    clock, config = _timed_config(monkeypatch, 8, 2048)
    for start in range(0, 60, 3):
        runner = TimedRunner(clock, range(start, start + 6), vocab_size=128)
        engine = Engine(runner, config, context_window=256, cost_model=FLAT)
        table = engine.measure_costs()
        for b, row in table.verify.items():
            want = {n: pytest.approx(b * (1 + 0.1 * (n - 1))) for n in row}
            assert row == want, (start, b)


class LingeringRunner(TimedRunner):
    """TimedRunner whose call right after a verify of 9 tokens per sequence takes half as
    long again (on a Xeon, a decode step right after a 9-token verify took 4.2-4.6 ms, 3.8 ms
    after a 2-token one)."""

    after_nine = False  # the last call was a 9-token verify

    def _spend(self, seconds: float) -> None:
        super()._spend(seconds * (1.5 if self.after_nine else 1))
        self.after_nine = False

    def batch_verify(self, embeddings, seq_ids, lengths, token_tree_parent_ptr):
        out = super().batch_verify(embeddings, seq_ids, lengths, token_tree_parent_ptr)
        self.after_nine = max(lengths) == 9
        return out


def test_no_step_is_costed_only_right_after_the_largest_verify(monkeypatch):
    """Every step is timed at least once right after a step no larger than itself, so a step
    that runs slower after the largest verify is costed as it runs elsewhere (timed in one
    order every round, the plain step always came right after the 9-token verify and cost
    1.5x: verifies looked cheap beside it)."""
    clock, config = _timed_config(monkeypatch, 4, 4096)
    runner = LingeringRunner(clock, (), vocab_size=128)
    engine = Engine(runner, config, context_window=256, cost_model=FLAT)
    table = engine.measure_costs()
    for b, row in table.verify.items():
        assert row == {n: pytest.approx(b * (1 + 0.1 * (n - 1))) for n in row}, b


class DepthRunner(TimedRunner):
    """TimedRunner whose steps also cost, per sequence, 0.002 per token verified and token
    cached before it (attention over the cache grows with its depth)."""

    def batch_decode(self, embeddings, seq_ids):
        self.clock.now += sum(0.002 * len(self.seqs[s]) for s in seq_ids)
        return super().batch_decode(embeddings, seq_ids)

    def batch_verify(self, embeddings, seq_ids, lengths, token_tree_parent_ptr):
        self.clock.now += sum(0.002 * n * len(self.seqs[s]) for s, n in zip(seq_ids, lengths))
        return super().batch_verify(embeddings, seq_ids, lengths, token_tree_parent_ptr)


def test_step_costs_follow_the_depth_of_the_cache(monkeypatch):
    """The table is measured 64 tokens deep at every batch size and once more, at 4 sequences,
    as deep as the context window allows; a verify deeper in the cache costs what the runner
    takes there (every 32-token depth bucket exactly), and not less than at the table's depth
    for shallower ones."""
    clock, config = _timed_config(monkeypatch, 4, 4096)
    runner = DepthRunner(clock, (), vocab_size=128)
    engine = Engine(runner, config, context_window=300, cost_model=FLAT)
    table = engine.measure_costs()
    assert (table.depth, table.deep_depth) == (64, 300 - max(table.verify[1]))
    assert table.deep_batch == 4
    assert CostModel.from_dict(table.to_dict()) == table

    def true(b: int, n: int, depth: int) -> float:
        return b * (1 + 0.1 * (n - 1) + 0.002 * n * depth)

    for b in (1, 2, 4):
        for n in (1, 2, 5):
            assert table.verify_cost(b, n) == pytest.approx(true(b, n, 64))
            assert table.verify_cost(b, n, 10) == pytest.approx(true(b, n, 64))
            for depth in (96, 256, 1024):
                assert table.verify_cost(b, n, depth) == pytest.approx(true(b, n, depth)), (b, n)
    # a depth between buckets is costed at the bucket's end
    assert table.verify_cost(1, 5, 97) == pytest.approx(true(1, 5, 128))


def test_the_deep_point_takes_as_many_sequences_as_the_cache_holds(monkeypatch):
    """A cache with room for two sequences at the second depth measures it at 2 sequences,
    and verifies deep in the cache still cost what the runner takes there."""
    clock, config = _timed_config(monkeypatch, 4, 700)
    engine = Engine(DepthRunner(clock, (), vocab_size=128), config, context_window=300)
    table = engine.costs
    assert (table.deep_batch, table.deep_depth) == (2, 300 - max(table.verify[1]))
    for b in (1, 3, 4):
        for depth in (256, 1024):
            want = b * (1 + 0.1 * 4 + 0.002 * 5 * depth)
            assert table.verify_cost(b, 5, depth) == pytest.approx(want), (b, depth)


class DepthDraft(DepthRunner):
    """A draft model a tenth the target's size whose attention is the target's (a self-draft):
    per sequence 0.1 a decode step, plus 0.002 per token cached."""

    def _spend(self, seconds: float) -> None:
        super()._spend(0.1 * seconds)


def test_draft_steps_are_costed_at_the_depth_of_the_cache(monkeypatch):
    """A draft model's attention grows with the depth as the target's does: its decode step is
    measured at the deep point too, and a draft step deeper in the cache costs what the draft
    runner takes there. Priced at the table's depth alone, drafts looked cheap beside verifies
    priced at their depth: 4 requests 512 tokens deep at acceptance 0.8 drafted a token per
    step, at 0.42 tokens per second of these runners against plain decoding's 0.49."""
    clock, config = _timed_config(monkeypatch, 4, 4096, mode="draft")
    runner, draft = DepthRunner(clock, (), vocab_size=128), DepthDraft(clock, (), vocab_size=128)
    engine = Engine(runner, config, context_window=300, draft_runner=draft, cost_model=FLAT)
    table = engine.measure_costs()
    assert CostModel.from_dict(table.to_dict()) == table
    for b in (1, 2, 4):
        assert table.draft_cost(b) == pytest.approx(b * (0.1 + 0.002 * 64))
        for depth in (96, 256, 1024):
            assert table.draft_cost(b, depth) == pytest.approx(b * (0.1 + 0.002 * depth)), b
    shallow_priced = dataclasses.replace(table, deep_draft=0.0)
    assert best_draft_length([0.8] * 4, table, 8, 64) == 2  # drafting pays near the top
    assert best_draft_length([0.8] * 4, table, 8, 512) == 0
    assert best_draft_length([0.8] * 4, shallow_priced, 8, 512) == 1


def test_a_window_too_short_for_a_second_depth_leaves_the_table_flat(monkeypatch):
    clock, config = _timed_config(monkeypatch, 2, 512)
    engine = Engine(DepthRunner(clock, (), vocab_size=128), config, context_window=100)
    assert engine.costs.deep == {} and engine.costs.deep_depth == 0
    assert engine.costs.verify_cost(1, 5, 90) == engine.costs.verify_cost(1, 5)


# -- bad input and failures -----------------------------------------------------------------------


def test_speculation_options_are_checked():
    with pytest.raises(MlcrunError, match="spec_draft_length"):
        EngineConfig(speculative_mode="ngram", spec_draft_length=-1)
    with pytest.raises(MlcrunError, match="256"):
        EngineConfig(speculative_mode="ngram", spec_draft_length=200, spec_tree_width=80)
    with pytest.raises(MlcrunError, match="draft_model"):
        EngineConfig(speculative_mode="draft")
    with pytest.raises(MlcrunError, match="draft model"):
        Engine(
            FakeRunner(),
            EngineConfig(
                max_num_sequence=2,
                max_total_sequence_length=64,
                prefill_chunk_size=16,
                kv_cache_page_size=4,
                speculative_mode="self",
            ),
            context_window=64,
        )


def test_a_tree_larger_than_the_prefill_chunk_is_refused():
    config = EngineConfig(
        max_num_sequence=2,
        max_total_sequence_length=256,
        prefill_chunk_size=16,
        kv_cache_page_size=4,
        speculative_mode="ngram",
        spec_draft_length=12,
        spec_tree_width=6,
    )
    with pytest.raises(MlcrunError, match="18 nodes is over the 16 tokens one forward takes"):
        Engine(FakeRunner(), config, context_window=64)


def test_a_failed_draft_forward_fails_only_the_drafting_requests():
    ps = prompts(4, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0)
    plain = generate(*make(script=COPYING), ps, params)
    engine, runner, draft = make("draft", 3, 1, script=COPYING, seqs=4)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    engine.step()  # prefill
    draft.fail_next = RuntimeError("draft exploded")
    engine.add_request("late", ps[0], params)
    outs = run_all(engine, runner, draft)
    failed = [k for k, o in outs.items() if o.finish_reason == "error"]
    assert failed and all("draft exploded" in outs[k].error for k in failed)
    assert outs[("late", 0)].token_ids == plain[("r0", 0)].token_ids


def test_ngram_lookup_prefers_the_longest_match():
    drafter = NgramDrafter(ngram_max=3)
    tree = drafter.lookup([1, 2, 3, 9, 9, 2, 3, 4, 5, 6, 1, 2, 3], k=3)
    assert tree.tokens == [9, 9, 2]  # "1 2 3" (n = 3) beat "2 3" -> 4
    assert drafter.lookup([1, 2, 3, 4], k=3).tokens == []
    wide = NgramDrafter(2).lookup([7, 1, 5, 7, 1, 6, 7, 1], k=2, width=3)
    assert wide.tokens[:2] == [6, 7] and wide.tokens[2:] == [5] and wide.parents == [0, 1, 0]


def test_ngram_lookup_ranks_the_occurrences_of_its_match():
    """Of several earlier occurrences of the matched n-gram, the draft continues the one whose
    earlier tokens agree longest with the request's, then the continuation that followed the
    most occurrences, then the one with the most of k tokens after it."""
    one = NgramDrafter(ngram_max=1)
    assert one.lookup([3, 1, 5, 4, 1, 6, 3, 1], k=1).tokens == [5]  # "3 1" before 5
    assert one.lookup([2, 1, 5, 2, 1, 5, 2, 1, 6, 3, 1], k=1).tokens == [5]  # 5 twice, 6 once
    assert one.lookup([2, 1, 5, 9, 9, 2, 1, 6, 3, 1], k=4).tokens == [5, 9, 9, 2]
    assert one.lookup([2, 1, 5, 9, 9, 2, 1, 6, 3, 1], k=3).tokens == [6, 3, 1]  # the latest


def _scan_lookup(tokens, ngram_max, k, width):
    """Prompt lookup by scanning the whole history: the drafter's rule, stated directly."""
    for n in range(min(ngram_max, len(tokens) - 1), 0, -1):
        follows = [s + n for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
        if follows:
            ranked = follows[-CANDIDATES:]

            def agreement(f):  # of the tokens before f with the last ones, up to CONTEXT_MAX
                m = 0
                while m < min(CONTEXT_MAX, f) and tokens[f - 1 - m] == tokens[-1 - m]:
                    m += 1
                return m

            votes = [sum(tokens[g] == tokens[f] for g in ranked) for f in ranked]
            keys = [(agreement(f), v, min(len(tokens) - f, k), f) for f, v in zip(ranked, votes)]
            best = max(keys)[3]
            chain = tokens[best : best + k]
            others = []
            for f in reversed(follows):
                if tokens[f] not in (chain[0], *others) and len(others) < width - 1:
                    others.append(tokens[f])
            return chain, others
    return [], []


def test_ngram_index_follows_a_growing_request():
    """The drafter indexes a request's tokens once and extends the index as they grow; every
    step's draft is what a scan of the whole history gives."""
    rng = np.random.default_rng(7)
    for trial in range(40):
        ngram_max, vocab = int(rng.integers(1, 5)), int(rng.integers(2, 7))
        drafter = NgramDrafter(ngram_max)
        prompt = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
        req = Request(f"r{trial}", prompt, SamplingParams())
        for _ in range(30):
            k, width = int(rng.integers(1, 6)), int(rng.integers(1, 4))
            tree = drafter.propose([req], {req: k}, width)[req]
            chain, others = _scan_lookup(req.tokens, ngram_max, k, width)
            assert tree.tokens == chain + others
            assert tree.parents == list(range(len(chain))) + [0] * len(others)
            for token in rng.integers(0, vocab, int(rng.integers(1, 4))).tolist():
                req.append(token)


# A verify dear against a plain step: at the prior acceptance (0.6) no draft length pays, at
# 0.73 (a probe of 2 drafts, both kept) two drafts do, and drafts that are always right pay most.
DEAR_VERIFY = CostModel(verify={1: {1: 1.0, 2: 1.5, 9: 2.0}}, draft={1: 0.3})


def test_a_draft_model_the_prior_rules_out_is_probed_and_then_drafts():
    """Where the prior acceptance says drafting does not pay, the prompt is not fed to the
    draft model, so its draft lags: a probe (after a catch-up) measures the request's own
    acceptance, and a draft that is always right then drafts on, catching up on the token
    each fully kept verify leaves it behind."""
    ps = [COPYING[:12]]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    plain = generate(*make(script=COPYING), ps, params)
    engine, runner, draft = make("draft", 0, 1, script=COPYING, costs=DEAR_VERIFY)
    assert not engine._feeding_the_draft_pays()  # the prior: no draft pays here
    spec = generate(engine, runner, draft, ps, params)
    assert spec[("r0", 0)].token_ids == plain[("r0", 0)].token_ids
    # the first 16 tokens decode plainly (no probe is due before), the rest mostly drafted
    assert engine.stats.spec_accepted > 40
    assert engine.stats.spec_accepted == engine.stats.spec_drafted
