"""Environment variables: empty means unset, a malformed value is one error naming it."""

from pathlib import Path

import pytest

from mlcrun import env
from mlcrun.errors import MlcrunError
from mlcrun.paths import mlcrun_home


@pytest.mark.parametrize("text", ["", "  "])
def test_empty_is_unset(monkeypatch, text):
    monkeypatch.setenv("TVM_NUM_THREADS", text)
    monkeypatch.setenv("MLCRUN_HOME", text)
    assert env.tvm_num_threads() is None
    assert mlcrun_home() == Path.home() / ".cache" / "mlcrun"


@pytest.mark.parametrize(("text", "n"), [("1", 1), (" 8 ", 8)])
def test_tvm_num_threads_valid(monkeypatch, text, n):
    monkeypatch.setenv("TVM_NUM_THREADS", text)
    assert env.tvm_num_threads() == n


@pytest.mark.parametrize("text", ["abc", "0", "-2", "1.5", "4 threads"])
def test_tvm_num_threads_malformed(monkeypatch, text):
    monkeypatch.setenv("TVM_NUM_THREADS", text)
    with pytest.raises(MlcrunError, match=f"TVM_NUM_THREADS must be a positive .* got {text!r}"):
        env.tvm_num_threads()


def test_mlcrun_home_expands_user_and_refuses_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("MLCRUN_HOME", "~/mlcrun-home")
    assert mlcrun_home() == Path.home() / "mlcrun-home"
    monkeypatch.setenv("MLCRUN_HOME", str(tmp_path))
    assert mlcrun_home() == tmp_path
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MLCRUN_HOME", str(tmp_path / "file"))
    with pytest.raises(MlcrunError, match="MLCRUN_HOME=.* is not a directory"):
        mlcrun_home()
