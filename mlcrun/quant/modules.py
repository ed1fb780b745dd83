"""The module rewrite and the weight transform of a preset, keyed by the same param names.

`quantize_model` swaps every `nn.Linear` for a `QuantLinear` and every `nn.Embedding` for a
`QuantEmbedding`; `weight_transform` turns the float param of each into the params the new
module declares. Both decide from the same facts (preset, 2-D weight, K), so they agree:

    X.weight [N, K] f32 -> q4: X.q_weight [N, K/8] uint32, X.q_scale [N, K/32], X.q_min [N, K/32]
                           q8: X.q_weight [N, K] int8,     X.q_scale [N, K/32] f32
                           q0f16: X.weight [N, K] f16

`weight_transform` lives in quant/transform.py (numpy only) and is re-exported here. Layers
whose K is not a multiple of 32 stay float32 under q4/q8 (see numpy_ref's policy).

Kernels: a QuantLinear is one TE op, `dequantize_matmul`, with two stages -- `dequantize`
([N, K] float32 from the packed params) and the NT `matmul` reading it -- so FuseOps sees a
matmul-like PrimFunc and fuses bias/residual/activation epilogues into it, and the CPU schedule
(compiler/schedules/matmul.py) inlines the dequantize into the GEMV's loads (decode never
materializes a float matrix) or dequantizes one block of rows at a time for the GEMM (prefill).
"""

from __future__ import annotations

import logging

# isort: off
from .. import _tvm  # noqa: F401  (first: TVM without torch)

# isort: on
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from . import numpy_ref
from .presets import QuantPreset
from .transform import (
    dequantize_params,
    float_param_name,
    preset_for,
    quant_param_specs,
    quantizes,
    weight_transform,
)

__all__ = [
    "QuantEmbedding",
    "QuantLinear",
    "dequantize_params",
    "float_param_name",
    "quantize_model",
    "weight_transform",
]

LOG = logging.getLogger(__name__)
F32 = "float32"
# Set on the TE kernels made here: the compiler schedules them (it leaves other PrimFuncs that
# come with the exported module alone, e.g. the KV cache's).
SCHEDULABLE_ATTR = "mlcrun.schedulable"


