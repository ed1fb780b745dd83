"""GGUF quantized blocks -> a preset's params, bit for bit (no requantization).

llama.cpp stores a row of K weights as K/32 blocks (little-endian, packed):

* Q4_0, 18 bytes: d (f16), qs[16]; w[j] = (lo(qs[j]) - 8) * d, w[j + 16] = (hi(qs[j]) - 8) * d
* Q4_1, 20 bytes: d (f16), m (f16), qs[16]; w[j] = lo(qs[j]) * d + m, w[j + 16] = hi(...) ...
* Q8_0, 34 bytes: d (f16), qs[32] (int8); w[j] = qs[j] * d

The symmetric q4f16_0 (w = (q - 8) * scale, quant/presets.py) is Q4_0 itself: scale = d.
The q4 presets with a min (w = q * scale + min) hold Q4_1 as (scale = d, min = m) and Q4_0 as
(scale = d, min = -8 d): both exact in f16 or f32 storage (-8 d only moves the exponent; it is
checked for f16 overflow). Q8_0 is q8f32 with scale = d. Only the nibble order differs: a
block keeps element j and j + 16 in one byte, our words keep elements 8 i .. 8 i + 7 in word i.

`exact_params` returns None whenever the stored type does not fit the preset exactly; the
compile then quantizes the float weights instead.
"""

from __future__ import annotations

import numpy as np

from .numpy_ref import Q4_ZERO, pack_int4
from .presets import GROUP_SIZE, QuantPreset

_BLOCK = {
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
}

# GGML type -> the preset `auto` stores it in, exactly (float types: float storage keeps them)
EXACT_PRESET: dict[str, str] = {
    "Q4_0": "q4f16_0",
    "Q4_1": "q4f16_1",
    "Q8_0": "q8f32",
    "F16": "q0f16",
    "BF16": "q0bf16",
    "F32": "q0f32",
}
_BLOCK_KIND = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8"}  # the preset kind that holds the blocks


def blocks(ggml_type: str, data: np.ndarray) -> np.ndarray:
    """[rows, bytes per row] uint8 -> [rows, K / 32] structured blocks."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    return data.view(_BLOCK[ggml_type]).reshape(data.shape[0], -1)


def exact_params(preset: QuantPreset, ggml_type: str, data: np.ndarray) -> dict | None:
    """Suffix ("q_weight", "q_scale"[, "q_min"]) -> array for a quantized GGUF tensor stored in
    `preset` without loss, or None when the preset cannot hold it exactly."""
    if _BLOCK_KIND.get(ggml_type) != preset.kind or preset.group_size != GROUP_SIZE:
        return None
    if preset.symmetric and ggml_type != "Q4_0":  # Q4_1's min has no place there
        return None
    b = blocks(ggml_type, data)
    d = b["d"].astype(np.float32)  # f16 -> f32 or f16: exact
    if ggml_type == "Q8_0":
        codes = b["qs"].reshape(b.shape[0], -1)
        return {"q_weight": codes, "q_scale": d.astype(preset.scale_dtype)}
    qs = b["qs"]  # [rows, blocks, 16]
    codes = pack_int4(np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(b.shape[0], -1))
    scale = d.astype(preset.scale_dtype)
    if preset.symmetric:
        return {"q_weight": codes, "q_scale": scale}
    mins = b["m"].astype(np.float32) if ggml_type == "Q4_1" else -Q4_ZERO * d
    mins = mins.astype(preset.scale_dtype)
    if not np.all(np.isfinite(mins)):  # -8 d beyond f16 range
        return None
    return {"q_weight": codes, "q_scale": scale, "q_min": mins}


def auto_preset(layer_types: dict[str, int], embedding_types: dict[str, int]) -> str:
    """`--quantization auto`: the preset holding the dominant storage type (by elements) of the
    linear layers' weights exactly, paired (`A+B`) with the one for the embedding table and
    lm_head when they are stored differently. Tensors of any other type are converted. Q4_0
    layers with some Q4_1 ones go to q4f16_1, which holds both exactly (q4f16_0 would
    requantize the Q4_1 tensors)."""

    def exact(types: dict[str, int]) -> str | None:
        if not types:
            return None
        dominant = max(types, key=lambda t: types[t])
        if dominant == "Q4_0" and "Q4_1" in types:
            dominant = "Q4_1"
        return EXACT_PRESET.get(dominant, "q0f32")

    layers = exact(layer_types) or exact(embedding_types) or "q0f32"
    table = exact(embedding_types) or layers
    return layers if table == layers else f"{layers}+{table}"
