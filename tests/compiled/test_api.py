"""The public API: LLM.generate with text and token-id prompts, logprobs, sampling."""

import numpy as np
import pytest
import torch
from checkpoints import load_reference, reference_logits

from mlcrun import LLM, MlcrunError, SamplingParams


@pytest.fixture(scope="module")
def llm(artifacts):
    return LLM(artifacts("llama"))


def test_text_prompt_roundtrip(llm):
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=0))
    out = outs[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("Once upon a time")
    assert out.prompt_token_ids[0] == llm.tokenizer.bos_token_id
    assert 1 <= len(out.token_ids) <= 12
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert out.finish_reason in ("stop", "length")


def test_logprobs_match_reference(llm, checkpoints):
    ref = load_reference(checkpoints("llama"))
    prompt = [1, 215, 2]
    outs = llm.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)
    )
    out = outs[0]
    assert len(out.logprobs) == 8
    ids = prompt + out.token_ids
    want = torch.log_softmax(reference_logits(ref, ids), dim=-1).numpy()
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert len(entry) == 5 and token in entry  # greedy: the chosen token is the top one
        row = want[len(prompt) - 1 + i]
        top5 = np.argsort(-row)[:5]
        assert set(entry) == set(top5.tolist())
        for tok, lp in entry.items():
            assert lp == pytest.approx(row[tok], abs=1e-4)


def test_each_prompt_gets_its_own_params_and_batching_is_invisible(llm):
    prompts = [[1, 10, 20], [1, 30, 40, 50], [1, 60]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 7, 5)]
    together = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in together] == [3, 7, 5]
    for prompt, p, out in zip(prompts, params, together):
        alone = llm.generate([prompt], p)[0]
        assert alone.token_ids == out.token_ids


def test_seeded_sampling_is_reproducible_and_varies(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate([[1, 5, 9]], p)[0].token_ids
    b = llm.generate([[1, 5, 9]], p)[0].token_ids
    c = llm.generate(
        [[1, 5, 9]], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
    )[0].token_ids
    assert a == b and a != c


def test_stop_and_errors(llm):
    first = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=5, temperature=0))[0].token_ids[0]
    out = llm.generate(
        [[1, 5, 9]], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(first,))
    )[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    with pytest.raises(MlcrunError, match="context window"):
        llm.generate([[1] * 300])
    with pytest.raises(MlcrunError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_a_conversation_caps_min_tokens_with_max_tokens_at_the_window(llm):
    """min_tokens beyond what the window leaves is capped with max_tokens, not an error."""
    from mlcrun.chat import Conversation

    params = SamplingParams(max_tokens=1000, min_tokens=900, temperature=0)
    conv = Conversation(llm, params)
    text = "".join(conv.ask("Once upon a time"))
    assert conv.last.finish_reason == "length"
    assert conv.last.prompt_tokens + conv.last.completion_tokens == llm.engine.context_window
    assert text == conv.last.text


def test_a_stopped_answer_keeps_its_timings(llm):
    """An answer the caller stops (the REPL's Ctrl-C closes the stream) is aborted with its
    timings kept, so /stats shows its speed rather than 0 tok/s."""
    from mlcrun.chat import Conversation

    conv = Conversation(llm, SamplingParams(max_tokens=200, min_tokens=200, temperature=0))
    answer = conv.ask("Once upon a time")
    pieces = [next(answer) for _ in range(6)]
    answer.close()
    turn = conv.last
    assert turn is not None and turn.finish_reason == "abort"
    assert 6 <= turn.completion_tokens < 200
    assert turn.text == "".join(pieces)
    assert turn.ttft > 0 and turn.decode_tokens_per_s > 0
    assert not llm.engine.has_unfinished()
