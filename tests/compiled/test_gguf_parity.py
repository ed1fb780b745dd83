"""GGUF files compiled by mlcrun match transformers run on the same (dequantized) weights."""

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from checkpoints import build_checkpoint, load_reference, reference_logits
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import expected, is_table, write_gguf

from mlcrun import artifact
from mlcrun.compiler.build import compile_model
from mlcrun.compiler.draft import ArtifactTensors
from mlcrun.compiler.options import CompileOptions
from mlcrun.compiler.target import cpu_target, int8_dot
from mlcrun.quant.gguf_blocks import EXACT_PRESET
from mlcrun.runtime import Model

AUTO_Q4 = EXACT_PRESET["Q4_1"]
AUTO_Q4_0 = EXACT_PRESET["Q4_0"]  # the symmetric q4f16_0
# (checkpoint, GGUF type, type of the embedding/lm_head, --quantization, the preset recorded)
CASES = [("llama", q, None, "q0f32", "q0f32") for q in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1)]
CASES += [  # auto keeps the stored blocks bit for bit: the same 1e-4 parity as float storage
    ("llama", Q.Q8_0, None, "auto", "q8f16"),
    ("llama", Q.Q4_0, None, "auto", AUTO_Q4_0),
    ("llama", Q.Q4_0, None, "q4f16_1", "q4f16_1"),  # min = -8 d: exact too
    ("llama", Q.Q4_1, None, "auto", AUTO_Q4),
    ("llama", Q.F16, None, "auto", "q0f16"),
    ("llama", Q.BF16, None, "auto", "q0bf16"),
    ("qwen2-tied", Q.Q4_1, Q.Q8_0, "auto", f"{AUTO_Q4}+q8f16"),  # like SmolLM2's GGUF
    ("qwen2-tied", Q.Q4_0, Q.Q8_0, "auto", f"{AUTO_Q4_0}+q8f16"),  # like llama.cpp's Q4_0
    ("llama", Q.Q4_0, Q.F32, "auto", f"{AUTO_Q4_0}+q0f32"),
]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLCRUN_HOME", str(tmp_path / "home"))


def _logits_against_transformers(folder, gguf_path, type_of, art_dir, quantization):
    """(mlcrun's last-position logits, transformers' on the GGUF's dequantized weights, the
    compiled artifact) for two prompts prefilled in one batch."""
    ref = load_reference(folder)
    with torch.no_grad():
        for param_name, p in ref.named_parameters():
            p.copy_(torch.from_numpy(expected(p.numpy(), type_of(param_name))))
    prompts = [[1, 40, 41, 200, 7, 9, 100], [1, 250, 3, 5]]
    want = [reference_logits(ref, p)[-1].numpy() for p in prompts]
    options = CompileOptions(quantization=quantization, activations="exact")
    art = compile_model(str(gguf_path), art_dir, options)
    model = Model(art)
    for seq in (0, 1):
        model.add_new_sequence(seq)
    logits = model.batch_prefill(
        model.token_embed(prompts[0] + prompts[1]), [0, 1], [len(p) for p in prompts]
    )
    return logits, np.stack(want), model.artifact


