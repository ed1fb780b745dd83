"""numpy reference quantizers: the compile path's weight transform and the tests' oracle.

All functions work on 2-D weights [N, K] (rows = output features / vocab entries) grouped
along K, the reduction dimension of the matmul: `GROUP_SIZE` consecutive elements of a row
share one scale (and, for q4, one min).

Shape policy: a tensor whose K is not a multiple of the group size cannot be quantized and
these functions raise an MlcrunError naming it. The module rewrite and the weight transform
(quant/modules.py) check the same condition first and keep such a layer in float32, so a
compile never fails on an odd shape (real checkpoints have K % 32 == 0 everywhere).
"""

from __future__ import annotations

import numpy as np

from ..errors import MlcrunError
from .presets import GROUP_SIZE

NIBBLES_PER_WORD = 8
Q4_ZERO = 8  # the code of zero in the symmetric q4 format (q4f16_0, GGUF Q4_0)


def is_quantizable(shape: tuple[int, ...], group_size: int = GROUP_SIZE) -> bool:
    """2-D with K (the last dim) a positive multiple of the group size."""
    return len(shape) == 2 and shape[1] > 0 and shape[1] % group_size == 0


def check_groups(name: str, shape: tuple[int, ...], group_size: int = GROUP_SIZE) -> None:
    if len(shape) != 2:
        raise MlcrunError(f"cannot quantize {name!r}: expected a 2-D weight, got shape {shape}")
    if not is_quantizable(shape, group_size):
        raise MlcrunError(
            f"cannot quantize {name!r} (shape {list(shape)}): dimension 1 (K = {shape[1]}) "
            f"is not a multiple of the group size {group_size}"
        )


