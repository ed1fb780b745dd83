"""The interactive REPL in a real terminal (pexpect): streaming, commands, Ctrl-C, overflow."""

import json
import os
import re
import sys

import pexpect
import pytest
from checkpoints import build_checkpoint

from mlcrun import LLM, SamplingParams
from mlcrun.chat import Conversation
from mlcrun.compiler.build import compile_model
from mlcrun.compiler.options import CompileOptions

PROMPT = "> "


@pytest.fixture(scope="module")
def long_context_artifact(tmp_path_factory):
    """A tiny model with a 4096-token window, so an answer can run long enough to interrupt."""
    root = tmp_path_factory.mktemp("repl")
    ckpt = build_checkpoint("llama", root / "ckpt", max_position_embeddings=4096)
    return compile_model(str(ckpt), root / "art", CompileOptions())


def spawn(folder, tmp_path, *args):
    env = {
        **os.environ,
        "MLCRUN_HOME": str(tmp_path / "home"),
        "NO_COLOR": "1",
        "TERM": "dumb",
        "COLUMNS": "200",
    }
    child = pexpect.spawn(
        sys.executable,
        ["-m", "mlcrun", "chat", str(folder), *args],
        env=env,
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 200),
    )
    child.expect("mlcrun chat")
    child.expect_exact(PROMPT)
    return child


def answer(child, text):
    child.sendline(text)
    child.expect_exact(PROMPT)
    out = child.before.replace("\r\n", "\n")
    return out.split(text, 1)[-1].strip("\n")


def test_commands_and_seeded_set(artifacts, tmp_path):
    folder = artifacts("llama")
    child = spawn(folder, tmp_path, "--temperature", "0", "--top-p", "1", "--max-tokens", "8")
    greedy = answer(child, "hello")
    want = "".join(
        Conversation(LLM(folder), SamplingParams(max_tokens=8, temperature=0)).ask("hello")
    )
    assert greedy.strip() == want.strip()

    assert "tokens at" in answer(child, "/stats")
    assert "temperature': 0.9" in answer(child, "/set temperature=0.9;seed=3;max_tokens=8")
    answer(child, "/reset")
    sampled = answer(child, "hello")
    conv = Conversation(LLM(folder), SamplingParams(max_tokens=8, temperature=0.9, seed=3))
    assert sampled.strip() == "".join(conv.ask("hello")).strip()

    assert "system message set" in answer(child, "/system Be nice.")
    assert "unknown setting" in answer(child, "/set bogus=1")
    assert "unknown command" in answer(child, "/nope")
    assert "/save FILE" in answer(child, "/help")
    child.sendline('"""')
    child.sendline("line one")
    child.sendline("line two")
    child.sendline('"""')
    child.expect_exact(PROMPT)
    save = tmp_path / "conv.json"
    answer(child, f"/save {save}")
    saved = json.loads(save.read_text())["messages"]
    assert saved[0] == {"role": "system", "content": "Be nice."}
    assert saved[1] == {"role": "user", "content": "line one\nline two"}
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_streaming_and_ctrl_c_interrupts_an_answer(long_context_artifact, tmp_path):
    child = spawn(
        long_context_artifact, tmp_path, "--max-tokens", "3500", "--temperature", "1", "--seed", "1"
    )
    child.sendline("tell me everything")
    child.expect(r"tell me everything\r?\n")
    child.expect(r"\S{8,}")  # text streams in while the answer is still being generated
    child.sendintr()
    child.expect_exact("(stopped)")
    child.expect_exact(PROMPT)
    assert answer(child, "/stats")  # the REPL is alive and the next question works
    child.sendline("again")
    child.expect_exact(PROMPT, timeout=120)
    child.sendintr()  # Ctrl-C at an empty prompt just gives a new prompt
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)


def test_conversation_longer_than_the_context_window(artifacts, tmp_path):
    folder = artifacts("llama")  # 256-token window
    child = spawn(folder, tmp_path, "--temperature", "0", "--max-tokens", "20")
    seen_notice = False
    for i in range(8):
        out = answer(child, f"message number {i}: " + "words " * 10)
        seen_notice |= bool(re.search(r"dropped the oldest turn", out))
    assert seen_notice
    assert "tokens at" in answer(child, "/stats")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
