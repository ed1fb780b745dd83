"""The checkpoint's generation_config.json sets the sampling defaults of `LLM`, `chat` and
`serve` (vLLM's `--generation-config auto`); what the user gives wins."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from mlcrun import LLM, SamplingParams
from mlcrun.compiler.build import compile_model
from mlcrun.compiler.options import CompileOptions
from mlcrun.llm import generation_defaults
from mlcrun.serve.protocol import ChatCompletionRequest


@pytest.fixture(scope="module")
def greedy_by_default(checkpoints, tmp_path_factory):
    """The tiny llama whose generation_config.json asks for top_k 1 (greedy) at a temperature
    that would otherwise scatter the tokens, and names a template of its own."""
    root = tmp_path_factory.mktemp("gen")
    folder = root / "ckpt"
    shutil.copytree(checkpoints("llama"), folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(top_k=1, temperature=1.5, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    )
    return compile_model(str(folder), root / "art", CompileOptions())


def test_llm_uses_the_generation_config_unless_told_otherwise(greedy_by_default):
    llm = LLM(greedy_by_default)
    assert llm.generation_defaults == {"temperature": 1.5, "top_k": 1}
    assert llm.tokenizer.chat_template.startswith("{% for m in messages %}[")
    prompt = [1, 40, 41, 200]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for seed in range(3):  # the defaults: top_k 1 is greedy whatever the seed
        out = llm.generate([prompt], llm.sampling_params(max_tokens=12, seed=seed, ignore_eos=True))
        assert out[0].token_ids == greedy[0].token_ids
    assert llm.generate([prompt])[0].token_ids[:1] == greedy[0].token_ids[:1]
    # the caller's top_k wins: at temperature 1.5, 3 seeds x 12 tokens never all greedy
    outs = [
        llm.generate([prompt], llm.sampling_params(max_tokens=12, top_k=0, seed=s, ignore_eos=True))
        for s in range(3)
    ]
    assert any(o[0].token_ids != greedy[0].token_ids for o in outs)


def test_chat_cli_and_serve_take_the_defaults(greedy_by_default):
    llm = LLM(greedy_by_default)
    messages = [{"role": "user", "content": "Hello there"}]
    want = llm.chat(messages, SamplingParams(max_tokens=10, temperature=0))[0].text
    result = subprocess.run(
        [sys.executable, "-m", "mlcrun", "chat", str(greedy_by_default)]
        + ["--prompt", "Hello there", "--max-tokens", "10", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n"
    body = ChatCompletionRequest(messages=messages, top_p=0.5)
    params = body.sampling_params(10, None, llm.generation_defaults)
    assert (params.temperature, params.top_k, params.top_p) == (1.5, 1, 0.5)


def test_bad_generation_config_values_are_skipped():
    defaults = generation_defaults({"temperature": 0.6, "top_p": 0.0, "top_k": True, "x": 1})
    assert defaults == {"temperature": 0.6}
