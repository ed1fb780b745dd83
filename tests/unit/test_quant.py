"""Quantization presets, the numpy reference quantizers and the weight transform (no TVM).

The reference is checked against straightforward per-element loops written here, so a bug in
its vectorized numpy would not hide behind a round trip that only checks itself.
"""

import numpy as np
import pytest

from mlcrun.errors import MlcrunError
from mlcrun.quant import PRESETS, get_preset, numpy_ref
from mlcrun.quant.transform import (
    dequantize_params,
    float_param_name,
    quant_param_specs,
    weight_transform,
)

RNG = np.random.default_rng(0)


# ----------------------------------------------------------------- presets
def test_presets_table():
    bits = {name: p.bits_per_weight for name, p in PRESETS.items()}
    assert bits == {
        "q0f32": 32,
        "q0f16": 16,
        "q0bf16": 16,
        "q4f32_1": 6,
        "q4f16_1": 5,
        "q4f16_0": 4.5,
        "q8f32": 9,
        "q8f16": 8.5,
    }
    assert not PRESETS["q0f32"].quantizes_embedding
    for name in ("q0f16", "q0bf16", "q4f32_1", "q4f16_1", "q4f16_0", "q8f32", "q8f16"):
        assert PRESETS[name].quantizes_embedding


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(MlcrunError, match="q4f16_1.*q8f32|q8f32.*q4f16_1") as err:
        get_preset("q3f16_0")
    assert "q3f16_0" in str(err.value)


# ----------------------------------------------------------------- int4 packing
def test_pack_layout_is_eight_codes_per_word_low_nibble_first():
    codes = np.arange(16, dtype=np.uint8).reshape(1, 16)
    packed = numpy_ref.pack_int4(codes)
    assert packed.dtype == np.uint32 and packed.shape == (1, 2)
    assert packed[0, 0] == 0x76543210 and packed[0, 1] == 0xFEDCBA98


@pytest.mark.parametrize("shape", [(7, 96), (1, 8), (3, 5, 40)])
def test_pack_unpack_round_trip(shape):
    codes = RNG.integers(0, 16, size=shape).astype(np.uint8)
    packed = numpy_ref.pack_int4(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 8)
    np.testing.assert_array_equal(numpy_ref.unpack_int4(packed), codes)


def test_pack_rejects_bad_input():
    with pytest.raises(MlcrunError, match="multiple of 8"):
        numpy_ref.pack_int4(np.zeros((2, 12), np.uint8))
    with pytest.raises(MlcrunError, match="0..15"):
        numpy_ref.pack_int4(np.full((1, 8), 16))


