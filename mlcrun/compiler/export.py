"""ModelConfig -> relax IRModule exporting the ABI functions, with embedded metadata."""

from __future__ import annotations

import json
from typing import Any

import tvm
from tvm import relax

from .. import abi
from ..models.common import DecoderLM
from ..models.config import ModelConfig
from ..quant import get_preset
from ..quant.modules import quantize_model
from .kv_kernels import replace_kv_kernels
from .target import vector_bits
from .workarounds import fix_tree_attn_order


def export_model(
    cfg: ModelConfig,
    target: tvm.target.Target,
    quantization: str = "q0f32",
    activations: str = "exact",
    kv_dtype: str = "float32",
) -> tuple[tvm.IRModule, list[tuple[str, tuple[int, ...], str]]]:
    """The IRModule and its params as (name, shape, dtype), in the order functions take them.
    With a quantization preset, Linear/Embedding layers are rewritten first (quant/modules.py),
    so the params are the quantized ones (e.g. `X.q_weight`, `X.q_scale` for `X.weight`);
    `activations="int8"` makes q4/q8 layers quantize their inputs, "bf16" q0bf16 layers round
    theirs to bf16 (compile --activations);
    `kv_dtype` is the paged KV cache's dtype (compile --kv-dtype)."""
    with target:
        model = quantize_model(DecoderLM(cfg, kv_dtype), get_preset(quantization), activations)
        mod, params = model.export_tvm(spec=model.get_default_spec())
    mod = fix_tree_attn_order(mod)
    if target.kind.name == "llvm":
        mod = replace_kv_kernels(mod, cfg, kv_dtype, vector_bits(target))
    infos = [(name, tuple(int(d) for d in p.shape), str(p.dtype)) for name, p in params]
    return mod, infos


def attach_metadata(mod: tvm.IRModule, metadata: dict[str, Any]) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    with bb.function(abi.METADATA, params=[]):
        bb.emit_func_output(tvm.ir.StringImm(json.dumps(metadata, sort_keys=True)))
    mod = mod.clone() if hasattr(mod, "clone") else mod
    mod[abi.METADATA] = bb.finalize()[abi.METADATA]
    return mod
