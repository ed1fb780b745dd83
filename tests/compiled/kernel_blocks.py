"""The one-layer module the matmul kernel tests compile (test_quant_kernels, test_int8_kernels,
test_bf16_kernels): y = r + proj(x) with bias and residual fused after the matmul, and a table
[vocab, k] serving as a tied lm_head and for lookups, exported with a symbolic row count."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx
from tvm.relax.frontend import nn

from mlcrun.compiler.pipeline import scheduled_tir_passes
from mlcrun.compiler.target import cpu_target
from mlcrun.quant import get_preset
from mlcrun.quant.modules import quantize_model
from mlcrun.quant.transform import weight_transform

PACKED = {"param_mode": "packed", "effect_mode": "none"}


class Block(nn.Module):
    def __init__(self, n: int, k: int, vocab: int) -> None:
        self.proj = nn.Linear(k, n, bias=True)
        self.embed = nn.Embedding(vocab, k)

    def forward(self, x: nn.Tensor, r: nn.Tensor) -> nn.Tensor:
        return r + self.proj(x)

    def head(self, h: nn.Tensor) -> nn.Tensor:
        return self.embed.lm_head_forward(h)

    def lookup(self, ids: nn.Tensor) -> nn.Tensor:
        return self.embed.lookup(ids)


def export_block(
    preset: str,
    n: int,
    k: int,
    vocab: int,
    activations: str = "exact",
    functions: tuple[str, ...] = ("forward", "head", "lookup"),
    target: tvm.target.Target | None = None,
):
    """(the quantized module, its IRModule, its named params) for `target` (the CPU's)."""
    model = quantize_model(Block(n, k, vocab), get_preset(preset), activations)
    spec = {
        "forward": {
            "x": nn.spec.Tensor([1, "m", k], "float32"),
            "r": nn.spec.Tensor([1, "m", n], "float32"),
            "$": PACKED,
        },
        "head": {"h": nn.spec.Tensor(["m", k], "float32"), "$": PACKED},
        "lookup": {"ids": nn.spec.Tensor(["m"], "int32"), "$": PACKED},
    }
    with target or cpu_target():
        mod, named = model.export_tvm({name: spec[name] for name in functions})
    return model, mod, named


def scheduled_forward(preset: str, activations: str) -> dict[str, tirx.PrimFunc]:
    """The PrimFuncs of a 37 x 96 block's forward after the CPU schedule rules, by name."""
    _, mod, _ = export_block(preset, 37, 96, 40, activations, functions=("forward",))
    target = cpu_target()
    with target:
        mod = tvm.transform.Sequential(scheduled_tir_passes(target))(mod)
    return {g.name_hint: f for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def block_params(preset: str, activations: str, named, n: int, k: int, vocab: int, rng):
    """Random float weights of a Block, their stored params by name (for `preset` and
    `activations`), and those params in the compiled module's `named` order."""
    p = get_preset(preset)
    floats = {
        "proj.weight": rng.standard_normal((n, k)).astype("float32"),
        "proj.bias": rng.standard_normal(n).astype("float32"),
        "embed.weight": rng.standard_normal((vocab, k)).astype("float32"),
    }
    arrays: dict[str, np.ndarray] = {}
    for name, w in floats.items():
        arrays.update(weight_transform(p, name, w, activations))
    return floats, arrays, [tvm.runtime.tensor(arrays[name]) for name, _ in named]
