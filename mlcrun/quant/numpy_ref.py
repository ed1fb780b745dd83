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


def dequantize_q4(packed: np.ndarray, scale: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """w = q * scale + min, float32 [N, K]."""
    codes = unpack_int4(packed).astype(np.float32)
    n, k = codes.shape
    g = codes.reshape(n, scale.shape[1], -1)
    s, m = scale.astype(np.float32)[..., None], mins.astype(np.float32)[..., None]
    return (g * s + m).reshape(n, k)


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
