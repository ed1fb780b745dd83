"""Speculative decoding over compiled models: greedy output is plain decoding's, token for
token, in every mode and architecture; sampled output has plain sampling's exact distribution
(a chi-square against the target's own probabilities, with a deliberately poor draft); both KV
caches hold exactly the accepted tokens after rejections, also on forks from the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

from mlcrun import LLM, EngineConfig, SamplingParams
from mlcrun.engine.sampler import SamplerState, probabilities
from mlcrun.errors import MlcrunError

ARCHS = ["llama", "llama3-rope-tied", "qwen2-tied", "qwen3"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def poor_draft(tmp_path_factory, checkpoints):
    """A draft with the tiny llama's shape and tokenizer but other random weights."""
    from checkpoints import build_checkpoint

    from mlcrun.compiler.build import compile_model
    from mlcrun.compiler.options import CompileOptions

    root = tmp_path_factory.mktemp("poor-draft")
    ckpt = build_checkpoint("llama", root / "ckpt", seed=1)
    return compile_model(str(ckpt), root / "art", CompileOptions(prefill_chunk=64, max_batch=8))


def prompts(n, seed=0):
    """Prompts that repeat themselves, so prompt lookup finds matches too."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        motif = rng.integers(3, 300, size=int(rng.integers(3, 9))).tolist()
        out.append(motif * int(rng.integers(2, 4)) + rng.integers(3, 300, size=4).tolist())
    return out


def spec(folder, mode, k=3, width=1, draft=None, **kw):
    config = EngineConfig(
        max_num_sequence=8,
        speculative_mode=mode,
        spec_draft_length=k,
        spec_tree_width=width,
        draft_model=str(draft) if draft else None,
        **kw,
    )
    return LLM(folder, engine_config=config)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_is_token_for_token_plain_in_every_mode(artifacts, arch):
    folder = artifacts(arch)
    ps = prompts(16, seed=1)
    want = [o.token_ids for o in LLM(folder).generate(ps, GREEDY)]
    for mode, k, width in [("ngram", 3, 1), ("ngram", 0, 3), ("self", 3, 2), ("self", 0, 1)]:
        llm = spec(folder, mode, k, width)
        batched = [o.token_ids for o in llm.generate(ps, GREEDY)]
        assert batched == want, (mode, k, width)
        assert llm.generate(ps[:1], GREEDY)[0].token_ids == want[0], (mode, k, width, "alone")
        if k:
            assert llm.engine.stats.spec_steps > 0, (mode, "never drafted")


def test_a_draft_model_is_exact_with_trees_and_stop_strings_max_tokens_and_the_window(
    artifacts, poor_draft
):
    folder = artifacts("llama")
    plain = LLM(folder)
    tok = plain.tokenizer
    text = "the cat sat on the mat. the cat sat on the hat. " * 3
    base = plain.generate([text], GREEDY)[0].text
    cases = [
        SamplingParams(max_tokens=30, temperature=0, stop=[base[5:8]]),  # a stop string
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
    ]
    long = tok.encode(text * 2)[: 256 - 6]  # 6 tokens from the 256-token window
    for mode, draft, width in [("draft", poor_draft, 1), ("draft", folder, 3), ("ngram", None, 2)]:
        llm = spec(folder, mode, 4, width, draft=draft)
        for params in cases:
            want = plain.generate([text], params)[0]
            got = llm.generate([text], params)[0]
            assert (got.token_ids, got.text, got.finish_reason) == (
                want.token_ids,
                want.text,
                want.finish_reason,
            ), (mode, params)
        to_window = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        got = llm.generate([long], to_window)[0]
        assert got.token_ids == plain.generate([long], to_window)[0].token_ids
        assert got.finish_reason == "length" and len(got.token_ids) == 6


@pytest.mark.parametrize("name", ["mistral-window", "gemma3"])
def test_sliding_window_targets_are_refused(artifacts, name):
    with pytest.raises(MlcrunError, match="sliding-window"):
        spec(artifacts(name), "ngram")


def test_a_draft_with_another_tokenizer_is_refused(artifacts, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(artifacts("llama"), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "x"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(MlcrunError, match="tokenizer differs"):
        spec(artifacts("llama"), "draft", draft=other)


def exact_joint(llm, prompt, params, depth=3):
    """P(the next `depth` tokens), from the target's own logits and the real sampler's
    processing: {token tuple: probability} over the top-k support."""
    model = llm.model
    model.create_kv_cache(max_num_sequence=1, max_total_sequence_length=256)

    def probs(tokens):
        model.reset()
        model.add_new_sequence(0)
        logits = model.batch_prefill(model.token_embed(tokens), [0], [len(tokens)])
        state = SamplerState(params, tokens)
        return probabilities(logits, [params], [state])[0]

    out = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for path, p in out.items():
            row = probs(prompt + list(path))
            for t in np.flatnonzero(row > 0):
                nxt[(*path, int(t))] = p * float(row[t])
        out = nxt
    return out


def test_sampling_with_a_poor_draft_has_the_targets_exact_distribution(artifacts):
    from stats_check import assert_draws_follow

    folder = artifacts("llama")
    prompt = [5, 17, 29, 5, 17, 29, 5, 17]
    params = SamplingParams(max_tokens=3, temperature=1.5, top_k=4, ignore_eos=True)
    # A 4-bit copy of random weights agrees with them on about half the top tokens.
    for width in (1, 2):
        llm = spec(folder, "self", 2, width, max_total_sequence_length=4096,
                   draft_quantization="q4f16_1")  # fmt: skip
        outs = []
        for batch in range(6):
            seeded = [
                SamplingParams(
                    max_tokens=3, temperature=1.5, top_k=4, seed=batch * 1000 + i, ignore_eos=True
                )  # fmt: skip
                for i in range(200)
            ]
            outs += llm.generate([prompt] * 200, seeded)
        stats = llm.engine.stats
        assert stats.spec_accepted > 0 and stats.spec_accepted < stats.spec_drafted
        joint = exact_joint(LLM(folder), prompt, params)
        cells = sorted(joint)
        index = {c: i for i, c in enumerate(cells)}
        draws = np.array([index[tuple(o.token_ids)] for o in outs])
        assert_draws_follow(draws, np.array([joint[c] for c in cells]))


def fresh_logits(model, tokens, scratch=10**6):
    """Logits after `tokens` prefilled into a new sequence (in chunks the library takes)."""
    chunk = model.artifact.prefill_chunk
    model.add_new_sequence(scratch)
    try:
        for start in range(0, len(tokens), chunk):
            piece = tokens[start : start + chunk]
            logits = model.batch_prefill(model.token_embed(piece), [scratch], [len(piece)])
        return logits[0]
    finally:
        model.remove_sequence(scratch)


def forked_logits(model, seq_id, length, token, scratch=10**6 + 1):
    """Logits after `token` appended to the first `length` cached tokens of seq_id."""
    model.fork_sequence(seq_id, scratch, length)
    try:
        return model.batch_decode(model.token_embed([token]), [scratch])[0]
    finally:
        model.remove_sequence(scratch)


def test_both_caches_hold_exactly_the_accepted_tokens_after_rejections(artifacts, poor_draft):
    """After every step that rejected drafts, each running sequence's K/V in the target's and
    the draft's cache gives the logits of a sequence that never saw the rejected tokens."""
    folder = artifacts("llama")
    llm = spec(folder, "draft", 4, 2, draft=poor_draft)
    engine = llm.engine
    shared = prompts(1, seed=7)[0] * 2
    engine.add_request("first", shared + [9, 9], GREEDY)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("forked", shared + [11, 12, 13], GREEDY)  # forks "first" (retained)
    engine.add_request("fresh", prompts(1, seed=8)[0], GREEDY)
    checked, outs = 0, {}
    while engine.has_unfinished():
        rejected = engine.stats.spec_drafted - engine.stats.spec_accepted
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        if engine.stats.spec_drafted - engine.stats.spec_accepted == rejected:
            continue  # nothing was rejected in this step
        for req in engine.scheduler.running:
            caches = ((llm.model, req.num_computed), (llm.draft, req.num_draft_computed))
            for model, length in caches:
                token = req.tokens[length]  # the next token that cache has not seen
                np.testing.assert_allclose(
                    forked_logits(model, req.seq_id, length, token),
                    fresh_logits(model, req.tokens[: length + 1]),
                    atol=1e-4,
                    rtol=0,
                )
                checked += 1
    assert checked >= 4
    assert outs["forked"].metrics.cached_tokens >= len(shared)