@pytest.mark.parametrize(
    ("name", "qtype", "table_qtype", "quantization", "preset"),
    CASES,
    ids=lambda c: getattr(c, "name", str(c)),
)
def test_compiled_gguf_matches_transformers_on_dequantized_weights(
    checkpoints, tmp_path, name, qtype, table_qtype, quantization, preset
):
    folder = checkpoints(name)
    gguf_path = write_gguf(folder, tmp_path / "model.gguf", qtype, table_qtype=table_qtype)

    def type_of(param_name):
        return table_qtype if table_qtype is not None and is_table(param_name) else qtype

    logits, want, art = _logits_against_transformers(  # exact activations: 1e-4 parity
        folder, gguf_path, type_of, tmp_path / "art", quantization
    )
    assert art.quantization == preset
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A tiny llama whose every row is a multiple of 256 long (K-quant blocks)."""
    folder = tmp_path_factory.mktemp("wide") / "llama"
    return build_checkpoint("llama", folder, hidden_size=256, intermediate_size=512)


def _q4_k_m(hf_name: str) -> Q:
    """llama.cpp's Q4_K_M mix on two layers: Q4_K, with Q6_K for v_proj and down_proj of
    layer 0 (use_more_bits), Q6_K for the lm_head, Q8_0 for the embedding table; plus a Q5_K
    and a Q5_1 tensor (Q5_K_M's and the fallback's types) to cover every block reader."""
    if hf_name == "lm_head.weight":
        return Q.Q6_K
    if "embed_tokens" in hf_name:
        return Q.Q8_0
    if ".0." in hf_name and hf_name.endswith(("v_proj.weight", "down_proj.weight")):
        return Q.Q6_K
    if ".1.mlp.up_proj" in hf_name:
        return Q.Q5_K
    if ".1.self_attn.k_proj" in hf_name:
        return Q.Q5_1
    return Q.Q4_K


@pytest.mark.parametrize(
    ("layers", "quantization", "preset"),
    [
        (Q.Q4_K, "auto", "q4f32_1+q8f16"),  # Q4_K blocks exactly as q4f32_1
        (Q.Q5_0, "auto", "q8f16"),  # Q5_0 blocks exactly as q8f16
        ("Q4_K_M", "q0f32", "q0f32"),  # every K-quant read exactly into float32
    ],
    ids=str,
)
def test_k_quant_gguf_matches_transformers_on_dequantized_weights(
    wide_llama, tmp_path, layers, quantization, preset
):
    type_of = _q4_k_m if layers == "Q4_K_M" else (lambda n: Q.Q8_0 if is_table(n) else layers)
    path = write_gguf(wide_llama, tmp_path / "k.gguf", Q.Q4_K, qtype_of=type_of)
    logits, want, art = _logits_against_transformers(
        wide_llama, path, type_of, tmp_path / "art", quantization
    )
    assert art.quantization == preset
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)


def test_k_quant_mix_under_auto_is_q8_and_close(wide_llama, tmp_path):
    """No preset holds Q6_K/Q5_K/Q5_1 blocks exactly, and a 4-bit one would narrow them:
    `auto` stores such a file's layers in q8f16 (Q4_K and the others re-rounded to 8 bits, at
    most half a step of about max|w| / 127 per group of 32), as close to the file as q8 is to a
    float checkpoint (test_quant_parity's bounds). Measured on this init-0.1 checkpoint: max
    |d| 0.11 on logits up to 5.9, cosine 0.9995 and 0.9998, the same top-1."""
    path = write_gguf(wide_llama, tmp_path / "k.gguf", Q.Q4_K, qtype_of=_q4_k_m)
    logits, want, art = _logits_against_transformers(
        wide_llama, path, _q4_k_m, tmp_path / "art", "auto"
    )
    assert art.quantization == "q8f16"
    norms = np.linalg.norm(logits, axis=-1) * np.linalg.norm(want, axis=-1)
    cosine = np.sum(logits * want, axis=-1) / norms
    print("max |auto - dequantized|", np.abs(logits - want).max(), np.abs(want).max(), cosine)
    assert np.array_equal(logits.argmax(-1), want.argmax(-1))
    assert cosine.min() >= 0.999


def test_truncated_gguf_is_one_line_and_leaves_nothing(checkpoints, tmp_path):
    path = write_gguf(checkpoints("llama"), tmp_path / "model.gguf", Q.Q8_0)
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "mlcrun", "compile", str(bad), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "MLCRUN_HOME": str(tmp_path / "h"), "HOME": str(tmp_path)},
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "bad.gguf" in result.stderr
    assert not out.exists()
    shutil.rmtree(tmp_path / "h", ignore_errors=True)


@pytest.mark.skipif(not int8_dot(cpu_target()), reason="no AVX2 or VNNI")
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0], ids=lambda q: q.name)
def test_int8_compile_keeps_the_gguf_blocks_in_its_layout(checkpoints, tmp_path, qtype):
    """A SmolLM2-like GGUF (Q4_1 layers, Q8_0 table; or Q4_0 layers, as llama.cpp's Q4_0
    files) compiled for int8 activations: its params are the exact compile's values reordered
    for the int8 kernels (bit for bit once read back, q/k/v and gate/up stacked before they
    are tiled) and its logits stay close to exact's (measured: max |d| 0.027 (Q4_1), 0.023
    (Q4_0) for logits up to 2.5 on these init-0.1 weights)."""
    gguf = write_gguf(checkpoints("qwen2-tied"), tmp_path / "m.gguf", qtype, table_qtype=Q.Q8_0)
    arts = {
        a: compile_model(str(gguf), tmp_path / a, CompileOptions(activations=a))
        for a in ("exact", "int8")
    }
    read = {a: ArtifactTensors(folder, artifact.read(folder)) for a, folder in arts.items()}
    assert artifact.read(arts["int8"]).activations == "int8"
    assert read["int8"].names() == read["exact"].names()
    for name in read["exact"].names():
        np.testing.assert_array_equal(read["int8"].get(name), read["exact"].get(name), name)
    prompt = [1, 40, 41, 200, 7, 9, 100]
    logits = {}
    for a, folder in arts.items():
        model = Model(folder)
        model.add_new_sequence(0)
        logits[a] = model.batch_prefill(model.token_embed(prompt), [0], [len(prompt)])[0]
    print(
        "max |int8 - exact|",
        np.abs(logits["int8"] - logits["exact"]).max(),
        np.abs(logits["exact"]).max(),
    )
    np.testing.assert_allclose(logits["int8"], logits["exact"], atol=0.05, rtol=0)