def to_bf16(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even; NaN stays a (quiet) NaN.
    Values that are already bf16 (a bf16 checkpoint widened to float32) keep their bits."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(w, dtype=np.float32))
    rounded = np.where(nan, (bits >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """[..., K] codes in 0..15 -> [..., K/8] uint32; code j of word i is element 8*i + j."""
    codes = np.asarray(codes)
    if codes.shape[-1] % NIBBLES_PER_WORD:
        raise MlcrunError(f"cannot pack {codes.shape[-1]} int4 codes: not a multiple of 8")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise MlcrunError("int4 codes must lie in 0..15")
    nib = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, NIBBLES_PER_WORD)
    shifts = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4
    return np.bitwise_or.reduce(nib << shifts, axis=-1).astype(np.uint32)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """[..., K/8] uint32 -> [..., K] uint8 codes (inverse of pack_int4)."""
    packed = np.asarray(packed, dtype=np.uint32)
    shifts = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4
    codes = (packed[..., None] >> shifts) & np.uint32(15)
    return codes.reshape(*packed.shape[:-1], -1).astype(np.uint8)


def _groups(w: np.ndarray, group_size: int) -> np.ndarray:
    n, k = w.shape
    return w.astype(np.float32).reshape(n, k // group_size, group_size)


def quantize_q4(
    w: np.ndarray,
    name: str = "weight",
    scale_dtype: str = "float32",
    group_size: int = GROUP_SIZE,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric 4-bit: per group min = min(w), scale = (max - min) / 15,
    q = round((w - min) / scale) in 0..15. Scale and min are rounded to `scale_dtype` first
    and the codes computed against the rounded values, so dequantize sees what was stored.
    Returns (packed [N, K/8] uint32, scale [N, K/32], min [N, K/32])."""
    check_groups(name, w.shape, group_size)
    g = _groups(w, group_size)  # [N, K/32, 32]
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    scale = ((hi - lo) / 15).astype(scale_dtype)
    mins = lo.astype(scale_dtype)
    s32, m32 = scale.astype(np.float32), mins.astype(np.float32)
    inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 > 0)  # flat group: q = 0
    codes = np.clip(np.rint((g - m32[..., None]) * inv[..., None]), 0, 15)
    return pack_int4(codes.reshape(w.shape).astype(np.uint8)), scale, mins


def quantize_q4_sym(
    w: np.ndarray,
    name: str = "weight",
    scale_dtype: str = "float16",
    group_size: int = GROUP_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 4-bit, llama.cpp's quantize_row_q4_0: per group d = v / -8 with v the
    element of largest magnitude (the first, on ties; signed, so v itself gets code 0),
    q = min(15, trunc(w / d + 8.5)) with w / d computed as w * (1 / d) in float32 from the
    unrounded d, then d stored in `scale_dtype`. w = (q - 8) * scale. Returns
    (packed [N, K/8] uint32, scale [N, K/32])."""
    check_groups(name, w.shape, group_size)
    g = _groups(w, group_size)
    top = np.take_along_axis(g, np.abs(g).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    d = top / np.float32(-Q4_ZERO)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)  # flat group: q = 8
    codes = np.trunc(g * inv[..., None] + np.float32(Q4_ZERO + 0.5))
    codes = np.minimum(codes, 15).astype(np.uint8)
    return pack_int4(codes.reshape(w.shape)), d.astype(scale_dtype)


def dequantize_q4(
    packed: np.ndarray, scale: np.ndarray, mins: np.ndarray | None = None
) -> np.ndarray:
    """w = q * scale + min, float32 [N, K]; without mins the symmetric form,
    w = (q - 8) * scale."""
    codes = unpack_int4(packed).astype(np.float32)
    n, k = codes.shape
    g = codes.reshape(n, scale.shape[1], -1)
    s = scale.astype(np.float32)[..., None]
    if mins is None:
        return ((g - Q4_ZERO) * s).reshape(n, k)
    return (g * s + mins.astype(np.float32)[..., None]).reshape(n, k)


def quantize_q8(
    w: np.ndarray,
    name: str = "weight",
    scale_dtype: str = "float32",
    group_size: int = GROUP_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 8-bit: per group scale = max|w| / 127, q = round(w / scale) in -127..127.
    Returns (codes [N, K] int8, scale [N, K/32])."""
    check_groups(name, w.shape, group_size)
    g = _groups(w, group_size)
    scale = (np.abs(g).max(axis=-1) / 127).astype(scale_dtype)
    s32 = scale.astype(np.float32)
    inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 > 0)
    codes = np.clip(np.rint(g * inv[..., None]), -127, 127).astype(np.int8)
    return codes.reshape(w.shape), scale


def dequantize_q8(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """w = q * scale, float32 [N, K]."""
    n, k = codes.shape
    g = codes.astype(np.float32).reshape(n, scale.shape[1], -1)
    return (g * scale.astype(np.float32)[..., None]).reshape(n, k)


# ----------------------------------------------------------------- int8 activations
# The int8-activation kernels (compiler/schedules/int8.py) multiply int8 activation codes with
# the weight codes in int32 (vpdpbusd: 16 int32 lanes, each the sum of 4 u8 x s8 products).
# Each lane is one output feature, so the weights are stored in panels of PANEL output rows,
# each panel transposed so that one 64-byte load holds the next 4 K-elements (q8) or the next
# 8 (q4: one uint32 word) of all 16 rows. A panel of r < PANEL rows (the last one when N is not
# a multiple of 16) is transposed the same way with r lanes. Scales and mins are stored in the
# same panels (tile_rows(., 1)): a panel's 16 scales of one group are contiguous, and so are all
# the groups of a panel, which a kernel streams beside the panel's codes. (Stored [K / 32, N],
# a tile's scales of successive groups were N * 2 bytes apart: one 4 KB page per group and
# array, more streams than the prefetchers follow; q4f16_1's gate_up on the Qwen2.5-0.5B shape
# took 1.5x q4f16_0's time per token at M = 1 and 2.5x at M = 4.) The arrays keep the
# row-major arrays' shapes: a panel's rows occupy the same bytes either way.
PANEL = 16


def tile_rows(a: np.ndarray, unit: int) -> np.ndarray:
    """[N, C] -> [N, C], each panel of PANEL rows (the last may be shorter) stored as
    [C / unit, rows, unit]: `unit` consecutive columns of every row in turn."""
    n, c = a.shape
    full = n - n % PANEL
    out = np.empty_like(a)
    out[:full] = a[:full].reshape(-1, PANEL, c // unit, unit).transpose(0, 2, 1, 3).reshape(full, c)
    if full < n:
        out[full:] = a[full:].reshape(n - full, c // unit, unit).transpose(1, 0, 2).reshape(-1, c)
    return out


def untile_rows(a: np.ndarray, unit: int) -> np.ndarray:
    """The inverse of tile_rows."""
    n, c = a.shape
    full = n - n % PANEL
    out = np.empty_like(a)
    out[:full] = a[:full].reshape(-1, c // unit, PANEL, unit).transpose(0, 2, 1, 3).reshape(full, c)
    if full < n:
        out[full:] = a[full:].reshape(c // unit, n - full, unit).transpose(1, 0, 2).reshape(-1, c)
    return out


def q4_to_int8_layout(packed, *scales) -> tuple[np.ndarray, ...]:
    """Row-major q4 params (packed, scale[, mins]) -> the int8 kernels' (words, scales [and
    mins], each in panels of 16 rows)."""
    t = np.ascontiguousarray
    return t(tile_rows(np.asarray(packed, np.uint32), 1)), *(t(tile_rows(s, 1)) for s in scales)


def q4_from_int8_layout(packed, *scales) -> tuple[np.ndarray, ...]:
    t = np.ascontiguousarray
    return t(untile_rows(np.asarray(packed, np.uint32), 1)), *(t(untile_rows(s, 1)) for s in scales)


def q8_to_int8_layout(codes, scale) -> tuple[np.ndarray, np.ndarray]:
    """Row-major q8 params -> the int8 kernels': codes + 128 as uint8 (vpdpbusd's unsigned
    operand; w = (u - 128) * scale) in panels of 4-byte lanes, scales in panels of 16 rows."""
    offset = (np.asarray(codes, np.int8).view(np.uint8) ^ np.uint8(0x80)).astype(np.uint8)
    return np.ascontiguousarray(tile_rows(offset, 4)), np.ascontiguousarray(tile_rows(scale, 1))


def q8_from_int8_layout(codes, scale) -> tuple[np.ndarray, np.ndarray]:
    rows = untile_rows(np.asarray(codes, np.uint8), 4) ^ np.uint8(0x80)
    return np.ascontiguousarray(rows.view(np.int8)), np.ascontiguousarray(untile_rows(scale, 1))


AMAX_FLOOR = 1e-30  # a block whose |max| is below this quantizes to zeros (no inf scale)


def quantize_activations(x: np.ndarray, group_size: int = GROUP_SIZE):
    """Activations [M, K] f32 -> (codes [M, K] int8, scale [M, K/32] f32, sums [M, K/32] int32),
    per row and group of 32: codes = rint(x * (127 / amax)) in [-127, 127] (round half to even,
    as llama.cpp's quantize_row_q8_0), scale = amax / 127, sums = the exact sum of the codes.
    Exactly what the compiled kernel computes (float32 operations in this order)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    g = x.reshape(m, k // group_size, group_size)
    amax = np.abs(g).max(axis=-1)
    live = amax >= np.float32(AMAX_FLOOR)
    inv = np.where(live, np.float32(127) / np.where(live, amax, np.float32(1)), np.float32(0))
    codes = np.clip(np.rint(g * inv.astype(np.float32)[..., None]), -127, 127).astype(np.int8)
    sums = codes.astype(np.int32).sum(axis=-1)
    scale = (amax / np.float32(127)).astype(np.float32)
    return codes.reshape(m, k), scale, sums.astype(np.int32)


def q4_activation_order(codes: np.ndarray) -> np.ndarray:
    """Codes in the order the q4 kernel reads them: within each 8 elements (one weight word)
    the even elements first, then the odd ones -- the low and the high nibbles of the word's
    4 bytes after an AND and a shift."""
    m, k = codes.shape
    w = codes.reshape(m, k // NIBBLES_PER_WORD, NIBBLES_PER_WORD)
    return np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1).reshape(m, k)


def int8_linear(x: np.ndarray, kind: str, params: tuple, group_size: int = GROUP_SIZE):
    """float64 [M, N]: x @ W.T as the int8 kernels compute it, from row-major params (q4:
    packed, scale[, mins], without mins the symmetric form; q8: codes, scale): exact int32
    dot products per group of 32, then sum_g dot_g * (scale_w * scale_a) (+ min_w * scale_a *
    sum_g(codes_a) for q4 with mins). The symmetric q4's -8 is exact in the int32 dot:
    dot_g = sum(q * a) - 8 * sum_g(codes_a)."""
    codes, da, sums = quantize_activations(x, group_size)
    m, k = codes.shape
    qa = codes.astype(np.int64).reshape(m, k // group_size, group_size)
    mins = None
    if kind == "q4":
        packed, scale, *rest = params
        wq = unpack_int4(packed).astype(np.int64)
        mins = rest[0] if rest else None
    else:
        wq, scale = params
        wq = np.asarray(wq).astype(np.int64)
    n = wq.shape[0]
    dots = np.einsum("mgk,ngk->mng", qa, wq.reshape(n, k // group_size, group_size))
    if kind == "q4" and mins is None:
        dots = dots - Q4_ZERO * sums.astype(np.int64)[:, None, :]
    da64 = da.astype(np.float64)[:, None, :]
    y = (dots * scale.astype(np.float64)[None] * da64).sum(-1)
    if mins is not None:
        y += (mins.astype(np.float64)[None] * (da64 * sums[:, None, :])).sum(-1)
    return y


# ----------------------------------------------------------------- bf16 activations
# The bf16-activation kernels (compiler/schedules/bf16.py) round each matmul input to bfloat16
# (vcvtne2ps2bf16) and multiply with vdpbf16ps: 16 float32 lanes, each adding the products of
# one K-pair. Both instructions round to nearest even and treat denormal inputs as zero,
# whatever MXCSR says. The weights are stored as q0bf16 bits in panels: tile_rows(bits, 2).


def bf16_activations(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits as the kernels round them: to_bf16 with denormals flushed to
    (signed) zero."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    denormal = (bits & 0x7F800000) == 0
    return np.where(denormal, (bits >> 16) & 0x8000, to_bf16(x)).astype(np.uint16)


def bf16_linear(x: np.ndarray, w_bits: np.ndarray) -> np.ndarray:
    """[M, K] f32 @ W.T with W [N, K] bf16 bits (row-major), as the bf16 kernels compute it:
    x rounded by bf16_activations, denormal weights read as zero, the exact products summed
    in float32 (per K-pair: the odd product, then the even one)."""
    a = from_bf16(bf16_activations(x)).astype(np.float32)
    w = from_bf16(w_bits)
    w = np.where((np.asarray(w_bits) & 0x7F80) == 0, np.float32(0), w)
    acc = np.zeros((a.shape[0], w.shape[0]), np.float32)
    for kp in range(a.shape[1] // 2):
        for k in (2 * kp + 1, 2 * kp):
            acc = (acc + np.outer(a[:, k], w[:, k]).astype(np.float32)).astype(np.float32)
    return acc
