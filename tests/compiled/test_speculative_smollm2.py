"""Speculative decoding on a real chat model, SmolLM2-135M-Instruct (the embedded default
model): every mode gives plain greedy decoding's tokens, for 16 concurrent chat prompts and
alone. `self` drafts from a 4-bit copy of an F32 compile; `draft` uses the default q4 model
as the F32 model's draft (the same tokenizer); `ngram` runs on the default q4 model.

The q4 target is compiled with exact (float32) activations. With int8 activations a verify of
K+1 rows and a 1-row decode step round the same activations from inputs that differ in their
last bits, and int8 rounding turns that into logit differences that flip near-ties: the int8
matmuls give a row the same result whatever the row count, but a verify's attention (the
cached pages, the new tokens among themselves, the two merged) sums in another order than a
decode step's (SmolLM2 q4 at depth 100: row 0 of a 3-token verify differs from the decode step
by 3e-8 after the first layer's attention, by 3e-3 entering the eleventh's, by 0.26 in the
logits). Plain decoding at batch 16 differs from batch 1 in the same way (as llama.cpp's
does). Speculation keeps the distribution either way; token-for-token identity is a property
of the arithmetic, checked where it holds."""

from __future__ import annotations

import pytest

from mlcrun import LLM, EngineConfig, SamplingParams, speculation
from mlcrun.default_model import default_model_path
from mlcrun.engine.spec.adaptive import CostModel

QUESTIONS = [
    "What is the capital of France?",
    "Repeat exactly: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that adds two numbers.",
    "Summarize: The cat sat on the mat. The mat was red. The cat was happy.",
    "List three colors.",
    "Why is the sky blue?",
    "Translate 'good morning' to French.",
    "Count from one to ten in words.",
    "Correct the spelling: 'Teh wether is nise todya.'",
    "What is 12 times 12?",
    "Give me a haiku about rain.",
    "Copy this list: apples, pears, plums, cherries, grapes.",
    "Who wrote Romeo and Juliet?",
    "Name a large animal.",
    "Say hello in Spanish.",
    "Describe a tree in one sentence.",
]
GREEDY = SamplingParams(max_tokens=48, temperature=0)
# Step costs under which drafting pays at every batch size (verifies of up to 9 tokens cost
# little more than one; draft steps next to nothing). The adaptive modes' choices follow the
# machine's measured costs, and on a CPU where the F32 target's 1-token step is cheap beside
# its q4 self-draft's, even drafts that are always right do not pay at batch 16: they would
# rightly never draft, and this test would check plain decoding against itself.
DRAFTING_PAYS = CostModel(
    verify={1: {1: 1.0, 9: 1.2}, 16: {1: 2.0, 9: 2.4}}, draft={1: 0.05, 16: 0.1}
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(default q4 artifact, F32 artifact) of SmolLM2-135M-Instruct."""
    from mlcrun.compiler.build import compile_model
    from mlcrun.compiler.options import CompileOptions

    root = tmp_path_factory.mktemp("smollm2")
    gguf = str(default_model_path())
    q4 = compile_model(
        gguf,
        root / "q4",
        CompileOptions(context_window=1024, max_batch=16, activations="exact"),
    )
    f32 = compile_model(
        gguf, root / "f32", CompileOptions(quantization="q0f32", context_window=1024, max_batch=16)
    )
    return q4, f32


def chat_prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def engine(folder, **spec) -> LLM:
    return LLM(folder, engine_config=EngineConfig(max_num_sequence=16, **spec))


@pytest.mark.parametrize(
    "which,spec",
    [
        ("q4", dict(speculative_mode="ngram", spec_draft_length=4)),
        ("q4", dict(speculative_mode="ngram", spec_tree_width=3)),
        ("f32", dict(speculative_mode="self", spec_draft_length=3)),
        ("f32", dict(speculative_mode="self", spec_tree_width=2)),
        ("f32", dict(speculative_mode="draft", spec_draft_length=3)),
    ],
    ids=["ngram-k4", "ngram-adaptive-w3", "self-k3", "self-adaptive-w2", "draft-q4-k3"],
)
def test_greedy_chat_is_token_for_token_plain(models, monkeypatch, tmp_path, which, spec):
    monkeypatch.setenv("MLCRUN_HOME", str(tmp_path))  # self-drafts and cost tables go here
    if not spec.get("spec_draft_length"):  # adaptive: costs where it drafts (DRAFTING_PAYS)
        monkeypatch.setattr(speculation, "cached_costs", lambda *a: (None, DRAFTING_PAYS))
    q4, f32 = models
    folder = q4 if which == "q4" else f32
    if spec["speculative_mode"] == "draft":
        spec = {**spec, "draft_model": str(q4)}
    plain = engine(folder)
    prompts = chat_prompts(plain)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    llm = engine(folder, **spec)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, (QUESTIONS[i], plain.tokenizer.decode(a), plain.tokenizer.decode(b))
    assert llm.generate(prompts[1:2], GREEDY)[0].token_ids == want[1]
    stats = llm.engine.stats
    # A fixed K always drafts; an adaptive one where the costs say it pays (here: always).
    assert stats.spec_steps > 0, stats
    if spec.get("spec_draft_length"):
        assert stats.spec_accepted > 0, stats
