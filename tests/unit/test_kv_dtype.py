"""`mlcrun compile --kv-dtype`: the option, and what the artifact records about it."""

from __future__ import annotations

import json

import pytest

from mlcrun import artifact
from mlcrun.compiler.options import CompileOptions
from mlcrun.errors import MlcrunError


def _artifact(**changes) -> artifact.Artifact:
    base = dict(
        model={"arch": "LlamaForCausalLM"},
        quantization="q0f32",
        device="cpu",
        target="llvm",
        library="lib/cpu.so",
        context_window=64,
        prefill_chunk=64,
        max_batch=4,
        page_size=16,
        param_files=("params-00000.safetensors",),
        params=(artifact.TensorInfo("w", (2, 2), "float32"),),
        params_sha256="0" * 64,
        library_sha256="1" * 64,
        abi_version=1,
        mlcrun_version="0",
        source_fingerprint="x",
    )
    return artifact.Artifact(**{**base, **changes})


def test_option_values():
    assert CompileOptions().kv_dtype == "float32"
    assert CompileOptions(kv_dtype="float16").kv_dtype == "float16"
    with pytest.raises(MlcrunError, match="--kv-dtype 'bfloat16'.*float32, float16"):
        CompileOptions(kv_dtype="bfloat16")


def test_options_change_the_fingerprinted_text():
    # build._fingerprint hashes str(options): a float16 compile is not a no-op of a float32 one
    assert str(CompileOptions()) != str(CompileOptions(kv_dtype="float16"))


def test_recorded_and_named_in_the_library_metadata_only_when_not_float32():
    plain = _artifact()
    assert plain.kv_dtype == "float32"
    assert "kv_dtype" not in plain.library_metadata()  # older libraries keep matching
    half = _artifact(kv_dtype="float16")
    assert half.library_metadata()["kv_dtype"] == "float16"
    assert artifact.Artifact.from_json(half.to_json()).kv_dtype == "float16"


def test_older_configs_read_as_float32():
    data = json.loads(_artifact().to_json())
    del data["kv_dtype"]
    assert artifact.Artifact.from_json(json.dumps(data)).kv_dtype == "float32"
