"""int8 activations, numpy side (no TVM): the int8 kernels' weight layout, the activation
quantizer and the int8 math's reference (quant/numpy_ref.py), the transform and GGUF paths
into that layout (quant/transform.py), and the compile option.

The layout and the quantizer are checked against per-element loops written here, so a bug in
their vectorized numpy would not hide behind a round trip that only checks itself.
"""

import numpy as np
import pytest

from mlcrun.compiler.options import CompileOptions
from mlcrun.errors import MlcrunError
from mlcrun.quant import get_preset, numpy_ref, uses_int8
from mlcrun.quant.transform import (
    dequantize_params,
    quant_param_specs,
    quant_suffixes,
    to_layout,
    weight_transform,
)

RNG = np.random.default_rng(0)
ODD = [(37, 96), (16, 32), (5, 64), (48, 288)]  # N not a multiple of 16, K % 256 != 0


# ----------------------------------------------------------------- layout
@pytest.mark.parametrize(("n", "c"), [(37, 12), (16, 4), (5, 8), (33, 40)])
@pytest.mark.parametrize("unit", [1, 4])
def test_tile_rows_matches_a_loop_and_round_trips(n, c, unit):
    a = RNG.integers(0, 250, (n, c)).astype(np.uint8)
    tiled = numpy_ref.tile_rows(a, unit)
    flat = tiled.reshape(-1)
    for row in range(n):  # panel p of h rows stores [c / unit, h, unit]
        p, lane = divmod(row, 16)
        h = min(16, n - 16 * p)
        for col in range(c):
            at = 16 * p * c + (col // unit) * h * unit + lane * unit + col % unit
            assert flat[at] == a[row, col]
    np.testing.assert_array_equal(numpy_ref.untile_rows(tiled, unit), a)


def test_q8_layout_is_offset_binary_codes():
    codes = RNG.integers(-127, 128, (20, 64)).astype(np.int8)
    scale = RNG.random((20, 2)).astype(np.float32)
    tiled, scale_t = numpy_ref.q8_to_int8_layout(codes, scale)
    assert tiled.dtype == np.uint8 and scale_t.shape == (20, 2)
    # first panel, first 4-byte lane: codes [0, 0:4] + 128
    np.testing.assert_array_equal(tiled.reshape(-1)[:4], codes[0, :4].astype(np.int32) + 128)
    # scales in panels: the first panel's 16 scales of group 0, then of group 1, then the
    # short last panel (4 rows) group by group
    flat = scale_t.reshape(-1)
    np.testing.assert_array_equal(flat[:16], scale[:16, 0])
    np.testing.assert_array_equal(flat[16:32], scale[:16, 1])
    np.testing.assert_array_equal(flat[32:36], scale[16:, 0])
    back, scale_back = numpy_ref.q8_from_int8_layout(tiled, scale_t)
    np.testing.assert_array_equal(back, codes)
    np.testing.assert_array_equal(scale_back, scale)


@pytest.mark.parametrize("preset", ["q4f16_1", "q4f32_1", "q4f16_0", "q8f32", "q8f16"])
@pytest.mark.parametrize(("n", "k"), ODD)
def test_int8_transform_matches_specs_and_dequantizes_like_row_major(preset, n, k):
    p = get_preset(preset)
    w = RNG.standard_normal((n, k)).astype(np.float32)
    rows = weight_transform(p, "x.weight", w)
    int8 = weight_transform(p, "x.weight", w, "int8")
    specs = quant_param_specs(p, n, k, "int8")
    assert {name: (a.shape, str(a.dtype)) for name, a in int8.items()} == {
        f"x.{suffix}": spec for suffix, spec in specs.items()
    }
    np.testing.assert_array_equal(
        dequantize_params(p, int8, "int8"), dequantize_params(p, rows, "exact")
    )


def test_only_q4_and_q8_use_the_int8_layout():
    assert uses_int8(get_preset("q4f16_1+q8f32"), "int8")
    assert not uses_int8(get_preset("q4f16_1"), "exact")
    for preset in ("q0f32", "q0f16"):
        p = get_preset(preset)
        assert not uses_int8(p, "int8")
        w = RNG.standard_normal((8, 64)).astype(np.float32)
        assert weight_transform(p, "x.weight", w, "int8").keys() == {"x.weight"}
    with pytest.raises(MlcrunError, match="activations"):
        uses_int8(get_preset("q8f32"), "fp8")


@pytest.mark.parametrize(
    ("qtype", "preset"),
    [
        ("Q4_0", "q4f16_1"),
        ("Q4_0", "q4f16_0"),
        ("Q4_1", "q4f32_1"),
        ("Q8_0", "q8f32"),
        ("Q8_0", "q8f16"),
    ],
)
def test_gguf_blocks_reach_the_int8_layout_bit_exactly(qtype, preset):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from mlcrun.quant.gguf_blocks import exact_params

    w = RNG.normal(0, 0.05, (37, 96)).astype(np.float32)
    data = quantize(w, GGMLQuantizationType[qtype])
    p = get_preset(preset)
    rows = {f"x.{k}": v for k, v in exact_params(p, qtype, data).items()}
    got = dequantize_params(p, to_layout(p, rows, "int8"), "int8")
    np.testing.assert_array_equal(got, dequantize(data, GGMLQuantizationType[qtype]))


# ----------------------------------------------------------------- activations
def test_activation_quantizer_matches_a_loop():
    x = RNG.standard_normal((3, 96)).astype(np.float32) * 3
    x[1, 32:64] = 0.0  # a zero group
    x[2, :32] = 1e-38  # below the amax floor: zeros, not inf codes
    x[0, 5] = 127.5 / 127 * np.abs(x[0, :32]).max()  # a new amax
    codes, scale, sums = numpy_ref.quantize_activations(x)
    for m in range(3):
        for g in range(3):
            block = x[m, 32 * g : 32 * g + 32]
            amax = np.float32(np.abs(block).max())
            inv = np.float32(127) / amax if amax >= np.float32(1e-30) else np.float32(0)
            want = [int(np.clip(np.rint(np.float32(v) * inv), -127, 127)) for v in block]
            assert codes[m, 32 * g : 32 * g + 32].tolist() == want
            assert scale[m, g] == np.float32(amax / np.float32(127))
            assert sums[m, g] == sum(want)
    assert not codes[1, 32:64].any() and not codes[2, :32].any()
    assert np.abs(codes).max() == 127


def test_q4_activation_order_puts_each_words_even_elements_first():
    codes = np.arange(16, dtype=np.int8).reshape(1, 16)
    assert numpy_ref.q4_activation_order(codes).tolist() == [
        [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    ]


@pytest.mark.parametrize("preset", ["q4f16_1", "q4f16_0", "q8f32", "q8f16"])
def test_int8_linear_is_close_to_the_float_matmul(preset):
    p = get_preset(preset)
    w = RNG.standard_normal((37, 288)).astype(np.float32)
    x = RNG.standard_normal((5, 288)).astype(np.float32)
    rows = weight_transform(p, "x.weight", w)
    y = numpy_ref.int8_linear(x, p.kind, tuple(rows[f"x.{s}"] for s in quant_suffixes(p)))
    exact = x @ dequantize_params(p, rows).T
    # 8-bit activations: ~0.4% relative error per element of x, averaged over K
    assert np.abs(y - exact).max() < 0.02 * np.abs(exact).max()


# ----------------------------------------------------------------- the option
def test_activations_option_is_validated():
    assert CompileOptions().activations == "auto"
    assert CompileOptions(activations="exact").activations == "exact"
    with pytest.raises(MlcrunError, match="--activations 'fp8'.*auto, int8, bf16, exact"):
        CompileOptions(activations="fp8")
    with pytest.raises(MlcrunError, match="--activations int8 is for --device cpu"):
        CompileOptions(activations="int8", device="cuda")


class _Target:
    """Stands for a tvm Target in resolve_activations (kind name and mattr only)."""

    def __init__(self, kind: str, *mattr: str) -> None:
        self.kind = type("Kind", (), {"name": kind})()
        self.attrs = {"mattr": list(mattr)}


@pytest.mark.parametrize(
    ("requested", "quantization", "target", "want"),
    [
        ("auto", "q4f16_1", _Target("llvm", "+avx512f", "+avx512vnni"), "int8"),
        ("auto", "q4f16_1+q8f32", _Target("llvm", "+avx2", "+avxvnni"), "int8"),
        ("auto", "q8f32", _Target("llvm", "+avx2", "+fma"), "int8"),  # vpmaddubsw
        ("auto", "q4f16_1", _Target("llvm", "+sse4.2", "-avx2"), "exact"),
        ("auto", "q4f16_1", _Target("cuda"), "exact"),
        ("exact", "q4f16_1", _Target("llvm", "+avx512vnni"), "exact"),
        ("int8", "q8f32", _Target("llvm", "+avx512vnni"), "int8"),
        ("auto", "q0f32", _Target("llvm", "+avx512vnni"), "exact"),  # nothing to quantize
        ("int8", "q0f16", _Target("llvm", "+avx512vnni"), "exact"),
        ("auto", "q0f16+q8f32", _Target("llvm", "+avx512vnni"), "int8"),  # the q8 table/head
        ("auto", "q0bf16", _Target("llvm", "+avx512f", "+avx512bf16"), "bf16"),
        ("auto", "q0bf16", _Target("llvm", "+avx512f", "+avx512vnni"), "exact"),
        ("auto", "q0bf16", _Target("cuda"), "exact"),
        ("bf16", "q0bf16", _Target("llvm", "+avx512f", "+avx512bf16"), "bf16"),
        ("exact", "q0bf16", _Target("llvm", "+avx512f", "+avx512bf16"), "exact"),
        ("int8", "q0bf16", _Target("llvm", "+avx512f", "+avx512bf16"), "exact"),
        ("bf16", "q4f16_1", _Target("llvm", "+avx512f", "+avx512bf16"), "exact"),
        # int8 wins a mixed preset where both apply (one mode per artifact)
        (
            "auto",
            "q4f16_1+q0bf16",
            _Target("llvm", "+avx512f", "+avx512vnni", "+avx512bf16"),
            "int8",
        ),
        ("auto", "q0bf16+q8f32", _Target("llvm", "+avx512f", "+avx512bf16"), "bf16"),
    ],
)
def test_activations_resolve_per_target_and_preset(requested, quantization, target, want):
    from mlcrun.compiler.options import resolve_activations

    assert resolve_activations(requested, target, quantization) == want


def test_bf16_activations_are_refused_without_avx512_bf16():
    from mlcrun.compiler.options import resolve_activations

    with pytest.raises(MlcrunError, match="AVX512-BF16"):
        resolve_activations("bf16", _Target("llvm", "+avx512f", "+avx512vnni"), "q0bf16")
    with pytest.raises(MlcrunError, match="--device cpu"):
        CompileOptions(activations="bf16", device="cuda")


def test_int8_activations_are_refused_without_avx2():
    from mlcrun.compiler.options import resolve_activations

    with pytest.raises(MlcrunError, match="needs a CPU with AVX2"):
        resolve_activations("int8", _Target("llvm", "+sse4.2", "-avx2"), "q4f16_1")


@pytest.mark.parametrize(
    ("mattr", "bits", "dot"),
    [
        (("+avx2", "+fma", "+avx512f", "+avx512vnni"), 512, "avx512vnni"),
        (("+avx2", "+fma", "-avx512f", "+avxvnni"), 256, "avxvnni"),
        (("+avx", "+avx2", "+fma", "-avx512f", "-avx512vnni", "-avxvnni"), 256, "avx2"),
        (("+sse4.2", "-avx", "-avx2", "-avx512f"), 128, ""),
    ],
)
def test_vector_width_and_int8_dot_follow_the_target_features(mattr, bits, dot):
    """From the target's own features (TVM's llvm_get_vector_width says 512 for an AVX2-only
    target too, which gave its float tiles twice the registers it has)."""
    from mlcrun.compiler.target import int8_dot, vector_bits

    target = _Target("llvm", *mattr)
    assert (vector_bits(target), int8_dot(target)) == (bits, dot)
    assert int8_dot(_Target("cuda")) == ""
