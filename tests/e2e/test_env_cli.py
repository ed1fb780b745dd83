"""Environment variables as real processes see them: `VAR= mlcrun ...` and malformed values."""

import os
import subprocess
import sys

import pytest


def run_cli(*args, env, unset=()):
    """`mlcrun ARGS` with `env` added to this environment and the `unset` names removed."""
    full = {k: v for k, v in {**os.environ, **env}.items() if k not in unset}
    return subprocess.run(
        [sys.executable, "-m", "mlcrun", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=full,
    )


def assert_one_line_error(result, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_empty_tvm_num_threads_is_unset(artifacts):
    """`TVM_NUM_THREADS= mlcrun chat` runs exactly as with the variable unset (greedy, so the
    two answers are the same tokens; a random-init model may well answer in blanks)."""
    args = ("chat", artifacts("llama"), "--prompt", "hi", "--max-tokens", "3", "--temperature", "0")
    empty = run_cli(*args, env={"TVM_NUM_THREADS": ""})
    assert empty.returncode == 0, empty.stderr
    assert empty.stderr == ""
    unset = run_cli(*args, env={}, unset=("TVM_NUM_THREADS",))
    assert unset.returncode == 0, unset.stderr
    assert empty.stdout == unset.stdout


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
@pytest.mark.parametrize(
    "command",
    [("chat", "--prompt", "hi"), ("serve", "--port", "0"), ("bench", "--num-prompts", "1")],
)
def test_malformed_tvm_num_threads_is_one_line(artifacts, value, command):
    name, *rest = command
    result = run_cli(name, artifacts("llama"), *rest, env={"TVM_NUM_THREADS": value})
    assert_one_line_error(result, "TVM_NUM_THREADS", repr(value))


def test_bad_tvm_num_threads_fails_before_compiling(checkpoints, tmp_path):
    home = tmp_path / "home"
    env = {"TVM_NUM_THREADS": "abc", "MLCRUN_HOME": str(home)}
    result = run_cli("chat", checkpoints("llama"), "--prompt", "hi", env=env)
    assert_one_line_error(result, "TVM_NUM_THREADS")
    assert not home.exists()


def test_mlcrun_home_that_is_a_file_is_one_line(checkpoints, tmp_path):
    home = tmp_path / "home"
    home.write_text("")
    result = run_cli("chat", checkpoints("llama"), "--prompt", "hi", env={"MLCRUN_HOME": str(home)})
    assert_one_line_error(result, "MLCRUN_HOME", "not a directory")