# ----------------------------------------------------------------- TE compute
def _dequantize(preset: QuantPreset, w: list[te.Tensor], n, k) -> tirx.PrimExpr:
    """Element [n, k] of the float32 weight, read from the packed params."""
    g = preset.group_size
    if preset.kind == "f16":
        return w[0][n, k].astype(F32)
    if preset.kind == "q8":
        return w[0][n, k].astype(F32) * w[1][n, k // g].astype(F32)
    q, scale, mins = w
    shift = (k % numpy_ref.NIBBLES_PER_WORD).astype("uint32") * tirx.const(4, "uint32")
    code = (q[n, k // numpy_ref.NIBBLES_PER_WORD] >> shift) & tirx.const(15, "uint32")
    return code.astype(F32) * scale[n, k // g].astype(F32) + mins[n, k // g].astype(F32)


def dequantize_matmul(preset: QuantPreset, n: int, k: int, x: Tensor, *w: Tensor) -> Tensor:
    """x [..., K] f32 @ W.T, W [N, K] dequantized from `w`: one TE op (two stages)."""

    def compute(x_te: te.Tensor, *w_te: te.Tensor) -> te.Tensor:
        deq = te.compute(
            (n, k), lambda i, j: _dequantize(preset, list(w_te), i, j), name="dequantize"
        )
        r = te.reduce_axis((0, k), "k")
        return te.compute(
            (*x_te.shape[:-1], n),
            lambda *idx: te.sum(x_te[(*idx[:-1], r)] * deq[idx[-1], r], axis=r),
            name="matmul",
        )

    return op.tensor_expr_op(compute, "dequantize_matmul", [x, *w], attrs={SCHEDULABLE_ATTR: True})


def dequantize_take(preset: QuantPreset, num: int, dim: int, ids: Tensor, *w: Tensor) -> Tensor:
    """Rows `ids` [n] of the dequantized table -> [n, dim] f32 (ids clipped into range)."""

    def compute(ids_te: te.Tensor, *w_te: te.Tensor) -> te.Tensor:
        def row(i):
            return tirx.max(tirx.min(ids_te[i], num - 1), 0)

        return te.compute(
            (ids_te.shape[0], dim),
            lambda i, j: _dequantize(preset, list(w_te), row(i), j),
            name="dequantize_take",
        )

    return op.tensor_expr_op(compute, "dequantize_take", [ids, *w], attrs={SCHEDULABLE_ATTR: True})


# ----------------------------------------------------------------- modules
class _QuantWeight(nn.Module):
    """Params standing for a float [n, k] weight, declared in the order of quant_param_specs."""

    def _declare(self, preset: QuantPreset, n: int, k: int) -> None:
        self.preset = preset
        for suffix, (shape, dtype) in quant_param_specs(preset, n, k).items():
            setattr(self, suffix, nn.Parameter(shape, dtype))
        self._suffixes = tuple(quant_param_specs(preset, n, k))

    def _weights(self) -> list[Tensor]:
        return [getattr(self, s) for s in self._suffixes]


class QuantLinear(_QuantWeight):
    def __init__(self, in_features: int, out_features: int, bias: bool, preset: QuantPreset):
        self.in_features, self.out_features = in_features, out_features
        self._declare(preset, out_features, in_features)
        self.bias = nn.Parameter((out_features,), F32) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = dequantize_matmul(self.preset, self.out_features, self.in_features, x, *self._weights())
        return y + self.bias if self.bias is not None else y


class QuantEmbedding(_QuantWeight):
    """An embedding table in a quantized format; also serves as a tied lm_head."""

    def __init__(self, num: int, dim: int, preset: QuantPreset):
        self.num, self.dim = num, dim
        self._declare(preset, num, dim)

    def lookup(self, ids: Tensor) -> Tensor:
        """[n] int32 -> [n, dim] float32."""
        return dequantize_take(self.preset, self.num, self.dim, ids, *self._weights())

    def forward(self, ids: Tensor) -> Tensor:
        return self.lookup(ids)

    def lm_head_forward(self, x: Tensor) -> Tensor:
        """x [..., dim] -> logits [..., num]: x @ table.T with the dequantize fused in."""
        return dequantize_matmul(self.preset, self.num, self.dim, x, *self._weights())


class _Rewriter(nn.Mutator):
    def __init__(self, preset: QuantPreset) -> None:
        self.preset = preset
        self.kept: list[str] = []

    def visit_module(self, name: str, node: nn.Module):
        p = preset_for(self.preset, f"{name}.weight")
        if p.kind == "none" and isinstance(node, (nn.Linear, nn.Embedding)):
            return node  # float32 by choice (a mixed preset's q0f32 half)
        if isinstance(node, nn.Linear):
            k, n = int(node.in_features), int(node.out_features)
            if not quantizes(p, (n, k)):
                self.kept.append(name)
                return node
            return QuantLinear(k, n, node.bias is not None, p)
        if isinstance(node, nn.Embedding):
            num, dim = int(node.num), int(node.dim)
            if not quantizes(p, (num, dim)):
                self.kept.append(name)
                return node
            return QuantEmbedding(num, dim, p)
        return self.visit(name, node)


def quantize_model(model: nn.Module, preset: QuantPreset) -> nn.Module:
    """Rewrite `model` in place for `preset` and return it (unchanged for q0f32)."""
    if preset.kind == "none" and preset.for_embedding.kind == "none":
        return model
    rewriter = _Rewriter(preset)
    model = rewriter.visit("", model)
    if rewriter.kept:
        LOG.warning(
            "%s: kept %d layer(s) in float32 (K not a multiple of %d): %s",
            preset.name,
            len(rewriter.kept),
            preset.group_size,
            ", ".join(rewriter.kept),
        )
    return model
