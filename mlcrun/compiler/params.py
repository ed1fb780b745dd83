"""The weights half of a compile: source tensors -> the artifact's param shards.

Each param of the weight map is produced one of two ways:

* exactly, when the source stores it in blocks the preset holds bit for bit (GGUF Q4_0/Q4_1
  under a q4 preset, Q8_0 under q8f16: quant/gguf_blocks.py) and the rule only stacks rows;
* otherwise as float32 through the weight map, then the preset's weight transform.

`resolve_quantization` turns `auto` into the preset that keeps the source's storage exact.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .. import artifact
from ..errors import MlcrunError
from ..quant import QuantPreset, get_preset
from ..quant.gguf_blocks import auto_preset, exact_params
from ..quant.modules import float_param_name, weight_transform
from ..quant.transform import is_embedding_weight, preset_for, to_layout
from ..weights.mapping import ParamRule, TensorSource, WeightMap, convert_rule, is_row_wise

log = logging.getLogger(__name__)

SHARD_BYTES = 1 << 30


def resolve_quantization(requested: str, source: TensorSource) -> str:
    """`auto` -> the preset for the source's dominant 2-D weight storage type; else as is."""
    if requested != "auto":
        return requested
    layers: dict[str, int] = {}
    tables: dict[str, int] = {}
    for name in source.names():
        shape = source.shape(name)
        if len(shape) == 2:
            counts = tables if is_embedding_weight(name) else layers
            kind = source.dtype(name)
            counts[kind] = counts.get(kind, 0) + int(np.prod(shape))
    preset = auto_preset(layers, tables)
    log.info("--quantization auto: %s (layers %s, embedding %s)", preset, layers, tables)
    return preset


def float_param_names(params) -> list[str]:
    """The weight map's (float) param names behind the exported, possibly quantized, params."""
    return list(dict.fromkeys(float_param_name(name) for name, _, _ in params))


def exact_rule_params(preset: QuantPreset, rule: ParamRule, source) -> dict | None:
    """The preset's params for `rule` straight from the source's stored blocks, or None."""
    if not (hasattr(source, "raw") and rule.name.endswith(".weight") and is_row_wise(rule)):
        return None
    parts = []
    for name in rule.sources:
        ggml_type, data = source.raw(name)
        part = exact_params(preset_for(preset, rule.name), ggml_type, data)
        if part is None:
            return None
        parts.append(part)
    prefix = rule.name[: -len("weight")]
    return {prefix + key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def write_params(
    tmp: Path,
    source,
    wmap: WeightMap,
    params,
    quantization: str,
    progress,
    activations: str = "exact",
) -> list[Path]:
    """Produce every param (exactly where possible) and write the shards, each array checked
    against the exported params' names, shapes and dtypes; q4/q8 params in the layout of the
    kernels for `activations` (the same values either way)."""
    preset = get_preset(quantization)
    expected = {name: (shape, dtype) for name, shape, dtype in params}
    wanted = set(float_param_names(params))
    params_dir = tmp / artifact.PARAMS_DIR
    params_dir.mkdir()
    progress.phase("Converting weights", total=len(wanted))
    files, shard, shard_bytes, written, exact = [], {}, 0, set(), 0

    def flush():
        nonlocal shard, shard_bytes
        path = params_dir / f"params-{len(files):05d}.safetensors"
        save_file(shard, str(path))
        files.append(path)
        shard, shard_bytes = {}, 0

    for rule in wmap.rules:
        if rule.name not in wanted:
            continue
        arrays = exact_rule_params(preset, rule, source)
        if arrays is None:
            arrays = weight_transform(preset, rule.name, convert_rule(source, rule), activations)
        else:  # row-major blocks of all the rule's sources: reorder once they are stacked
            arrays = to_layout(preset_for(preset, rule.name), arrays, activations)
            exact += 1
        for name, array in arrays.items():
            if name not in expected:
                raise MlcrunError(f"{quantization}: param {name!r} is not one of the model's")
            shape, dtype = expected[name]
            if tuple(array.shape) != shape or str(array.dtype) != dtype:
                raise MlcrunError(
                    f"param {name!r}: converted {list(array.shape)} {array.dtype} != "
                    f"{list(shape)} {dtype}"
                )
            shard[name] = np.ascontiguousarray(array)
            shard_bytes += shard[name].nbytes
            written.add(name)
        progress.advance()
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    missing = [name for name in expected if name not in written]
    if missing:
        raise MlcrunError(f"{quantization}: no weight produces param {missing[0]!r}")
    if exact:
        log.info("%d of %d weights kept bit-exact from the source blocks", exact, len(wanted))
    progress.done()
    return files