# ----------------------------------------------------------------- q4 / q8 against loops
def _q4_by_loops(w, scale_dtype):
    n, k = w.shape
    codes = np.zeros((n, k), np.int64)
    scales, mins = np.zeros((n, k // 32), scale_dtype), np.zeros((n, k // 32), scale_dtype)
    for i in range(n):
        for g in range(k // 32):
            block = w[i, 32 * g : 32 * g + 32].astype(np.float32)
            lo, hi = block.min(), block.max()
            scales[i, g], mins[i, g] = (hi - lo) / 15, lo
            s, m = np.float32(scales[i, g]), np.float32(mins[i, g])
            for j in range(32):
                q = 0 if s == 0 else np.rint((block[j] - m) / s)
                codes[i, 32 * g + j] = min(max(q, 0), 15)
    return codes, scales, mins


@pytest.mark.parametrize("scale_dtype", ["float32", "float16"])
@pytest.mark.parametrize(("n", "k"), [(7, 96), (1, 32), (5, 64)])
def test_q4_matches_loops(n, k, scale_dtype):
    w = RNG.standard_normal((n, k)).astype(np.float32)
    packed, scale, mins = numpy_ref.quantize_q4(w, "w", scale_dtype)
    assert packed.shape == (n, k // 8) and scale.shape == mins.shape == (n, k // 32)
    assert scale.dtype == mins.dtype == np.dtype(scale_dtype)
    codes, want_scale, want_min = _q4_by_loops(w, scale_dtype)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(mins, want_min)
    # rint of exact .5 ties may differ by one code between vector and scalar division
    assert np.abs(numpy_ref.unpack_int4(packed).astype(np.int64) - codes).max() <= 1
    deq = numpy_ref.dequantize_q4(packed, scale, mins)
    s = np.repeat(scale.astype(np.float32), 32, axis=1)
    m = np.repeat(mins.astype(np.float32), 32, axis=1)
    np.testing.assert_allclose(deq, numpy_ref.unpack_int4(packed) * s + m, rtol=1e-6, atol=1e-6)
    # error bound: half a step, plus the fp16 rounding of min
    slack = 0.0 if scale_dtype == "float32" else 2e-3 * np.abs(w).max()
    assert np.all(np.abs(deq - w) <= s / 2 + 1e-6 + slack)


def test_q4_flat_group_is_exact():
    w = np.full((2, 32), 0.25, np.float32)
    packed, scale, mins = numpy_ref.quantize_q4(w)
    assert np.all(scale == 0)
    np.testing.assert_array_equal(numpy_ref.dequantize_q4(packed, scale, mins), w)


def test_q4_represents_symmetric_and_gguf_formats_exactly():
    """MLC's symmetric q4 ((q - 7) * s) and GGUF Q4_0 ((q - 8) * d) blocks that use the full
    code range round-trip through the asymmetric form without loss."""
    d = np.float32(0.125)
    for offset in (7, 8):
        codes = RNG.integers(0, 16, size=(3, 64))
        codes[:, ::32] = 0  # each group spans the full range 0..15
        codes[:, 1::32] = 15
        w = ((codes - offset) * d).astype(np.float32)
        packed, scale, mins = numpy_ref.quantize_q4(w)
        np.testing.assert_array_equal(numpy_ref.dequantize_q4(packed, scale, mins), w)


def _q4_0_by_loops(w):
    """llama.cpp's quantize_row_q4_0_ref, one element at a time: (codes, d in float32)."""
    n, k = w.shape
    codes, scales = np.zeros((n, k), np.int64), np.zeros((n, k // 32), np.float32)
    for i in range(n):
        for g in range(k // 32):
            block = w[i, 32 * g : 32 * g + 32]
            amax, top = np.float32(0), np.float32(0)
            for v in block:
                if amax < abs(v):
                    amax, top = abs(v), v
            d = np.float32(top / np.float32(-8))
            inv = np.float32(1) / d if d else np.float32(0)
            scales[i, g] = d
            for j, v in enumerate(block):
                codes[i, 32 * g + j] = min(15, int(np.float32(v * inv) + np.float32(8.5)))
    return codes, scales


@pytest.mark.parametrize(("n", "k"), [(7, 96), (2, 32), (5, 64)])
def test_q4_sym_matches_llama_cpp_by_loops(n, k):
    w = RNG.standard_normal((n, k)).astype(np.float32)
    w[0, :32] = 0.0  # a flat group: d = 0, every code 8
    w[-1, -5] = -4 * np.abs(w[-1, -32:]).max()  # a negative extreme gets code 0
    packed, scale = numpy_ref.quantize_q4_sym(w, "w")
    assert packed.shape == (n, k // 8) and scale.shape == (n, k // 32)
    assert scale.dtype == np.float16
    codes, d = _q4_0_by_loops(w)
    np.testing.assert_array_equal(numpy_ref.unpack_int4(packed), codes)
    np.testing.assert_array_equal(scale, d.astype(np.float16))
    assert np.all(codes[0, :32] == 8) and codes[-1, -5] == 0
    deq = numpy_ref.dequantize_q4(packed, scale)
    s = np.repeat(scale.astype(np.float32), 32, axis=1)
    np.testing.assert_array_equal(deq, (numpy_ref.unpack_int4(packed) - 8.0) * s)


@pytest.mark.parametrize(("n", "k"), [(7, 96), (4, 32)])
def test_q8_matches_loops(n, k):
    w = RNG.standard_normal((n, k)).astype(np.float32)
    codes, scale = numpy_ref.quantize_q8(w, "w")
    assert codes.dtype == np.int8 and codes.shape == (n, k) and scale.shape == (n, k // 32)
    for i in range(n):
        for g in range(k // 32):
            block = w[i, 32 * g : 32 * g + 32]
            s = np.float32(np.abs(block).max() / 127)
            assert scale[i, g] == s
            want = np.clip(np.rint(block / s), -127, 127)
            assert np.abs(codes[i, 32 * g : 32 * g + 32] - want).max() <= 1
    deq = numpy_ref.dequantize_q8(codes, scale)
    assert np.all(np.abs(deq - w) <= np.repeat(scale, 32, axis=1) / 2 + 1e-6)


def test_q8_zero_group():
    codes, scale = numpy_ref.quantize_q8(np.zeros((1, 32), np.float32))
    assert np.all(codes == 0) and np.all(scale == 0)


@pytest.mark.parametrize(
    "quantize", [numpy_ref.quantize_q4, numpy_ref.quantize_q4_sym, numpy_ref.quantize_q8]
)
def test_k_not_a_multiple_of_the_group_names_tensor_and_dim(quantize):
    with pytest.raises(MlcrunError, match=r"'layers.0.down.weight'.*dimension 1 \(K = 100\)"):
        quantize(np.zeros((7, 100), np.float32), "layers.0.down.weight")
    with pytest.raises(MlcrunError, match="2-D"):
        quantize(np.zeros((64,), np.float32), "norm.weight")


# ----------------------------------------------------------------- weight transform
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_transform_matches_declared_params(preset):
    p = get_preset(preset)
    w = RNG.standard_normal((7, 96)).astype(np.float32)
    out = weight_transform(p, "layer.proj.weight", w)
    if p.kind == "none":
        assert list(out) == ["layer.proj.weight"] and out["layer.proj.weight"].dtype == np.float32
        return
    specs = quant_param_specs(p, 7, 96)
    assert list(out) == [f"layer.proj.{suffix}" for suffix in specs]
    for suffix, (shape, dtype) in specs.items():
        array = out[f"layer.proj.{suffix}"]
        assert array.shape == shape and str(array.dtype) == dtype
        assert float_param_name(f"layer.proj.{suffix}") == "layer.proj.weight"
    # q4: half a step of up to 3.3 / 7.5; the symmetric q4's step is amax / 8, and the side
    # opposite the extreme value clips at 7 steps: up to a whole step
    tol = {"f16": 1e-3, "bf16": 1e-2, "q8": 0.02, "q4": 0.45 if p.symmetric else 0.35}[p.kind]
    np.testing.assert_allclose(dequantize_params(p, out), w, atol=tol)


@pytest.mark.parametrize("preset", ["q0f16", "q4f32_1", "q8f32"])
def test_transform_keeps_vectors_float32(preset):
    p = get_preset(preset)
    for name in ("model.norm.weight", "layer.qkv_proj.bias"):
        out = weight_transform(p, name, np.ones(64, np.float16))
        assert list(out) == [name] and out[name].dtype == np.float32


def test_transform_keeps_odd_k_float32_under_q4_and_q8():
    w = RNG.standard_normal((8, 100)).astype(np.float32)
    for preset in ("q4f16_1", "q8f32"):
        out = weight_transform(get_preset(preset), "odd.weight", w)
        assert list(out) == ["odd.weight"] and out["odd.weight"].dtype == np.float32
    out = weight_transform(get_preset("q0f16"), "odd.weight", w)
    assert out["odd.weight"].dtype == np.float16


def _bf16_by_loop(x: float) -> int:
    """Round one float32 to bfloat16 bits, nearest even, written out per element."""
    bits = int(np.array([x], np.float32).view(np.uint32)[0])
    if np.isnan(x):
        return (bits >> 16) | 0x40
    upper, lower = bits >> 16, bits & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1
    return upper


def test_bf16_rounds_to_nearest_even():
    specials = [1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, 3.4e38, -3.4e38]
    specials += [1e-40, -1e-42, 0.0, -0.0, np.inf, -np.inf, np.nan]  # denormals kept as they are
    x = np.concatenate([np.array(specials, np.float32), RNG.standard_normal(500).astype("f4")])
    got = numpy_ref.to_bf16(x)
    assert got.dtype == np.uint16
    assert got.tolist() == [_bf16_by_loop(float(v)) for v in x]
    assert got[2] == 0x3F80 and got[3] == 0x3F82 and got[4] == 0x3F81  # ties to even, above
    assert got[5] == 0x7F80  # 3.4e38 is past bf16's largest finite value: rounds to inf
    back = numpy_ref.from_bf16(got)
    assert np.isnan(back[13]) and np.array_equal(back[:13], back[:13])
    np.testing.assert_allclose(back[14:], x[14:], rtol=2**-8)


def test_bf16_weights_keep_bf16_values_bit_exactly():
    """A bf16 checkpoint is read widened to float32; its q0bf16 params are the stored bits."""
    stored = RNG.integers(0, 1 << 16, (33, 64), dtype=np.uint16)
    stored[(stored & 0x7F80) == 0x7F80] = 0x3F80  # no inf / NaN
    widened = numpy_ref.from_bf16(stored)
    p = get_preset("q0bf16")
    out = weight_transform(p, "layer.proj.weight", widened)
    assert out["layer.proj.weight"].dtype == np.uint16
    np.testing.assert_array_equal(out["layer.proj.weight"], stored)
    np.testing.assert_array_equal(dequantize_params(p, out), widened)
    panels = weight_transform(p, "layer.proj.weight", widened, "bf16")["layer.proj.weight"]
    np.testing.assert_array_equal(panels, numpy_ref.tile_rows(stored, 2))
    np.testing.assert_array_equal(dequantize_params(p, {"w": panels}, "bf16"), widened)
    assert weight_transform(p, "model.norm.weight", widened[0])["model.norm.weight"].dtype == "f4"


def test_float_param_name_leaves_other_names_alone():
    assert float_param_name("a.b.bias") == "a.b.bias"
    assert float_param_name("a.q_weight_extra") == "a.q_weight_extra"
    assert float_param_name("model.embed_tokens.q_min") == "model.embed_tokens.weight"


# ----------------------------------------------------------------- GGUF blocks, exactly
@pytest.mark.parametrize(
    ("qtype", "preset"),
    [
        ("Q4_0", "q4f32_1"),
        ("Q4_0", "q4f16_1"),
        ("Q4_0", "q4f16_0"),
        ("Q4_1", "q4f32_1"),
        ("Q4_1", "q4f16_1"),
        ("Q8_0", "q8f32"),
        ("Q8_0", "q8f16"),
    ],
)
def test_gguf_blocks_become_preset_params_bit_exactly(qtype, preset):
    """gguf's own quantizer writes the blocks; our params must dequantize to exactly what
    gguf's dequantizer reads from them (odd row count, several blocks per row)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from mlcrun.quant.gguf_blocks import exact_params

    kind = GGMLQuantizationType[qtype]
    w = RNG.normal(0, 0.05, (7, 96)).astype(np.float32)
    w[2, :32] = 0.0  # a flat block
    w[3, 32:64] += 1.5  # a block away from zero (Q4_1's min matters)
    data = quantize(w, kind)
    want = dequantize(data, kind)
    p = get_preset(preset)
    params = exact_params(p, qtype, data)
    assert params is not None
    specs = quant_param_specs(p, 7, 96)
    assert {k: (v.shape, str(v.dtype)) for k, v in params.items()} == specs
    got = dequantize_params(p, {f"x.{k}": v for k, v in params.items()})
    np.testing.assert_array_equal(got, want)


def test_gguf_blocks_refused_where_not_exact():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from mlcrun.quant.gguf_blocks import exact_params

    w = RNG.normal(0, 0.05, (2, 64)).astype(np.float32)
    q8 = quantize(w, GGMLQuantizationType.Q8_0)
    assert exact_params(get_preset("q4f32_1"), "Q8_0", q8) is None
    q4 = quantize(w, GGMLQuantizationType.Q4_1)
    assert exact_params(get_preset("q8f32"), "Q4_1", q4) is None
    assert exact_params(get_preset("q0f32"), "Q4_1", q4) is None
    assert exact_params(get_preset("q4f16_0"), "Q4_1", q4) is None  # no room for Q4_1's min


BLOCK_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def _random_blocks(qtype: str, rows: int, blocks_per_row: int) -> np.ndarray:
    """Every bit of every block random, except the f16 scales (kept finite and small)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from mlcrun.quant.gguf_blocks import blocks

    size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    raw = RNG.integers(0, 256, (rows, blocks_per_row * size), dtype=np.uint8)
    b = blocks(qtype, raw)
    for field in ("d", "m", "dmin"):
        if field in b.dtype.names:
            b[field] = (RNG.standard_normal(b[field].shape) * 0.01).astype(np.float16)
    return b.view(np.uint8).reshape(rows, -1)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_block_decoder_matches_gguf_bit_for_bit(qtype):
    """Our reading of every block type (codes, scales, mins; K-quants' packed 6-bit scales,
    5th and 6th bits) equals gguf's dequantizer on random blocks, bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from mlcrun.quant.gguf_blocks import dequantize

    data = _random_blocks(qtype, 5, 3)
    want = gguf_dequantize(data, GGMLQuantizationType[qtype]).astype(np.float32)
    got = dequantize(qtype, data)
    assert got.shape == want.shape == (5, data.shape[1] // _bytes_per_weight(qtype))
    np.testing.assert_array_equal(got.view(np.uint32), want.reshape(5, -1).view(np.uint32))


def _bytes_per_weight(qtype: str) -> float:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return size / block


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_fixture_writes_blocks_gguf_reads_back(qtype):
    """The tests' own K-quant writer (gguf-py has none) writes valid blocks: gguf reads back
    the weights within one quantization step of each group."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf_fixtures import quantize_k

    kind = GGMLQuantizationType[qtype]
    w = RNG.normal(0, 0.05, (6, 512)).astype(np.float32)
    w[1, :256] = 0.0  # a flat block
    w[2, 256:] += 0.3  # a block away from zero
    back = gguf_dequantize(quantize_k(w, kind), kind).reshape(w.shape)
    blocks = w.reshape(6, 2, -1)
    if qtype == "Q6_K":  # symmetric: codes -32..31 over +-max|w|
        step = 2 * np.abs(blocks).max(axis=-1) / 62
    else:  # codes 0..levels over [min(w, 0), max(w)]
        step = (blocks.max(axis=-1) - np.minimum(blocks.min(axis=-1), 0)) / (
            15 if qtype == "Q4_K" else 31
        )
    err = np.abs(back - w).reshape(blocks.shape).max(axis=-1)
    assert np.all(err <= 0.6 * step + 1e-7), (err / step).max()
    np.testing.assert_array_equal(back[1, :256], 0.0)


@pytest.mark.parametrize(
    ("qtype", "preset", "activations"),
    [
        ("Q5_0", "q8f32", "exact"),
        ("Q5_0", "q8f16", "int8"),
        ("Q4_K", "q4f32_1", "exact"),
        ("Q4_K", "q4f32_1", "int8"),
    ],
)
def test_k_and_5_bit_blocks_become_preset_params_bit_exactly(qtype, preset, activations):
    """Q5_0 is q8f16 or q8f32 (codes q - 16, scale d) and Q4_K is q4f32_1 (scale d * sc, min
    -dmin * m per group of 32): random blocks, every param in the preset's declared shape
    and dtype (and the int8 kernels' layout), reading back gguf's values bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from mlcrun.quant.gguf_blocks import exact_params
    from mlcrun.quant.transform import to_layout

    data = _random_blocks(qtype, 16, 2)
    want = gguf_dequantize(data, GGMLQuantizationType[qtype]).reshape(16, -1)
    p = get_preset(preset)
    params = exact_params(p, qtype, data)
    assert params is not None
    k = want.shape[1]
    params = to_layout(p, {f"x.{n}": v for n, v in params.items()}, activations)
    specs = quant_param_specs(p, 16, k, activations)
    assert {n[2:]: (v.shape, str(v.dtype)) for n, v in params.items()} == specs
    got = dequantize_params(p, params, activations)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_blocks_without_an_exact_preset_are_refused():
    """Q5_1 and Q5_K carry a min that q8 has no room for, Q6_K groups of 16, Q4_K scales
    that need float32 in q4f16_1."""
    from mlcrun.quant.gguf_blocks import exact_params

    for qtype in ("Q5_1", "Q5_K", "Q6_K"):
        data = _random_blocks(qtype, 2, 1)
        for preset in ("q8f32", "q8f16", "q4f32_1", "q4f16_1", "q4f16_0", "q0f32"):
            assert exact_params(get_preset(preset), qtype, data) is None, (qtype, preset)
    q4k = _random_blocks("Q4_K", 4, 1)
    assert exact_params(get_preset("q4f16_1"), "Q4_K", q4k) is None  # d * sc: 17 bits
    assert exact_params(get_preset("q4f16_0"), "Q4_K", q4k) is None
    assert exact_params(get_preset("q8f32"), "Q4_K", q4k) is None


def test_q4_sym_quantizer_writes_llama_cpps_q4_0_blocks():
    """A float weight quantized to q4f16_0 holds the very blocks gguf's (llama.cpp's)
    Q4_0 quantizer writes for it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from mlcrun.quant.gguf_blocks import exact_params

    w = RNG.normal(0, 0.05, (33, 256)).astype(np.float32)
    w[1, :32] = 0.0
    p = get_preset("q4f16_0")
    ours = weight_transform(p, "x.weight", w)
    blocks = exact_params(p, "Q4_0", quantize(w, GGMLQuantizationType.Q4_0))
    for suffix, array in blocks.items():
        np.testing.assert_array_equal(ours[f"x.{suffix}"], array, suffix)


def test_auto_picks_the_preset_of_the_dominant_storage_type():
    from mlcrun.quant.gguf_blocks import auto_preset

    assert auto_preset({"Q4_1": 100, "F32": 1}, {"Q4_1": 30}) == "q4f16_1"
    assert auto_preset({"Q4_1": 100}, {"Q8_0": 30}) == "q4f16_1+q8f16"  # SmolLM2's GGUF
    assert auto_preset({"Q4_0": 10}, {"F32": 5}) == "q4f16_0+q0f32"
    assert auto_preset({"Q4_0": 100}, {"Q8_0": 30}) == "q4f16_0+q8f16"  # llama.cpp's Q4_0
    assert auto_preset({"Q4_0": 100}, {"Q4_0": 30}) == "q4f16_0"
    assert auto_preset({"Q4_0": 100, "Q4_1": 3}, {"Q8_0": 30}) == "q4f16_1+q8f16"  # both exact
    assert auto_preset({"Q4_0": 100}, {"Q4_1": 30}) == "q4f16_0+q4f16_1"
    assert auto_preset({"Q8_0": 100, "Q4_0": 3}, {}) == "q8f16"
    assert auto_preset({"Q8_0": 100, "Q4_0": 3, "Q4_1": 2}, {}) == "q8f16"
    assert auto_preset({"F16": 5}, {"F16": 5}) == "q0f16"
    assert auto_preset({"BF16": 5}, {"BF16": 5}) == "q0bf16"
    assert auto_preset({"BF16": 5}, {"F32": 5}) == "q0bf16+q0f32"
    assert auto_preset({"F32": 5}, {"F32": 5}) == "q0f32"
    assert auto_preset({}, {}) == "q0f32"
    # K-quants: exact where a preset holds the blocks, q8f16 where none does, and never a
    # 4-bit preset for layers with wider tensors (the Gemma 3 270M "Q4_K_M" file's mix)
    assert auto_preset({"Q4_K": 100}, {"Q8_0": 30}) == "q4f32_1+q8f16"
    assert auto_preset({"Q5_0": 100}, {"Q5_0": 30}) == "q8f16"
    assert auto_preset({"Q6_K": 100}, {"Q6_K": 30}) == "q8f16"
    assert auto_preset({"Q5_K": 100, "Q6_K": 10}, {}) == "q8f16"
    assert auto_preset({"Q4_K": 100, "Q6_K": 20}, {"Q6_K": 30}) == "q8f16"
    assert auto_preset({"Q5_0": 60, "Q4_K": 30, "Q6_K": 9, "Q8_0": 6}, {"Q8_0": 30}) == "q8f16"
    assert auto_preset({"Q4_1": 100, "Q8_0": 3}, {"Q8_0": 30}) == "q8f16"  # no tensor narrowed


def test_mixed_preset_stores_tables_in_the_second_format():
    from mlcrun.quant.transform import preset_for

    mixed = get_preset("q4f16_1+q8f32")
    assert mixed.kind == "q4" and mixed.for_embedding is PRESETS["q8f32"]
    assert preset_for(mixed, "model.embed_tokens.weight").name == "q8f32"
    assert preset_for(mixed, "lm_head.weight").name == "q8f32"
    assert preset_for(mixed, "model.layers.0.mlp.down_proj.weight") is mixed
    w = RNG.normal(0, 0.05, (4, 64)).astype(np.float32)
    assert set(weight_transform(mixed, "lm_head.weight", w)) == {
        "lm_head.q_weight",
        "lm_head.q_scale",
    }
    for bad in ("q4f16_1+q4f16_1", "q4f16_1+", "q4f16_1+q9", "x+q8f32"):
        with pytest.raises(MlcrunError, match="unknown quantization"):
            get_preset(bad)
