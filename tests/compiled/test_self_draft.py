"""Self-drafts (compiler/draft.py): a low-bit copy of a compiled model's own weights.

One draft (the default preset, q4f16_1+q8f16) is built into a temporary $MLCRUN_HOME from the
session's q0f32 tiny llama and checked against compiling the checkpoint with that preset
directly: the same params bit for bit and the same logits. Its agreement with the target is the
q4 preset's own: the session checkpoints' Gaussian weights (initializer_range 0.1) are the worst
case for a 4-bit min/max quantizer (see test_quant_parity.py), where top-1 agreement on the
target's greedy text is ~0.63 and the logits cosine ~0.965 (plain q4f16_1: ~0.57, ~0.946),
against ~1/320 for an unrelated model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mlcrun import artifact
from mlcrun.compiler import build as build_mod
from mlcrun.compiler import draft as draft_mod
from mlcrun.compiler.build import compile_model
from mlcrun.compiler.draft import (
    DEFAULT_DRAFT_QUANTIZATION,
    build_draft,
    compile_draft,
    draft_cache_path,
    draft_dirname,
    resolve_self_draft,
)
from mlcrun.compiler.options import CompileOptions
from mlcrun.errors import MlcrunError
from mlcrun.runtime import Model

Q = DEFAULT_DRAFT_QUANTIZATION  # q4f16_1+q8f16
OPTIONS = CompileOptions(prefill_chunk=64, max_batch=8)  # the session `artifacts` fixture's
TOKENS = np.random.default_rng(0).integers(3, 320, 48).tolist()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlcrun-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLCRUN_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def target(artifacts) -> Path:
    return artifacts("llama")


@pytest.fixture(scope="module")
def draft(home, target) -> Path:
    return resolve_self_draft(target, Q)


@pytest.fixture(scope="module")
def direct(tmp_path_factory, checkpoints) -> Path:
    """The checkpoint compiled with the draft's preset, the way a draft should come out."""
    out = tmp_path_factory.mktemp("direct") / "llama-q4"
    options = CompileOptions(quantization=Q, prefill_chunk=64, max_batch=8)
    return compile_model(str(checkpoints("llama")), out, options)


def params(folder: Path) -> dict[str, np.ndarray]:
    arrays = {}
    for path in sorted((folder / artifact.PARAMS_DIR).glob("*.safetensors")):
        arrays.update(load_file(str(path)))
    return arrays


def chain_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    """Logits at every position of `tokens` (one batch_verify over a chain)."""
    model = Model(folder)
    model.add_new_sequence(0)
    parents = list(range(-1, len(tokens) - 1))
    return model.batch_verify(model.token_embed(tokens), [0], [len(tokens)], parents)


def greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    model = Model(folder)
    model.add_new_sequence(0)
    logits = model.batch_prefill(model.token_embed(prompt), [0], [len(prompt)])[0]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.batch_decode(model.token_embed([out[-1]]), [0])[0]
    return out


