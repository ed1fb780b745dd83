"""Quantized presets end to end: compiled tiny models against two references.

1. Exactness: the compiled model equals transformers running the numpy-dequantized weights
   (quant/numpy_ref) within fp32 rounding, on the prefill/verify path (GEMM kernels) and the
   decode path (GEMV kernels). This is what the compiler is responsible for.
2. Agreement with q0f32 over 64 teacher-forced positions (one batch_verify over a chain):
   how much the quantization itself changes the model.
3. int8 activations (`--activations int8`, where the CPU has VNNI) against the exact
   (float32-activation) compile of the same preset: what quantizing the activations costs;
   likewise bf16 activations for q0bf16 (`--activations bf16`, where it has AVX512-BF16).

On agreement: Gaussian random weights are the worst case for a 4-bit min/max quantizer (every
weight matters equally, no outliers to absorb the range), and the error compounds with the
weights' scale through softmax and SiLU. With the session checkpoints' initializer_range 0.1
the numpy reference alone gives q4 a logits cosine of only 0.95-0.975 and top-1 agreement of
0.6-0.7 (larger inits are worse still: 0.2 -> ~0.9 cosine). The agreement test therefore uses
HF's default initializer_range 0.02 on a tied Qwen2-shaped model (attention bias and the tied
head included), where q4 reaches cosine ~0.992; there a tied model's top-1 largely follows the
input token's own embedding, so top-1 is a weak check and the cosine the meaningful one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from checkpoints import ARCHS, COMMON, load_reference, write_tokenizer

from mlcrun.compiler.build import compile_model
from mlcrun.compiler.options import CompileOptions
from mlcrun.compiler.target import bf16_dot_bits, cpu_target, int8_dot
from mlcrun.quant import get_preset
from mlcrun.quant.transform import dequantize_params, weight_transform
from mlcrun.runtime import Model

QUANTIZED = ("q0f16", "q0bf16", "q8f32", "q8f16", "q4f32_1", "q4f16_1", "q4f16_0")
POSITIONS = 64
PREFIX = 8  # decode path: prefill PREFIX tokens, then one token per batch_decode
TOKENS = np.random.default_rng(0).integers(3, 320, POSITIONS).tolist()


@pytest.fixture(scope="module")
def low_init_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quant") / "qwen2-tied-init0.02"
    config_cls, model_cls, extra = ARCHS["qwen2-tied"]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, "initializer_range": 0.02})
    torch.manual_seed(0)
    getattr(transformers, model_cls)(config).eval().save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(checkpoint folder, preset[, activations]) -> artifact, compiled once per module. The
    exactness tests need float32 activations ("exact"); "int8" is compared with them."""
    root = tmp_path_factory.mktemp("quant-artifacts")
    cache = {}

    def get(folder, preset: str, activations: str = "exact"):
        key = (str(folder), preset, activations)
        if key not in cache:
            out = root / f"{folder.name}-{preset}-{activations}"
            options = CompileOptions(
                quantization=preset, prefill_chunk=64, max_batch=4, activations=activations
            )
            cache[key] = compile_model(str(folder), out, options)
        return cache[key]

    return get


def teacher_forced(folder) -> np.ndarray:
    """Logits at every position of TOKENS from one batch_verify over a chain [64, vocab]."""
    model = Model(folder)
    model.add_new_sequence(0)
    parents = list(range(-1, POSITIONS - 1))
    return model.batch_verify(model.token_embed(TOKENS), [0], [POSITIONS], parents)


def decoded(folder) -> np.ndarray:
    """Logits at positions PREFIX-1 .. 63: a prefill, then batch_decode one token at a time."""
    model = Model(folder)
    model.add_new_sequence(0)
    rows = [model.batch_prefill(model.token_embed(TOKENS[:PREFIX]), [0], [PREFIX])[0]]
    for token in TOKENS[PREFIX:]:
        rows.append(model.batch_decode(model.token_embed([token]), [0])[0])
    return np.stack(rows)


def dequantized_reference(folder, preset: str) -> np.ndarray:
    """transformers (eager, fp32) with every 2-D weight replaced by its dequantized value."""
    p = get_preset(preset)
    ref = load_reference(folder)
    with torch.no_grad():
        for name, tensor in ref.state_dict().items():
            if tensor.ndim == 2:
                deq = dequantize_params(p, weight_transform(p, name, tensor.numpy()))
                tensor.copy_(torch.from_numpy(deq))
        return ref(torch.tensor([TOKENS])).logits[0].float().numpy()


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    num = np.sum(a * b, axis=-1)
    return float(np.mean(num / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)))


