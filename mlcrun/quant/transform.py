"""The weight transform of a preset: one float param -> the params the rewritten module declares.

numpy only (no TVM), keyed by param names exactly as quant/modules.py's rewrite names them:

    X.weight [N, K] f32 -> q4: X.q_weight [N, K/8] uint32, X.q_scale [N, K/32], X.q_min [N, K/32]
                           q8: X.q_weight [N, K] int8,     X.q_scale [N, K/32] f32
                           q0f16: X.weight [N, K] f16
    1-D params (norm weights, biases) stay float32.

Both sides decide from the same facts -- the preset, a 2-D `.weight`, its K -- so they agree
without either knowing the model: every 2-D weight of a model is a Linear's or an Embedding's.
Under q4/q8 a weight whose K is not a multiple of the group size (32) stays float32, and the
rewrite keeps that layer a plain float one (the policy of numpy_ref).
"""

from __future__ import annotations

import numpy as np

from . import numpy_ref
from .presets import QuantPreset

QUANT_SUFFIXES = ("q_weight", "q_scale", "q_min")


def quant_param_specs(
    preset: QuantPreset, n: int, k: int
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Suffix -> (shape, dtype) of the params that replace a float [n, k] `weight`."""
    g = preset.group_size
    if preset.kind == "f16":
        return {"weight": ((n, k), "float16")}
    if preset.kind == "q8":
        return {"q_weight": ((n, k), "int8"), "q_scale": ((n, k // g), preset.scale_dtype)}
    if preset.kind == "q4":
        return {
            "q_weight": ((n, k // numpy_ref.NIBBLES_PER_WORD), "uint32"),
            "q_scale": ((n, k // g), preset.scale_dtype),
            "q_min": ((n, k // g), preset.scale_dtype),
        }
    raise ValueError(f"preset {preset.name} stores float32 weights")


def quantizes(preset: QuantPreset, shape: tuple[int, ...]) -> bool:
    """Is a 2-D weight of this shape stored in the preset's format (else kept float32)?"""
    if preset.kind == "none" or len(shape) != 2:
        return False
    return preset.kind == "f16" or numpy_ref.is_quantizable(shape, preset.group_size)


def float_param_name(name: str) -> str:
    """The float param a (possibly quantized) param name stands for: `X.q_scale` -> `X.weight`."""
    for suffix in QUANT_SUFFIXES:
        if name.endswith("." + suffix):
            return name[: -len(suffix)] + "weight"
    return name


def is_embedding_weight(name: str) -> bool:
    """Is `name` the embedding table's or the lm_head's weight (stored in the preset's
    `for_embedding` format)? The rewrite asks the same of `<module name>.weight`."""
    return name == "lm_head.weight" or name.endswith("embed_tokens.weight")


def preset_for(preset: QuantPreset, name: str) -> QuantPreset:
    """The preset that stores the float param `name`."""
    return preset.for_embedding if is_embedding_weight(name) else preset


def weight_transform(preset: QuantPreset, name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """One float param -> the param(s) the rewritten module declares for it."""
    preset = preset_for(preset, name)
    if not (name.endswith(".weight") and quantizes(preset, array.shape)):
        return {name: np.ascontiguousarray(array, dtype=np.float32)}
    prefix = name[: -len("weight")]
    if preset.kind == "f16":
        return {name: np.ascontiguousarray(array, dtype=np.float16)}
    if preset.kind == "q8":
        codes, scale = numpy_ref.quantize_q8(array, name, preset.scale_dtype, preset.group_size)
        return {prefix + "q_weight": codes, prefix + "q_scale": scale}
    packed, scale, mins = numpy_ref.quantize_q4(array, name, preset.scale_dtype, preset.group_size)
    return {prefix + "q_weight": packed, prefix + "q_scale": scale, prefix + "q_min": mins}


def dequantize_params(preset: QuantPreset, params: dict[str, np.ndarray]) -> np.ndarray:
    """numpy: the float32 [N, K] weight a set of params from weight_transform stands for."""
    if preset.kind == "q4":
        return numpy_ref.dequantize_q4(*_by_suffix(params, "q_weight", "q_scale", "q_min"))
    if preset.kind == "q8":
        return numpy_ref.dequantize_q8(*_by_suffix(params, "q_weight", "q_scale"))
    (array,) = params.values()
    return array.astype(np.float32)


def _by_suffix(params: dict[str, np.ndarray], *suffixes: str) -> list[np.ndarray]:
    return [next(v for k, v in params.items() if k.endswith(s)) for s in suffixes]
