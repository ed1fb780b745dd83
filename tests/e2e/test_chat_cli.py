"""`mlcrun chat` as a real process: one-shot, piped, JSON, errors."""

import json
import os
import subprocess
import sys

from mlcrun import LLM, SamplingParams
from mlcrun.chat import Conversation


def run_chat(*args, stdin=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mlcrun", "chat", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        # Generous: the first run compiles, which took 188 s on 2 cores under heavy load. Only a
        # hang should get here.
        timeout=1800,
        env={**os.environ, **(env or {})},
    )


def expected_answers(folder, questions, max_tokens=12):
    conv = Conversation(LLM(folder), SamplingParams(max_tokens=max_tokens, temperature=0))
    return ["".join(conv.ask(q)) for q in questions]


def test_one_shot_prints_only_the_answer(artifacts):
    folder = artifacts("llama")
    result = run_chat(folder, "--prompt", "Hello there", "--temperature", "0", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected_answers(folder, ["Hello there"])[0] + "\n"


def test_piped_lines_are_turns_of_one_conversation(artifacts):
    folder = artifacts("llama")
    result = run_chat(folder, "--temperature", "0", "--max-tokens", "12", stdin="one\ntwo\n")
    assert result.returncode == 0, result.stderr
    want = expected_answers(folder, ["one", "two"])
    assert result.stdout == "".join(a + "\n" for a in want)


def test_json_mode(artifacts):
    folder = artifacts("llama")
    result = run_chat(
        folder, "--temperature", "0", "--max-tokens", "5", "--json", stdin="first\nsecond\n"
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2
    assert rows[0]["usage"]["completion_tokens"] == 5 and rows[0]["finish_reason"] == "length"
    assert rows[1]["usage"]["cached_tokens"] > 0  # the first turn's prompt is reused


def test_errors_are_one_line_on_stderr(tmp_path):
    result = run_chat(tmp_path / "nope", "--prompt", "hi")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""
    bad = run_chat(tmp_path / "nope", "--prompt", "hi", "--temperature", "-1")
    assert bad.returncode != 0 and "temperature" in bad.stderr


def test_hf_folder_is_compiled_once_into_mlcrun_home(checkpoints, tmp_path):
    home = tmp_path / "home"
    env = {"MLCRUN_HOME": str(home)}
    args = ("--prompt", "hi", "--max-tokens", "3", "--context-window", "128")
    first = run_chat(checkpoints("qwen2-tied"), *args, env=env)
    assert first.returncode == 0, first.stderr
    (artifact,) = (home / "models").iterdir()
    assert json.loads((artifact / "mlcrun-config.json").read_text())["context_window"] == 128
    stamp = (artifact / "mlcrun-config.json").stat().st_mtime_ns
    second = run_chat(checkpoints("qwen2-tied"), *args, env=env)
    assert second.returncode == 0, second.stderr
    assert (artifact / "mlcrun-config.json").stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_llm_chat_uses_the_template(artifacts):
    llm = LLM(artifacts("llama"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    params = SamplingParams(max_tokens=6, temperature=0)
    (out,) = llm.chat(messages, params)
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(messages)
    assert out.token_ids == llm.generate([out.prompt_token_ids], params)[0].token_ids
    assert len(llm.chat([messages, messages[1:]], params)) == 2


def test_speculation_on_the_command_line_keeps_the_answer(artifacts):
    folder = artifacts("llama")
    result = run_chat(
        folder,
        *("--prompt", "Hello there", "--temperature", "0", "--max-tokens", "12", "--json"),
        *("--speculative-mode", "ngram", "--spec-draft-length", "3", "--spec-tree-width", "2"),
    )
    assert result.returncode == 0, result.stderr
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert row["text"] == expected_answers(folder, ["Hello there"])[0]
    assert row["speculation"]["draft_tokens"] >= 0  # the run reports its drafts


def test_bad_speculation_options_are_one_line_errors(artifacts):
    folder = artifacts("llama")
    cases = [
        (("--speculative-mode", "ngram", "--spec-draft-length", "-1"), "spec"),
        (("--speculative-mode", "bogus"), "speculative"),
        (("--speculative-mode", "draft"), "draft"),  # no --draft-model
        (("--speculative-mode", "ngram", "--spec-tree-width", "300"), "256"),
    ]
    for args, needle in cases:
        result = run_chat(folder, "--prompt", "hi", "--max-tokens", "2", *args)
        assert result.returncode != 0, args
        assert "Traceback" not in result.stderr and result.stdout == "", args
        assert len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
        assert needle in result.stderr.lower(), (args, result.stderr)


def test_raw_continues_plain_text_without_template_or_history(artifacts):
    """--raw (base models): each line is text to continue, encoded as is (no chat template),
    and lines do not build a conversation."""
    folder = artifacts("llama")
    llm = LLM(folder)
    want = []
    for text in ("Once upon", "a time"):
        params = SamplingParams(max_tokens=8, temperature=0)
        out = llm.generate([llm.tokenizer.encode(text)], params)
        want.append(out[0].text)
    args = ("--raw", "--temperature", "0", "--max-tokens", "8", "--json")
    result = run_chat(folder, *args, stdin="Once upon\na time\n")
    assert result.returncode == 0, result.stderr
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [a["text"] for a in answers] == want
    assert answers[1]["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("a time"))
    bad = run_chat(folder, "--raw", "--system", "x", "--prompt", "hi")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--raw" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
