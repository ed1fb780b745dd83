"""GGUF quantized blocks -> a preset's params, bit for bit (no requantization).

llama.cpp stores a row of K weights as K/32 blocks (little-endian, packed):

* Q4_0, 18 bytes: d (f16), qs[16]; w[j] = (lo(qs[j]) - 8) * d, w[j + 16] = (hi(qs[j]) - 8) * d
* Q4_1, 20 bytes: d (f16), m (f16), qs[16]; w[j] = lo(qs[j]) * d + m, w[j + 16] = hi(...) ...
* Q8_0, 34 bytes: d (f16), qs[32] (int8); w[j] = qs[j] * d
* Q5_0, 22 bytes: d (f16), qh (u32), qs[16]; 5-bit codes (the nibbles as in Q4_0, bit j of qh
  the fifth bit of element j): w = (q - 16) * d
* Q5_1, 24 bytes: d, m (f16), qh, qs[16]; w = q * d + m
* Q4_K, 144 bytes per 256 weights: d, dmin (f16), scales[12] (eight 6-bit scales and mins,
  packed), qs[128]; 8 groups of 32: w = q * (d * sc[g]) - dmin * m[g]. Group 2i takes the low
  nibbles of qs[32 i .. 32 i + 31], group 2i + 1 their high nibbles.
* Q5_K, 176 bytes: as Q4_K plus qh[32] (bit g of qh[l] is the fifth bit of group g's
  element l)
* Q6_K, 210 bytes: ql[128], qh[64], scales[16] (int8), d (f16); 16 groups of 16:
  w = (q - 32) * d * scales[g], 4 low bits from ql and 2 high bits from qh.

The symmetric q4f16_0 (w = (q - 8) * scale, quant/presets.py) is Q4_0 itself: scale = d.
The q4 presets with a min (w = q * scale + min) hold Q4_1 as (scale = d, min = m) and Q4_0 as
(scale = d, min = -8 d): both exact in f16 or f32 storage (-8 d only moves the exponent; it is
checked for f16 overflow). Q8_0 is q8f16 (or q8f32) with scale = d. In the q4 forms only the
nibble order differs: a block keeps element j and j + 16 in one byte, our words keep elements
8 i .. 8 i + 7 in word i.
Q5_0 is q8f16 with codes q - 16 and scale = d. Q4_K is q4f32_1 with scale = d * sc and
min = -dmin * m per group of 32: a float16 times a 6-bit integer needs 17 significant bits,
exact in float32 (and in the q4f16_1 of a tensor only where every product fits in 11). Q5_1,
Q5_K (5-bit codes with a min) and Q6_K (groups of 16) fit no preset exactly: `auto` stores
them in q8f16 (8-bit codes, group 32; the codes are rounded against the fp16 scale), whose
rounding error is at most half a step of about 1/127 of each group's largest magnitude, below
the 5- and 6-bit formats' own.

`exact_params` returns None whenever the stored type does not fit the preset exactly; the
compile then quantizes the float weights instead.
"""

from __future__ import annotations

import numpy as np

from ..errors import MlcrunError
from .numpy_ref import Q4_ZERO, pack_int4
from .presets import GROUP_SIZE, QuantPreset

_BLOCK = {
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    "Q5_0": np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)]),
    "Q5_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)]),
    "Q4_K": np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)]),
    "Q5_K": np.dtype(
        [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)]
    ),
    "Q6_K": np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")]),
}
BLOCK_TYPES = tuple(_BLOCK)

