"""The weight transform of a preset: one float param -> the params the rewritten module declares.

numpy only (no TVM), keyed by param names exactly as quant/modules.py's rewrite names them:

    X.weight [N, K] f32 -> q4: X.q_weight [N, K/8] uint32, X.q_scale [N, K/32], X.q_min [N, K/32]
                           q4f16_0 (symmetric): X.q_weight, X.q_scale (no q_min)
                           q8: X.q_weight [N, K] int8,     X.q_scale [N, K/32] f32
                           q0f16: X.weight [N, K] f16
                           q0bf16: X.weight [N, K] uint16 (bfloat16 bits)
    1-D params (norm weights, biases) stay float32.

With `activations="int8"` (presets.uses_int8) q4/q8 params come in the int8 kernels' layout
(numpy_ref.q4_to_int8_layout / q8_to_int8_layout): q_weight keeps its shape (q8: uint8 codes
+ 128), q_scale and q_min keep theirs, all with rows in panels of 16. `to_layout` converts row-major
params (from this transform or GGUF blocks) and `dequantize_params` reads either layout.
With `activations="bf16"` (presets.uses_bf16) a q0bf16 weight comes in panels of 16 rows x 2
K-elements (numpy_ref.tile_rows(., 2)), the bf16 kernels' layout, same shape.

Both sides decide from the same facts -- the preset, a 2-D `.weight`, its K -- so they agree
without either knowing the model: every 2-D weight of a model is a Linear's or an Embedding's.
Under q4/q8 a weight whose K is not a multiple of the group size (32) stays float32, and the
rewrite keeps that layer a plain float one (the policy of numpy_ref).
"""

from __future__ import annotations

import numpy as np

from . import numpy_ref
from .presets import QuantPreset, uses_bf16, uses_int8

QUANT_SUFFIXES = ("q_weight", "q_scale", "q_min")


def quant_param_specs(
    preset: QuantPreset, n: int, k: int, activations: str = "exact"
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Suffix -> (shape, dtype) of the params that replace a float [n, k] `weight`."""
    g = preset.group_size
    if preset.kind == "f16":
        return {"weight": ((n, k), "float16")}
    if preset.kind == "bf16":
        return {"weight": ((n, k), "uint16")}  # panels or row-major: the same shape
    if preset.kind not in ("q4", "q8"):
        raise ValueError(f"preset {preset.name} stores float32 weights")
    int8 = uses_int8(preset, activations)
    scales = ((n, k // g), preset.scale_dtype)  # int8 layout: in panels, the same shape
    if preset.kind == "q8":
        codes = ((n, k), "uint8" if int8 else "int8")
    else:
        codes = ((n, k // numpy_ref.NIBBLES_PER_WORD), "uint32")
    specs = {"q_weight": codes, "q_scale": scales, "q_min": scales}
    return {suffix: specs[suffix] for suffix in quant_suffixes(preset)}


def quant_suffixes(preset: QuantPreset) -> tuple[str, ...]:
    """The suffixes of the params that replace a q4/q8 `weight`, in declaration order: q4
    with a min per group, q_weight, q_scale, q_min; q8 and the symmetric q4, no q_min."""
    if preset.kind == "q4" and not preset.symmetric:
        return QUANT_SUFFIXES
    return QUANT_SUFFIXES[:2]


def bf16_panels(preset: QuantPreset, k: int, activations: str) -> bool:
    """Is a q0bf16 weight with K columns stored in (and multiplied by) the bf16 kernels' panel
    layout? With bf16 activations and an even K (the kernel reads K in pairs)."""
    return uses_bf16(preset, activations) and k % 2 == 0


def quantizes(preset: QuantPreset, shape: tuple[int, ...]) -> bool:
    """Is a 2-D weight of this shape stored in the preset's format (else kept float32)?"""
    if preset.kind == "none" or len(shape) != 2:
        return False
    return preset.kind in ("f16", "bf16") or numpy_ref.is_quantizable(shape, preset.group_size)


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


def weight_transform(
    preset: QuantPreset, name: str, array: np.ndarray, activations: str = "exact"
) -> dict[str, np.ndarray]:
    """One float param -> the param(s) the rewritten module declares for it."""
    preset = preset_for(preset, name)
    if not (name.endswith(".weight") and quantizes(preset, array.shape)):
        return {name: np.ascontiguousarray(array, dtype=np.float32)}
    prefix = name[: -len("weight")]
    if preset.kind == "f16":
        return {name: np.ascontiguousarray(array, dtype=np.float16)}
    if preset.kind == "bf16":
        bits = numpy_ref.to_bf16(array)
        panels = bf16_panels(preset, array.shape[1], activations)
        return {name: numpy_ref.tile_rows(bits, 2) if panels else bits}
    if preset.kind == "q8":
        quantize = numpy_ref.quantize_q8
    else:
        quantize = numpy_ref.quantize_q4_sym if preset.symmetric else numpy_ref.quantize_q4
    arrays = quantize(array, name, preset.scale_dtype, preset.group_size)
    suffixes = quant_suffixes(preset)
    params = {prefix + s: a for s, a in zip(suffixes, arrays, strict=True)}
    return to_layout(preset, params, activations)


def to_layout(
    preset: QuantPreset, params: dict[str, np.ndarray], activations: str
) -> dict[str, np.ndarray]:
    """Row-major q4/q8 params (names ending in q_weight, q_scale[, q_min]) -> the layout the
    kernels for `activations` read; other params, and the exact layout, pass unchanged."""
    if not uses_int8(preset, activations) or not any(k.endswith(".q_weight") for k in params):
        return params
    names = _names_by_suffix(params, *quant_suffixes(preset))
    arrays = [params[n] for n in names]
    if preset.kind == "q8":
        converted = numpy_ref.q8_to_int8_layout(*arrays)
    else:
        converted = numpy_ref.q4_to_int8_layout(*arrays)
    return {**params, **dict(zip(names, converted, strict=True))}


def dequantize_params(
    preset: QuantPreset, params: dict[str, np.ndarray], activations: str = "exact"
) -> np.ndarray:
    """numpy: the float32 [N, K] weight a set of params from weight_transform (with the same
    `activations`) stands for."""
    if preset.kind in ("q4", "q8"):
        arrays = [params[n] for n in _names_by_suffix(params, *quant_suffixes(preset))]
        if uses_int8(preset, activations):
            if preset.kind == "q8":
                arrays = list(numpy_ref.q8_from_int8_layout(*arrays))
            else:
                arrays = list(numpy_ref.q4_from_int8_layout(*arrays))
        if preset.kind == "q4":
            return numpy_ref.dequantize_q4(*arrays)
        return numpy_ref.dequantize_q8(*arrays)
    (array,) = params.values()
    if preset.kind == "bf16":
        if bf16_panels(preset, array.shape[1], activations):
            array = numpy_ref.untile_rows(array, 2)
        return numpy_ref.from_bf16(array)
    return array.astype(np.float32)


def _names_by_suffix(params: dict[str, np.ndarray], *suffixes: str) -> list[str]:
    return [next(k for k in params if k.endswith(s)) for s in suffixes]