def copy_artifact(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def edit_config(folder: Path, **changes) -> None:
    path = folder / artifact.CONFIG_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def run_cli(*args, home: Path):
    return subprocess.run(
        [sys.executable, "-m", "mlcrun", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "MLCRUN_HOME": str(home)},
    )


# ------------------------------------------------------------------- (a) exactly a q4 compile
def test_draft_is_the_direct_compile(draft, direct, target, home):
    assert draft.parent == home / "drafts"
    got, want = params(draft), params(direct)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    d, w, t = artifact.read(draft), artifact.read(direct), artifact.read(target)
    assert d.quantization == Q and d.draft_of == t.params_sha256
    assert d.library_metadata() == w.library_metadata()
    for key in ("model", "device", "target", "context_window", "prefill_chunk", "max_batch"):
        assert getattr(d, key) == getattr(t, key), key
    assert d.page_size == t.page_size and d.tokenizer_files == t.tokenizer_files
    for name in t.tokenizer_files:
        assert (draft / name).read_bytes() == (target / name).read_bytes()
    artifact.verify_params(draft, d)
    artifact.verify_library(draft, d)

    np.testing.assert_array_equal(chain_logits(draft, TOKENS), chain_logits(direct, TOKENS))


# ------------------------------------------------------------------- (b) it drafts the target
def test_draft_agrees_with_target(draft, target):
    rng = np.random.default_rng(1)
    agree, cosine = [], []
    for _ in range(3):
        prompt = rng.integers(3, 320, 8).tolist()
        text = prompt + greedy(target, prompt, 24)
        t = chain_logits(target, text)[len(prompt) - 1 : -1]
        d = chain_logits(draft, text)[len(prompt) - 1 : -1]
        agree += list(np.argmax(d, axis=-1) == np.array(text[len(prompt) :]))
        cosine += list((d * t).sum(-1) / np.linalg.norm(d, axis=-1) / np.linalg.norm(t, axis=-1))
    assert np.mean(agree) >= 0.4, np.mean(agree)
    assert np.mean(cosine) >= 0.93, np.mean(cosine)


# ------------------------------------------------------------------- (c) cached, checked
def _no_build(*args, **kwargs):
    raise AssertionError("the draft was rebuilt")


def test_resolve_reuses_the_cached_draft(draft, target, monkeypatch):
    mtime = (draft / artifact.CONFIG_FILE).stat().st_mtime_ns
    monkeypatch.setattr(draft_mod, "build_draft", _no_build)
    assert resolve_self_draft(target, Q) == draft
    assert resolve_self_draft(target) == draft  # the default
    assert (draft / artifact.CONFIG_FILE).stat().st_mtime_ns == mtime


def test_resolve_prefers_the_targets_own_draft(draft, target, tmp_path, monkeypatch):
    own = copy_artifact(target, tmp_path / "target")
    shutil.copytree(draft, own / draft_dirname(Q))
    monkeypatch.setattr(draft_mod, "build_draft", _no_build)
    assert resolve_self_draft(own, Q) == own / draft_dirname(Q)
    artifact.read(own)  # the sub-folder does not disturb the target


def test_a_draft_of_other_params_is_rebuilt(draft, target, tmp_path, monkeypatch):
    """Target params changed (a new params hash): neither its own draft-q/ nor the cached
    draft is used; a stale or broken cache entry is rebuilt in place."""
    changed = copy_artifact(target, tmp_path / "target")
    shutil.copytree(draft, changed / draft_dirname(Q))
    art = artifact.read(changed)
    files = [changed / artifact.PARAMS_DIR / name for name in art.param_files]
    arrays = load_file(str(files[0]))
    name = next(n for n in arrays if n.endswith("norm.weight"))
    arrays[name] = arrays[name] * 1.5
    save_file(arrays, str(files[0]))
    edit_config(changed, params_sha256=artifact.hash_files(files))
    new = artifact.read(changed)
    builds = []

    def fake_build(target, quantization, out, *, progress=None, force=False):
        builds.append((target, quantization, out, force))
        return out

    monkeypatch.setattr(draft_mod, "build_draft", fake_build)
    out = resolve_self_draft(changed, Q)
    assert builds == [(changed, Q, draft_cache_path(new, Q), True)]
    assert out == draft_cache_path(new, Q) != draft

    stale = copy_artifact(draft, out)  # the old draft where the new one belongs
    assert resolve_self_draft(changed, Q) == out and len(builds) == 2
    fingerprint = draft_mod.draft_fingerprint(changed, new, Q)
    edit_config(stale, draft_of=new.params_sha256, source_fingerprint=fingerprint)  # current
    assert resolve_self_draft(changed, Q) == out and len(builds) == 2
    (stale / artifact.read(stale).library).write_bytes(b"not the library")
    assert resolve_self_draft(changed, Q) == out and len(builds) == 3


# ------------------------------------------------------------------- (d) refusals
@pytest.mark.parametrize("quantization", ["q4f16_1", "q4f16_1+q8f32", "q4f32_1"])
def test_refuses_a_target_as_narrow(target, tmp_path, quantization):
    narrow = copy_artifact(target, tmp_path / "target")
    edit_config(narrow, quantization=quantization)
    with pytest.raises(MlcrunError) as err:
        resolve_self_draft(narrow, Q)
    message = str(err.value)
    assert "\n" not in message
    assert f"a {quantization} model" in message
    assert "helps q0f32, q0f16, q0bf16, q8f32 and q8f16 targets" in message


@pytest.mark.parametrize(
    "quantization, needle",
    [("q3f16", "is not available"), ("auto", "is not available"), ("q0f32", "no narrower")],
)
def test_refuses_a_bad_draft_quantization(target, quantization, needle):
    with pytest.raises(MlcrunError, match=needle):
        resolve_self_draft(target, quantization)


def test_other_draft_presets():
    draft_mod.check_helps("q0f32", "q8f32")
    draft_mod.check_helps("q0f16", "q4f16_1+q8f32")
    draft_mod.check_helps("q8f16", Q)  # a GGUF Q8_0 model (8.5 bits against 5)
    with pytest.raises(MlcrunError, match="helps q0f32, q0f16 and q0bf16 targets"):
        draft_mod.check_helps("q8f32", "q8f32")


def test_cli_refuses_before_compiling(checkpoints, tmp_path, home):
    out = tmp_path / "out"
    args = ("compile", checkpoints("llama"), "-o", out, "-q", "q4f16_1")
    result = run_cli(*args, "--draft-quantization", Q, home=home)
    assert result.returncode == 1, result.stderr
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "a q4f16_1 model" in err and "q0f32, q0f16, q0bf16, q8f32 and q8f16 targets" in err, err
    assert not out.exists()


# ------------------------------------------------------------------- (e) mlcrun compile
def test_failed_draft_leaves_the_target(target, tmp_path, monkeypatch):
    out = copy_artifact(target, tmp_path / "out")

    def broken(*args):
        raise RuntimeError("build failed")

    monkeypatch.setattr(build_mod, "_build_library", broken)
    with pytest.raises(RuntimeError, match="build failed"):
        compile_draft(out, Q)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in target.iterdir())
    artifact.verify_params(out, artifact.read(out))


