"""The $MLCRUN_HOME cache's stamp key (default_model._stamp_key): made without TVM from what
the compile fingerprint depends on, so any change to those sends resolve_artifact back to the
full check."""

from __future__ import annotations

import os
import subprocess
import sys

from mlcrun import default_model
from mlcrun.default_model import _stamp_key


def _checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 8)
    return folder


def test_stamp_key_changes_with_what_the_fingerprint_depends_on(tmp_path):
    folder = str(_checkpoint(tmp_path))
    key = _stamp_key(folder, "auto", "cpu", None)
    assert key is not None and key == _stamp_key(folder, "auto", "cpu", None)
    assert _stamp_key(folder, "q4f16", "cpu", None) != key
    assert _stamp_key(folder, "auto", "cuda", None) != key
    assert _stamp_key(folder, "auto", "cpu", 512) != key
    weights = tmp_path / "ckpt" / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert _stamp_key(folder, "auto", "cpu", None) != key


def test_no_key_for_a_source_that_cannot_be_opened(tmp_path):
    assert _stamp_key(str(tmp_path / "missing"), "auto", "cpu", None) is None


def test_an_unstamped_or_restamped_entry_is_not_taken(tmp_path):
    out = tmp_path / "entry"
    out.mkdir()
    assert not default_model._stamped(out, "k")  # no stamp, no config
    (out / default_model._STAMP).write_text('{"key": "k", "source_fingerprint": "f"}')
    assert not default_model._stamped(out, "k")  # no artifact config beside it


def test_the_key_is_computed_without_importing_tvm(tmp_path):
    folder = _checkpoint(tmp_path)
    code = (
        "import sys; from mlcrun.default_model import _stamp_key; "
        f"print(_stamp_key({str(folder)!r}, 'auto', 'cpu', None) is not None, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('tvm', 'tvm_ffi', 'gguf')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True []"
