"""The module rewrite and the weight transform of a preset, keyed by the same param names.

`quantize_model` swaps every `nn.Linear` for a `QuantLinear` and every `nn.Embedding` for a
`QuantEmbedding`; `weight_transform` turns the float param of each into the params the new
module declares. Both decide from the same facts (preset, 2-D weight, K), so they agree:

    X.weight [N, K] f32 -> q4: X.q_weight [N, K/8] uint32, X.q_scale [N, K/32], X.q_min [N, K/32]
                           q4f16_0 (symmetric): X.q_weight, X.q_scale (no q_min)
                           q8: X.q_weight [N, K] int8,     X.q_scale [N, K/32] f32
                           q0f16: X.weight [N, K] f16
                           q0bf16: X.weight [N, K] uint16 (bfloat16 bits)

`weight_transform` lives in quant/transform.py (numpy only) and is re-exported here. Layers
whose K is not a multiple of 32 stay float32 under q4/q8 (see numpy_ref's policy).

Kernels: a QuantLinear is one TE op, `dequantize_matmul`, with two stages -- `dequantize`
([N, K] float32 from the packed params) and the NT `matmul` reading it -- so FuseOps sees a
matmul-like PrimFunc and fuses bias/residual/activation epilogues into it, and the CPU schedule
(compiler/schedules/matmul.py) inlines the dequantize into the GEMV's loads (decode never
materializes a float matrix) or dequantizes one block of rows at a time for the GEMM (prefill).

With int8 activations (`activations="int8"`, presets.uses_int8) a q4/q8 QuantLinear is two TE
ops instead: `quantize_activations` (x -> int8 codes, a scale and the exact code sum per row and
group of 32; opaque, so nothing fuses into it) and `int8_matmul` (a reduction over the codes and
the weights in the int8 layout, which FuseOps fuses epilogues into like any matmul). Their TE
bodies are the reference semantics (correct, slow); compiler/schedules/int8.py recognises them
by the INT8_ATTR block annotation and replaces the bodies with VNNI or AVX2 kernels.

With bf16 activations (`activations="bf16"`, transform.bf16_panels) a q0bf16 QuantLinear is
likewise two TE ops: `bf16_activations` (x -> bf16 bits, opaque) and `bf16_matmul` (over the
bits and the weights in panels of 16 rows x 2 K-elements), recognised by BF16_ATTR and
replaced with vdpbf16ps kernels by compiler/schedules/bf16.py.
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
from .presets import GROUP_SIZE, QuantPreset, uses_int8
from .transform import (
    bf16_panels,
    dequantize_params,
    float_param_name,
    preset_for,
    quant_param_specs,
    quantizes,
    weight_transform,
)

__all__ = [
    "INT8_ATTR",
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
# Block annotation of the int8-activation TE ops: "quantize_q4", "quantize_q8", "matmul_q4",
# "matmul_q4_sym" (the symmetric q4: no mins), "matmul_q8" (compiler/schedules/int8.py
# generates their kernels).
INT8_ATTR = "mlcrun.int8"
# Block annotation of the bf16-activation TE ops: "round" (x -> bf16 bits) and "matmul"
# (compiler/schedules/bf16.py generates their kernels).
BF16_ATTR = "mlcrun.bf16"


# ----------------------------------------------------------------- TE compute
def _tiled(n, col, rows: int, cols: int, unit: int) -> tuple:
    """Index into an [rows, cols] param stored by numpy_ref.tile_rows(., unit) of the row-major
    element [n, col]: panels of PANEL rows (the last one may be shorter) stored column-major in
    groups of `unit` columns."""
    panel = numpy_ref.PANEL
    full = rows - rows % panel
    dtype = str(n.ty)
    height = tirx.Select(n < full, tirx.const(panel, dtype), tirx.const(rows - full, dtype))
    offset = (
        (n // panel) * (panel * cols)
        + (col // unit) * (height * unit)
        + (n % panel) * unit
        + col % unit
    )
    return offset // cols, offset % cols


def _dequantize(preset: QuantPreset, w: list[te.Tensor], n, k, int8: bool = False) -> tirx.PrimExpr:
    """Element [n, k] of the float32 weight, read from the packed params (in the int8 or bf16
    kernels' panel layout when `int8`)."""
    g = preset.group_size
    if preset.kind == "f16":
        return w[0][n, k].astype(F32)
    rows, cols = (int(d) for d in w[0].shape)
    if preset.kind == "bf16":  # the float32 whose top half the bits are
        bits = w[0][_tiled(n, k, rows, cols, 2)] if int8 else w[0][n, k]
        return tirx.reinterpret(F32, bits.astype("uint32") << tirx.const(16, "uint32"))
    if preset.kind == "q8":
        if int8:  # uint8 codes + 128, codes and scales in panels
            code = w[0][_tiled(n, k, rows, cols, 4)].astype("int32") - 128
            scale = w[1][_tiled(n, k // g, rows, int(w[1].shape[1]), 1)]
            return code.astype(F32) * scale.astype(F32)
        return w[0][n, k].astype(F32) * w[1][n, k // g].astype(F32)
    q, *scales = w  # scale[, min]: [N, K/32] (in panels in the int8 layout)
    per = numpy_ref.NIBBLES_PER_WORD
    shift = (k % per).astype("uint32") * tirx.const(4, "uint32")
    word = q[_tiled(n, k // per, rows, cols, 1)] if int8 else q[n, k // per]
    code = ((word >> shift) & tirx.const(15, "uint32")).astype(F32)
    groups = int(scales[0].shape[1])
    scale, *mins = (s[_tiled(n, k // g, rows, groups, 1)] if int8 else s[n, k // g] for s in scales)
    if preset.symmetric:  # w = (q - 8) * scale
        return (code - tirx.const(numpy_ref.Q4_ZERO, F32)) * scale.astype(F32)
    return code * scale.astype(F32) + mins[0].astype(F32)


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


def dequantize_take(
    preset: QuantPreset, num: int, dim: int, ids: Tensor, *w: Tensor, int8: bool = False
) -> Tensor:
    """Rows `ids` [n] of the dequantized table -> [n, dim] f32 (ids clipped into range)."""

    def compute(ids_te: te.Tensor, *w_te: te.Tensor) -> te.Tensor:
        def row(i):
            return tirx.max(tirx.min(ids_te[i], num - 1), 0)

        return te.compute(
            (ids_te.shape[0], dim),
            lambda i, j: _dequantize(preset, list(w_te), row(i), j, int8),
            name="dequantize_take",
        )

    return op.tensor_expr_op(compute, "dequantize_take", [ids, *w], attrs={SCHEDULABLE_ATTR: True})


def _activation_source(kind: str, pos):
    """The element of x whose code the int8 kernels keep at position `pos` of a row: q8 keeps
    the order; q4 stores each word's 8 elements even ones first (numpy_ref.q4_activation_order)."""
    if kind == "q8":
        return pos
    c = pos % numpy_ref.NIBBLES_PER_WORD
    return pos - c + (c % 4) * 2 + c // 4


def _activation_position(kind: str, elem):
    """Where the `kind` kernel keeps the code of element `elem` (the inverse of the above)."""
    if kind == "q8":
        return elem
    j = elem % numpy_ref.NIBBLES_PER_WORD
    return elem - j + j // 2 + (j % 2) * 4


def quantize_activations(kind: str, k: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [..., K] f32 -> (codes [..., K] int8 in the `kind` kernel's order, scale [..., K/32]
    f32, sums [..., K/32] int32): numpy_ref.quantize_activations, one opaque TE op."""
    g = GROUP_SIZE

    def compute(x_te: te.Tensor) -> list[te.Tensor]:
        lead = list(x_te.shape[:-1])
        j = te.reduce_axis((0, g), "j")
        amax = te.compute(
            (*lead, k // g),
            lambda *i: te.max(tirx.abs(x_te[(*i[:-1], i[-1] * g + j)]), axis=j),
            name="amax",
        )

        def code(*i):
            src = _activation_source(kind, i[-1])
            a = amax[(*i[:-1], src // g)]
            inv = tirx.Select(
                a >= tirx.const(numpy_ref.AMAX_FLOOR, F32), tirx.const(127, F32) / a, 0.0
            )
            v = tirx.nearbyint(x_te[(*i[:-1], src)] * inv)
            return tirx.max(tirx.min(v, 127.0), -127.0).astype("int8")

        codes = te.compute((*lead, k), code, name="codes", attrs={INT8_ATTR: f"quantize_{kind}"})
        r = te.reduce_axis((0, g), "r")
        sums = te.compute(
            (*lead, k // g),
            lambda *i: te.sum(codes[(*i[:-1], i[-1] * g + r)].astype("int32"), axis=r),
            name="sums",
        )
        scale = te.compute((*lead, k // g), lambda *i: amax[i] / tirx.const(127, F32), name="scale")
        return [codes, scale, sums]

    attrs = {SCHEDULABLE_ATTR: True, "op_pattern": 8}  # opaque: producers stay separate
    codes, scale, sums = op.tensor_expr_op(compute, "quantize_activations", [x], attrs=attrs)
    return codes, scale, sums


def int8_matmul(preset: QuantPreset, n: int, k: int, x: Tensor, *w: Tensor) -> Tensor:
    """x [..., K] f32 @ W.T with x quantized to int8 (quantize_activations) and W in the int8
    layout. The TE body states the math in float (codes * scale, dequantized weights); the
    compiled kernel computes the same sum with exact int32 dot products per group."""
    kind, g = preset.kind, preset.group_size
    codes, scale, sums = quantize_activations(kind, k, x)

    def compute(c_te, s_te, sums_te, *w_te):
        r = te.reduce_axis((0, k), "k")

        def body(*idx):
            lead, col = idx[:-1], idx[-1]
            a = c_te[(*lead, _activation_position(kind, r))].astype(F32) * s_te[(*lead, r // g)]
            return te.sum(a * _dequantize(preset, list(w_te), col, r, int8=True), axis=r)

        out_shape = (*c_te.shape[:-1], n)
        attr = f"matmul_{kind}_sym" if preset.symmetric else f"matmul_{kind}"
        return te.compute(out_shape, body, name="matmul", attrs={INT8_ATTR: attr})

    args = [codes, scale, sums, *w]
    return op.tensor_expr_op(compute, "int8_matmul", args, attrs={SCHEDULABLE_ATTR: True})


def round_to_bf16(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """float32 -> bfloat16 bits (uint16) as vcvtne2ps2bf16 rounds: nearest even, denormal
    inputs flushed to (signed) zero, NaN kept a quiet NaN (numpy_ref.bf16_activations)."""
    u32 = "uint32"
    bits = tirx.reinterpret(u32, x)

    def c(v):
        return tirx.const(v, u32)

    rounded = (bits + c(0x7FFF) + ((bits >> c(16)) & c(1))) >> c(16)
    value = tirx.Select((bits & c(0x7FFFFFFF)) > c(0x7F800000), (bits >> c(16)) | c(0x40), rounded)
    value = tirx.Select((bits & c(0x7F800000)) == c(0), (bits >> c(16)) & c(0x8000), value)
    return value.astype("uint16")


def bf16_activations(k: int, x: Tensor) -> Tensor:
    """x [..., K] f32 -> [..., K] uint16 bf16 bits (round_to_bf16), one opaque TE op."""

    def compute(x_te: te.Tensor) -> te.Tensor:
        return te.compute(
            x_te.shape,
            lambda *i: round_to_bf16(x_te[i]),
            name="bf16_round",
            attrs={BF16_ATTR: "round"},
        )

    attrs = {SCHEDULABLE_ATTR: True, "op_pattern": 8}  # opaque: producers stay separate
    return op.tensor_expr_op(compute, "bf16_activations", [x], attrs=attrs)


def bf16_matmul(preset: QuantPreset, n: int, k: int, x: Tensor, *w: Tensor) -> Tensor:
    """x [..., K] f32 @ W.T with x rounded to bf16 (bf16_activations) and W the bf16 bits in
    panels (numpy_ref.tile_rows(., 2)). The TE body sums the exact float products in order;
    the kernel (vdpbf16ps) sums the same products in pairs."""
    bits = bf16_activations(k, x)

    def compute(a_te, *w_te):
        r = te.reduce_axis((0, k), "k")

        def body(*idx):
            lead, col = idx[:-1], idx[-1]
            a = tirx.reinterpret(F32, a_te[(*lead, r)].astype("uint32") << tirx.const(16, "uint32"))
            return te.sum(a * _dequantize(preset, list(w_te), col, r, int8=True), axis=r)

        out_shape = (*a_te.shape[:-1], n)
        return te.compute(out_shape, body, name="matmul", attrs={BF16_ATTR: "matmul"})

    return op.tensor_expr_op(compute, "bf16_matmul", [bits, *w], attrs={SCHEDULABLE_ATTR: True})


# ----------------------------------------------------------------- modules
class _QuantWeight(nn.Module):
    """Params standing for a float [n, k] weight, declared in the order of quant_param_specs."""

    def _declare(self, preset: QuantPreset, n: int, k: int, activations: str) -> None:
        self.preset = preset
        self.int8 = uses_int8(preset, activations)  # int8 activations, int8 weight layout
        self.bf16 = bf16_panels(preset, k, activations)  # bf16 activations, panel layout
        specs = quant_param_specs(preset, n, k, activations)
        for suffix, (shape, dtype) in specs.items():
            setattr(self, suffix, nn.Parameter(shape, dtype))
        self._suffixes = tuple(specs)

    def _weights(self) -> list[Tensor]:
        return [getattr(self, s) for s in self._suffixes]

    def _matmul(self):
        if self.int8:
            return int8_matmul
        return bf16_matmul if self.bf16 else dequantize_matmul


class QuantLinear(_QuantWeight):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        preset: QuantPreset,
        activations: str = "exact",
    ):
        self.in_features, self.out_features = in_features, out_features
        self._declare(preset, out_features, in_features, activations)
        self.bias = nn.Parameter((out_features,), F32) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = self._matmul()(self.preset, self.out_features, self.in_features, x, *self._weights())
        return y + self.bias if self.bias is not None else y


class QuantEmbedding(_QuantWeight):
    """An embedding table in a quantized format; also serves as a tied lm_head."""

    def __init__(self, num: int, dim: int, preset: QuantPreset, activations: str = "exact"):
        self.num, self.dim = num, dim
        self._declare(preset, num, dim, activations)

    def lookup(self, ids: Tensor) -> Tensor:
        """[n] int32 -> [n, dim] float32."""
        weights = self._weights()
        packed = self.int8 or self.bf16
        return dequantize_take(self.preset, self.num, self.dim, ids, *weights, int8=packed)

    def forward(self, ids: Tensor) -> Tensor:
        return self.lookup(ids)

    def lm_head_forward(self, x: Tensor) -> Tensor:
        """x [..., dim] -> logits [..., num]: x @ table.T with the dequantize fused in."""
        return self._matmul()(self.preset, self.num, self.dim, x, *self._weights())


class _Rewriter(nn.Mutator):
    def __init__(self, preset: QuantPreset, activations: str) -> None:
        self.preset, self.activations = preset, activations
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
            return QuantLinear(k, n, node.bias is not None, p, self.activations)
        if isinstance(node, nn.Embedding):
            num, dim = int(node.num), int(node.dim)
            if not quantizes(p, (num, dim)):
                self.kept.append(name)
                return node
            return QuantEmbedding(num, dim, p, self.activations)
        return self.visit(name, node)


def quantize_model(model: nn.Module, preset: QuantPreset, activations: str = "exact") -> nn.Module:
    """Rewrite `model` in place for `preset` and return it (unchanged for q0f32). With
    `activations="int8"` the q4/q8 layers quantize their inputs to int8 (module docstring)."""
    if preset.kind == "none" and preset.for_embedding.kind == "none":
        return model
    rewriter = _Rewriter(preset, activations)
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