def test_cli_compile_writes_a_draft(checkpoints, target, draft, tmp_path, home):
    """An up-to-date model gets only its draft; the same command again is a no-op; --force
    rebuilds both."""
    out = copy_artifact(target, tmp_path / "out")  # what the same compile would write
    config_mtime = (out / artifact.CONFIG_FILE).stat().st_mtime_ns
    args = ("compile", checkpoints("llama"), "-o", out, "--prefill-chunk", "64")
    args += ("--max-batch", "8", "--draft-quantization", Q)
    result = run_cli(*args, home=home)
    assert result.returncode == 0, result.stderr
    own = out / draft_dirname(Q)
    assert (out / artifact.CONFIG_FILE).stat().st_mtime_ns == config_mtime  # model kept
    assert params(own).keys() == params(draft).keys()
    assert all(np.array_equal(a, params(draft)[n]) for n, a in params(own).items())
    logits = chain_logits(own, TOKENS[:8])  # loads: hashes and metadata check out
    assert logits.shape == (8, 320)
    assert resolve_self_draft(out, Q) == own

    draft_mtime = (own / artifact.CONFIG_FILE).stat().st_mtime_ns
    again = run_cli(*args, home=home)
    assert again.returncode == 0 and "up to date" in again.stderr, again.stderr
    assert (own / artifact.CONFIG_FILE).stat().st_mtime_ns == draft_mtime

    forced = run_cli(*args, "--force", home=home)
    assert forced.returncode == 0, forced.stderr
    assert (out / artifact.CONFIG_FILE).stat().st_mtime_ns != config_mtime
    assert (own / artifact.CONFIG_FILE).stat().st_mtime_ns != draft_mtime
    assert artifact.read(own).draft_of == artifact.read(out).params_sha256
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert run_cli(*args, home=home).stderr.count("up to date") == 1


def test_build_draft_refuses_to_overwrite(draft, target, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(MlcrunError, match="pass --force"):
        build_draft(target, Q, other)
    assert build_draft(target, Q, draft) == draft  # up to date: kept
