"""`mlcrun compile` as a real process: good input compiles, bad input is one clear line."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

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


@pytest.fixture
def ckpt(tmp_path, checkpoints):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints("llama"), folder)
    return folder


def assert_clean_failure(result, out: Path, *needles: str):
    assert result.returncode != 0
    err = result.stderr.strip()
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    assert not leftovers, leftovers


def rewrite_weights(folder: Path, edit):
    path = folder / "model.safetensors"
    tensors = dict(load_file(path))
    edit(tensors)
    save_file(tensors, path)


def test_compile_then_noop_then_force(ckpt, tmp_path):
    out = tmp_path / "out"
    first = run_cli("compile", ckpt, "-o", out)
    assert first.returncode == 0, first.stderr
    config = json.loads((out / "mlcrun-config.json").read_text())
    assert config["model"]["arch"] == "LlamaForCausalLM"
    lib = out / config["library"]
    assert lib.exists() and (out / "tokenizer.json").exists()
    assert config["library_sha256"] == hashlib.sha256(lib.read_bytes()).hexdigest()
    mtime = lib.stat().st_mtime_ns
    again = run_cli("compile", ckpt, "-o", out)  # same inputs: nothing to do
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stderr
    assert lib.stat().st_mtime_ns == mtime
    with lib.open("ab") as f:  # a library altered since is no longer up to date
        f.write(b"\0")
    altered = run_cli("compile", ckpt, "-o", out)
    assert altered.returncode != 0 and "--force" in altered.stderr, altered.stderr
    forced = run_cli("compile", ckpt, "-o", out, "--force", "--context-window", "128")
    assert forced.returncode == 0, forced.stderr
    config = json.loads((out / "mlcrun-config.json").read_text())
    assert config["context_window"] == 128
    assert config["library_sha256"] == hashlib.sha256(lib.read_bytes()).hexdigest()


def test_missing_config(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    out = tmp_path / "out"
    assert_clean_failure(run_cli("compile", ckpt, "-o", out), out, "config.json")


def test_unsupported_architecture_lists_supported(ckpt, tmp_path):
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert_clean_failure(
        run_cli("compile", ckpt, "-o", out),
        out,
        "GPT2LMHeadModel",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    )


def test_missing_safetensors(ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    out = tmp_path / "out"
    assert_clean_failure(run_cli("compile", ckpt, "-o", out), out, "safetensors")


def test_truncated_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    out = tmp_path / "out"
    assert_clean_failure(run_cli("compile", ckpt, "-o", out), out, "truncated")


def test_tensor_with_wrong_shape(ckpt, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    rewrite_weights(ckpt, lambda t: t.__setitem__(name, np.zeros((64, 95), np.float32)))
    out = tmp_path / "out"
    assert_clean_failure(run_cli("compile", ckpt, "-o", out), out, name, "shape")


def test_weight_missing(ckpt, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    rewrite_weights(ckpt, lambda t: t.pop(name))
    out = tmp_path / "out"
    assert_clean_failure(run_cli("compile", ckpt, "-o", out), out, name, "missing")


def test_weight_left_unused(ckpt, tmp_path):
    name = "model.layers.0.self_attn.extra.weight"
    rewrite_weights(ckpt, lambda t: t.__setitem__(name, np.zeros((4,), np.float32)))
    out = tmp_path / "out"
    assert_clean_failure(run_cli("compile", ckpt, "-o", out), out, name, "not used")


def test_existing_output_needs_force(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    result = run_cli("compile", ckpt, "-o", out)
    assert result.returncode != 0 and "--force" in result.stderr
    assert "Traceback" not in result.stderr
    assert (out / "precious.txt").read_text() == "keep me"


def test_bad_option_values(ckpt, tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(run_cli("compile", ckpt, "-o", out, "-q", "q9f99"), out, "q9f99")
    assert_clean_failure(run_cli("compile", ckpt, "-o", out, "--device", "tpu"), out, "tpu")
    # TVM's CPU KV-cache kernels only work with 16-token pages (a 32 fails at the first append)
    assert_clean_failure(run_cli("compile", ckpt, "-o", out, "--page-size", "32"), out, "16")
    assert_clean_failure(
        run_cli("compile", ckpt, "-o", out, "--prefill-chunk", "8", "--max-batch", "16"),
        out,
        "--prefill-chunk 8 is under --max-batch 16",
    )
    assert_clean_failure(
        run_cli("compile", ckpt, "-o", out, "--context-window", "100000"),
        out,
        "max_position_embeddings",
    )


def test_hub_id_not_cached(tmp_path):
    out = tmp_path / "out"
    result = run_cli(
        "compile",
        "acme/not-there",
        "-o",
        out,
        env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"},
    )
    assert_clean_failure(result, out, "not in the local Hugging Face cache", "HF_HUB_OFFLINE")


def test_hub_id_from_local_cache(checkpoints, tmp_path):
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(checkpoints("qwen2-tied"), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    out = tmp_path / "out"
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}  # the cache, no network
    result = run_cli("compile", "acme/tiny", "-o", out, env=env)
    assert result.returncode == 0, result.stderr
    assert (
        json.loads((out / "mlcrun-config.json").read_text())["model"]["arch"] == "Qwen2ForCausalLM"
    )


def test_altered_params_detected_at_load(artifacts, tmp_path):
    folder = tmp_path / "art"
    shutil.copytree(artifacts("llama"), folder)
    params = next((folder / "params").glob("*.safetensors"))
    data = bytearray(params.read_bytes())
    data[-5] ^= 0xFF
    params.write_bytes(bytes(data))
    with pytest.raises(MlcrunError, match="modified after compile"):
        Model(folder)


def test_truncated_params_refused_and_loaded_params_equal_the_files(artifacts, tmp_path):
    from safetensors.numpy import load_file

    model = Model(artifacts("llama"))
    files = {}
    for path in (artifacts("llama") / "params").glob("*.safetensors"):
        files.update(load_file(str(path)))
    loaded = dict(zip([p.name for p in model.artifact.params], model._params))
    assert set(loaded) == set(files)
    for name, array in files.items():
        np.testing.assert_array_equal(loaded[name].numpy(), array)
    folder = tmp_path / "art"
    shutil.copytree(artifacts("llama"), folder)
    params = next((folder / "params").glob("*.safetensors"))
    params.write_bytes(params.read_bytes()[:-100])
    for verify in (True, False):
        with pytest.raises(MlcrunError, match="truncated params file"):
            Model(folder, verify=verify)


def test_cuda_compiles_without_a_gpu(ckpt, tmp_path):
    out = tmp_path / "out"
    result = run_cli("compile", ckpt, "-o", out, "--device", "cuda")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "mlcrun-config.json").read_text())
    assert config["device"] == "cuda" and json.loads(config["target"])["kind"] == "cuda"
    assert (out / config["library"]).stat().st_size > 0
    import tvm

    if not tvm.cuda(0).exist:
        with pytest.raises(MlcrunError, match="no CUDA GPU"):
            Model(out)


def test_params_are_aligned_views_of_one_arena(artifacts):
    """Every param starts on the 64 bytes compiled kernels assume, inside its file's arena
    (ffi.arena: one mapping that starts on a huge page), in file order."""
    model = Model(artifacts("llama"))
    (path,) = (artifacts("llama") / "params").glob("*.safetensors")
    order = list(load_file(str(path)))  # safetensors keeps the file's order
    by_name = dict(zip([p.name for p in model.artifact.params], model._params))
    pointers = [by_name[name].data_ptr() for name in order]
    assert all(ptr % 64 == 0 for ptr in pointers)
    assert pointers[0] % (2 << 20) == 0
    assert pointers == sorted(pointers)
