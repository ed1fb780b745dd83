"""Compiled models against transformers (eager, fp32): logits and greedy tokens."""

import numpy as np
import pytest
from checkpoints import ARCHS, load_reference, reference_logits

from mlcrun import LLM, SamplingParams
from mlcrun.runtime import Model

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, checkpoints, artifacts):
    name = request.param
    return name, load_reference(checkpoints(name)), artifacts(name)


def test_ragged_prefill_then_batched_decode(pair):
    name, ref, folder = pair
    rng = np.random.default_rng(0)
    # Both prompts are longer than the Mistral window (8), the second spans two KV pages.
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (13, 21)]
    steps = rng.integers(3, 320, size=(16, 2)).tolist()
    # All reference logits first: alternating torch and TVM calls makes their thread pools fight.
    expected = [
        [reference_logits(ref, prompt + [s[row] for s in steps])[len(prompt) - 1 :].numpy()]
        for row, prompt in enumerate(prompts)
    ]
    model = Model(folder)
    for seq_id in (0, 1):
        model.add_new_sequence(seq_id)
    logits = model.batch_prefill(model.token_embed(prompts[0] + prompts[1]), [0, 1], [13, 21])
    for row in range(2):
        np.testing.assert_allclose(logits[row], expected[row][0][0], atol=TOL, rtol=0)
    for step, tokens in enumerate(steps):
        logits = model.batch_decode(model.token_embed(tokens), [0, 1])
        for row in range(2):
            np.testing.assert_allclose(
                logits[row],
                expected[row][0][step + 1],
                atol=TOL,
                rtol=0,
                err_msg=f"{name} decode step {step}",
            )


def test_greedy_tokens_match(pair):
    name, ref, folder = pair
    prompts = [[1, 17, 99, 250, 31], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    expected = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(32):
            ids.append(int(reference_logits(ref, ids)[-1].argmax()))
        expected.append(ids[len(prompt) :])
    llm = LLM(folder)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for want, out in zip(expected, outs):
        assert out.token_ids == want, name
        assert out.finish_reason == "length"


def test_chunked_prefill_over_cached_pages(pair):
    """Prompts fed in ragged chunks: every chunk after the first attends to the sequence's
    cached pages (the paged prefill kernel) and to itself (the ragged one)."""
    name, ref, folder = pair
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (40, 27)]
    expected = [reference_logits(ref, p).numpy() for p in prompts]
    model = Model(folder)
    for seq_id in (0, 1):
        model.add_new_sequence(seq_id)
    done = [0, 0]
    for chunk in ((17, 5), (9, 13), (14, 9)):
        parts = [prompts[i][done[i] : done[i] + chunk[i]] for i in (0, 1)]
        logits = model.batch_prefill(model.token_embed(parts[0] + parts[1]), [0, 1], list(chunk))
        for i in (0, 1):
            done[i] += chunk[i]
            np.testing.assert_allclose(
                logits[i], expected[i][done[i] - 1], atol=TOL, rtol=0, err_msg=f"{name} {done}"
            )