# The 8-bit preset: Q8_0's own layout (codes and an fp16 d per 32), where `auto` puts 8-bit blocks
# and any it must round
Q8_PRESET = "q8f16"
# GGML type -> the preset `auto` stores it in, exactly (float types: float storage keeps them)
EXACT_PRESET: dict[str, str] = {
    "Q4_0": "q4f16_0",
    "Q4_1": "q4f16_1",
    "Q8_0": Q8_PRESET,
    "Q5_0": Q8_PRESET,
    "Q4_K": "q4f32_1",
    "F16": "q0f16",
    "BF16": "q0bf16",
    "F32": "q0f32",
}
# GGML type -> the preset `auto` stores it in, rounded (no preset holds it exactly)
NEAREST_PRESET: dict[str, str] = {"Q5_1": Q8_PRESET, "Q5_K": Q8_PRESET, "Q6_K": Q8_PRESET}
# the preset kind that holds the blocks exactly
_BLOCK_KIND = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8", "Q5_0": "q8", "Q4_K": "q4"}
_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}


def blocks(ggml_type: str, data: np.ndarray) -> np.ndarray:
    """[rows, bytes per row] uint8 -> [rows, K / 32] structured blocks."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    return data.view(_BLOCK[ggml_type]).reshape(data.shape[0], -1)


def _nibbles(qs: np.ndarray, rows: int) -> np.ndarray:
    """[rows, blocks, 16 * n] bytes -> [rows, K] codes: per 32 elements, the low nibbles of
    16 bytes then their high nibbles."""
    lo, hi = qs & 0x0F, qs >> 4
    shape = (*qs.shape[:-1], -1, 1, 16) if qs.shape[-1] == 16 else (*qs.shape[:-1], -1, 1, 32)
    pairs = np.concatenate([lo.reshape(shape), hi.reshape(shape)], axis=-2)
    return pairs.reshape(rows, -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins."""
    s = scales.astype(np.uint8)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode(ggml_type: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A quantized GGUF tensor [rows, bytes per row] -> (codes [rows, K] int16, scale
    [rows, K / g] float32, min [rows, K / g] float32 or None) with w = codes * scale (+ min)
    per group of g elements (16 for Q6_K, else 32). Codes of the symmetric types are centred
    (Q4_0: q - 8, Q5_0: q - 16, Q6_K: q - 32). Every scale and min is exact in float32."""
    b = blocks(ggml_type, data)
    rows = b.shape[0]
    f32 = np.float32
    if ggml_type == "Q8_0":
        return b["qs"].reshape(rows, -1).astype(np.int16), b["d"].astype(f32), None
    if ggml_type in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        q = _nibbles(b["qs"], rows).astype(np.int16).reshape(rows, -1, 32)
        if ggml_type in ("Q5_0", "Q5_1"):
            bits = (b["qh"][..., None] >> np.arange(32, dtype=np.uint32)) & 1
            q = q | (bits.astype(np.int16) << 4)
        d = b["d"].astype(f32)
        if ggml_type == "Q4_1" or ggml_type == "Q5_1":
            return q.reshape(rows, -1), d, b["m"].astype(f32)
        zero = 8 if ggml_type == "Q4_0" else 16
        return (q - zero).reshape(rows, -1), d, None
    if ggml_type in ("Q4_K", "Q5_K"):
        q = _nibbles(b["qs"], rows).astype(np.int16).reshape(rows, -1, 8, 32)
        if ggml_type == "Q5_K":
            bits = (b["qh"][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            q = q | (bits.astype(np.int16) << 4)
        sc, mn = _k_scales(b["scales"])
        scale = b["d"].astype(f32)[..., None] * sc.astype(f32)
        mins = -(b["dmin"].astype(f32)[..., None] * mn.astype(f32))
        return q.reshape(rows, -1), scale.reshape(rows, -1), mins.reshape(rows, -1)
    if ggml_type == "Q6_K":
        ql, qh = b["ql"].reshape(rows, -1, 2, 64), b["qh"].reshape(rows, -1, 2, 1, 32)
        low = np.stack([ql & 0x0F, ql >> 4], axis=-2)  # [rows, blocks, half, nibble, 64]
        low = low.reshape(rows, -1, 2, 4, 32)  # group g of a half: nibble g >> 1, bytes g & 1
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        q = (low | (high << 4)).astype(np.int16) - 32
        scale = b["d"].astype(f32)[..., None] * b["scales"].astype(f32)
        return q.reshape(rows, -1), scale.reshape(rows, -1), None
    raise MlcrunError(f"no block decoder for GGUF type {ggml_type}")


def dequantize(ggml_type: str, data: np.ndarray) -> np.ndarray:
    """The float32 [rows, K] values of a quantized GGUF tensor (the reference the tests hold
    against gguf.quants)."""
    codes, scale, mins = decode(ggml_type, data)
    rows, k = codes.shape
    g = codes.reshape(rows, scale.shape[1], -1).astype(np.float32) * scale[..., None]
    if mins is not None:
        g = g + mins[..., None]
    return g.reshape(rows, k)


def _stored(values: np.ndarray, dtype: str) -> np.ndarray | None:
    """`values` (float32) in `dtype`, or None where that would round any of them."""
    out = values.astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        same = np.array_equal(out.astype(np.float32), values)
    return out if same else None


def exact_params(preset: QuantPreset, ggml_type: str, data: np.ndarray) -> dict | None:
    """Suffix ("q_weight", "q_scale"[, "q_min"]) -> array for a quantized GGUF tensor stored in
    `preset` without loss, or None when the preset cannot hold it exactly."""
    if _BLOCK_KIND.get(ggml_type) != preset.kind or preset.group_size != GROUP_SIZE:
        return None
    if preset.symmetric and ggml_type != "Q4_0":  # a min has no place there
        return None
    codes, scale, mins = decode(ggml_type, data)
    if preset.kind == "q8":
        scale = _stored(scale, preset.scale_dtype)
        if scale is None:
            return None
        return {"q_weight": codes.astype(np.int8), "q_scale": scale}
    if preset.symmetric:  # Q4_0 in q4f16_0
        return {"q_weight": pack_int4(codes + Q4_ZERO), "q_scale": scale.astype(preset.scale_dtype)}
    if mins is None:  # Q4_0 in a q4 preset with a min: q * d - 8 d
        codes, mins = codes + Q4_ZERO, -Q4_ZERO * scale
    stored = _stored(scale, preset.scale_dtype), _stored(mins, preset.scale_dtype)
    if stored[0] is None or stored[1] is None:  # e.g. -8 d beyond f16 range
        return None
    return {"q_weight": pack_int4(codes), "q_scale": stored[0], "q_min": stored[1]}


def auto_preset(layer_types: dict[str, int], embedding_types: dict[str, int]) -> str:
    """`--quantization auto`: the preset holding the dominant storage type (by elements) of the
    linear layers' weights exactly (or, for Q5_1/Q5_K/Q6_K, nearest: q8f16), paired (`A+B`)
    with the one for the embedding table and lm_head when they are stored differently.
    Tensors of any other type are converted. Q4_0 layers with some Q4_1 ones go to q4f16_1,
    which holds both exactly (q4f16_0 would requantize the Q4_1 tensors). A 4-bit preset is
    never chosen for layers that include wider quantized tensors (a K-quant "Q4_K_M" file's
    Q5_0/Q6_K/Q8_0 ones): those layers go to q8f16, so no tensor loses bits."""

    def pick(types: dict[str, int]) -> str | None:
        if not types:
            return None
        dominant = max(types, key=lambda t: types[t])
        if dominant == "Q4_0" and "Q4_1" in types:
            dominant = "Q4_1"
        preset = EXACT_PRESET.get(dominant) or NEAREST_PRESET.get(dominant, "q0f32")
        if _BITS.get(dominant) == 4 and any(_BITS.get(t, 0) > 4 for t in types):
            return Q8_PRESET
        return preset

    layers = pick(layer_types) or pick(embedding_types) or "q0f32"
    table = pick(embedding_types) or layers
    return layers if table == layers else f"{layers}+{table}"