@pytest.mark.parametrize(
    ("checkpoint", "preset"),
    [
        *(("low-init-tied", p) for p in QUANTIZED),
        ("llama", "q4f32_1"),
        ("llama", "q8f32"),
        ("llama", "q0bf16"),
    ],
)
def test_matches_dequantized_reference(checkpoint, preset, checkpoints, low_init_checkpoint,
                                       compiled):  # fmt: skip
    folder = low_init_checkpoint if checkpoint == "low-init-tied" else checkpoints(checkpoint)
    want = dequantized_reference(folder, preset)  # torch first: its pool and TVM's fight
    artifact = compiled(folder, preset)
    np.testing.assert_allclose(teacher_forced(artifact), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(decoded(artifact), want[PREFIX - 1 :], atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", QUANTIZED)
def test_agreement_with_fp32(preset, low_init_checkpoint, compiled):
    base = teacher_forced(compiled(low_init_checkpoint, "q0f32"))
    got = teacher_forced(compiled(low_init_checkpoint, preset))
    top1 = float(np.mean(got.argmax(-1) == base.argmax(-1)))
    cosine = _cosine(got, base)
    print(preset, "top-1", top1, "cosine", cosine, "max |diff|", np.abs(got - base).max())
    if preset in ("q0f16", "q0bf16"):
        # What 16-bit weights cost on these logits (std 0.17, range 1.9), measured: fp16 max
        # |diff| 2.2e-4, mean 4.4e-5; bf16 (3 fewer mantissa bits) 2.2e-3, 3.5e-4. The
        # bounds leave ~4x room for other CPUs' rounding.
        limit = {"q0f16": (1e-3, 2e-4), "q0bf16": (1e-2, 1.5e-3)}[preset]
        diff = np.abs(got - base)
        assert diff.max() <= limit[0] and diff.mean() <= limit[1], (diff.max(), diff.mean())
    elif preset in ("q8f32", "q8f16"):
        assert top1 >= 0.99 and cosine >= 0.999, (top1, cosine)
    else:  # measured: top-1 1.0; cosine q4f16_1 0.9926, q4f16_0 0.9914 (one scale, no min)
        assert top1 >= 0.90 and cosine >= 0.99, (top1, cosine)


@pytest.mark.skipif(not int8_dot(cpu_target()), reason="no AVX2 or VNNI")
@pytest.mark.parametrize("preset", ["q8f32", "q8f16", "q4f16_1", "q4f32_1", "q4f16_0"])
def test_int8_activations_stay_close_to_exact(preset, low_init_checkpoint, compiled):
    """Measured here (64 positions, logits up to 1.4): max |int8 - exact| 0.0049-0.0053,
    mean KL(exact || int8) 5-6e-7, cosine 0.99998, the same top-1 everywhere; on the
    session's init-0.1 llama (logits up to 3.8) 0.06-0.07, KL 0.7-1.1e-4, top-1 0.97-1.0."""
    exact = compiled(low_init_checkpoint, preset)
    int8 = compiled(low_init_checkpoint, preset, "int8")
    for run in (teacher_forced, decoded):
        want, got = run(exact), run(int8)
        print(preset, run.__name__, "max |int8 - exact|", np.abs(got - want).max())
        np.testing.assert_allclose(got, want, atol=0.02, rtol=0)
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
        assert _cosine(got, want) >= 0.9999


@pytest.mark.skipif(not bf16_dot_bits(cpu_target()), reason="no AVX512-BF16")
@pytest.mark.parametrize("checkpoint", ["low-init-tied", "llama"])
def test_bf16_activations_stay_close_to_exact(checkpoint, checkpoints, low_init_checkpoint,
                                              compiled):  # fmt: skip
    """q0bf16 with activations rounded to bf16 (vdpbf16ps) against its exact compile."""
    folder = low_init_checkpoint if checkpoint == "low-init-tied" else checkpoints(checkpoint)
    exact = compiled(folder, "q0bf16")
    fast = compiled(folder, "q0bf16", "bf16")
    from mlcrun import artifact

    assert artifact.read(fast).activations == "bf16"
    for run in (teacher_forced, decoded):
        want, got = run(exact), run(fast)
        print(checkpoint, run.__name__, "max |bf16 - exact|", np.abs(got - want).max())
        np.testing.assert_allclose(got, want, atol=0.05, rtol=0)
        assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.95
        assert _cosine(got, want) >= 0.999


def test_artifact_records_quantized_params(low_init_checkpoint, compiled):
    from mlcrun import artifact

    art = artifact.read(compiled(low_init_checkpoint, "q4f16_1"))
    assert art.quantization == "q4f16_1" and art.activations == "exact"
    dtypes = {p.name: p.dtype for p in art.params}
    assert dtypes["model.embed_tokens.q_weight"] == "uint32"
    assert dtypes["model.embed_tokens.q_scale"] == "float16"
    assert dtypes["model.layers.0.self_attn.qkv_proj.bias"] == "float32"
    assert dtypes["model.norm.weight"] == "float32"
    assert not any(name.endswith("proj.weight") for name in dtypes)
