"""Artifacts are code: only files inside the folder, and only the library that was compiled."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlcrun import abi, artifact
from mlcrun.default_model import cache_dir, resolve_artifact
from mlcrun.errors import MlcrunError
from mlcrun.runtime import Model


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mlcrun", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(result, *needles: str) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture
def art(artifacts, tmp_path) -> Path:
    """A private copy of the compiled tiny llama, free to mutate."""
    folder = tmp_path / "art"
    shutil.copytree(artifacts("llama"), folder)
    return folder


def config(folder: Path) -> dict:
    return json.loads((folder / artifact.CONFIG_FILE).read_text())


def edit_config(folder: Path, **changes) -> None:
    data = config(folder)
    data.update(changes)
    (folder / artifact.CONFIG_FILE).write_text(json.dumps(data))


def library(folder: Path) -> Path:
    return folder / config(folder)["library"]


def test_compile_records_the_library_sha256(art):
    want = hashlib.sha256(library(art).read_bytes()).hexdigest()
    assert config(art)["library_sha256"] == want
    assert config(art)["format_version"] == artifact.FORMAT_VERSION == 2


def test_modified_library_byte_is_refused_by_cli_and_model(art):
    data = bytearray(library(art).read_bytes())
    data[len(data) // 2] ^= 0x01
    library(art).write_bytes(bytes(data))
    result = run_cli("chat", art, "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(result, "library_sha256", "recompile")
    assert result.stdout == ""
    with pytest.raises(MlcrunError, match="library_sha256"):
        Model(art)


def test_swapped_library_never_runs(art, tmp_path):
    """The point of the hash: a foreign .so's code (here, a constructor) never runs."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    source = tmp_path / "evil.c"
    source.write_text(
        "#include <stdio.h>\n#include <stdlib.h>\n"
        "__attribute__((constructor)) static void mark(void) {\n"
        '  FILE *f = fopen(getenv("MARK"), "w"); if (f) fclose(f);\n}\n'
    )
    evil = tmp_path / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", evil, source], check=True)
    mark = tmp_path / "ran"
    load = f"import ctypes; ctypes.CDLL({str(evil)!r})"
    subprocess.run([sys.executable, "-c", load], check=True, env={**os.environ, "MARK": str(mark)})
    assert mark.exists()  # loading it does run its code
    mark.unlink()
    shutil.copy(evil, library(art))
    result = run_cli("chat", art, "--prompt", "hi", env={"MARK": str(mark)})
    assert_one_line_error(result, "library_sha256")
    assert not mark.exists()


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("library", "/etc/passwd", "outside"),
        ("library", "../x.so", "outside"),
        ("library", "lib/../lib/cpu.so", "outside"),  # `..` is refused even landing inside
        ("param_files", ["../../p.safetensors"], "outside"),
        ("tokenizer_files", ["/etc/hostname"], "outside"),
        ("library", 7, "not a file name"),
    ],
)
def test_config_entries_naming_files_outside_are_refused(art, key, value, needle):
    # The files named exist and are the real ones, so only the path rule can refuse them.
    shutil.copy(library(art), art.parent / "x.so")
    shutil.copy(next((art / "params").glob("*.safetensors")), art.parent / "p.safetensors")
    edit_config(art, **{key: value})
    entry = value[0] if isinstance(value, list) else value
    result = run_cli("chat", art, "--prompt", "hi")
    assert_one_line_error(result, artifact.CONFIG_FILE, f"{key} {entry!r}", needle)
    with pytest.raises(MlcrunError, match=needle):
        Model(art)


def test_library_symlinked_outside_is_refused(art, tmp_path):
    outside = tmp_path / "outside.so"
    shutil.copy(library(art), outside)  # same bytes: the hash alone would accept it
    library(art).unlink()
    library(art).symlink_to(outside)
    with pytest.raises(MlcrunError, match="library 'lib/cpu.so' resolves outside"):
        artifact.read(art)


def test_old_format_asks_for_a_recompile(art):
    data = config(art)
    del data["library_sha256"]
    data["format_version"] = 1
    (art / artifact.CONFIG_FILE).write_text(json.dumps(data))
    result = run_cli("chat", art, "--prompt", "hi")
    assert_one_line_error(result, "artifact format 1", "needs 2", "mlcrun compile --force")


def test_cache_rebuilds_old_format_and_altered_library(
    artifacts, checkpoints, tmp_path, monkeypatch
):
    """An $MLCRUN_HOME entry from an older format, or with a library altered since, is
    recompiled in place instead of being refused at every load."""
    monkeypatch.setenv("MLCRUN_HOME", str(tmp_path / "home"))
    source = str(checkpoints("llama"))
    cached = cache_dir(source, "auto", "cpu", None)
    shutil.copytree(artifacts("llama"), cached)
    edit_config(cached, format_version=1)
    assert resolve_artifact(source) == cached
    assert config(cached)["format_version"] == 2
    Model(cached)
    with library(cached).open("r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    assert resolve_artifact(source) == cached
    assert artifact.hash_file(library(cached)) == config(cached)["library_sha256"]
    Model(cached)


def test_library_function_lookup(artifacts):
    """What load_vm's "library lacks function" check relies on, against a real VM."""
    import tvm
    from tvm import relax

    from mlcrun.runtime.library import _has

    folder = artifacts("llama")
    lib = tvm.runtime.load_module(str(library(folder)))
    vm = relax.VirtualMachine(lib, tvm.cpu())
    assert _has(vm, abi.EMBED) and not _has(vm, "no_such_function")


def test_a_checked_cache_entry_is_used_without_importing_tvm(checkpoints, tmp_path):
    """Once an entry passed the full up-to-date check (which needs the compiler), later runs
    take it on its stamp without importing TVM's compiler; a stamp of other inputs is
    ignored and the full check runs again."""
    env = {"MLCRUN_HOME": str(tmp_path / "home")}
    source = str(checkpoints("llama"))
    code = (
        "import sys; from mlcrun.default_model import resolve_artifact; "
        f"print(resolve_artifact({source!r}), 'tvm' in sys.modules)"
    )

    def resolve() -> list[str]:
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, **env},
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.split()

    folder, imported = resolve()  # compiles
    assert imported == "True"
    assert resolve() == [folder, "False"]
    stamp = Path(folder) / ".mlcrun-checked.json"
    data = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**data, "key": "0" * 64}))  # e.g. another CPU or TVM
    library_before = (Path(folder) / "lib").stat().st_mtime_ns
    assert resolve() == [folder, "True"]  # checked in full: up to date, not recompiled
    assert (Path(folder) / "lib").stat().st_mtime_ns == library_before
    assert json.loads(stamp.read_text()) == data
    assert resolve() == [folder, "False"]
