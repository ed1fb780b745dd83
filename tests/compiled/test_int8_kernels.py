"""int8-activation kernels (compiler/schedules/int8.py) through the real pipeline, against the
numpy model of the same int8 math (quant/numpy_ref: quantize_activations, int8_linear), with
this CPU's best dot product (compiler/target.py int8_dot); every other one it can run (the
narrower VNNI form, AVX2's pair instructions) must give the same results bit for bit.

Odd shapes on purpose: N not a multiple of 16 (the last outputs run in scalar code), K a
multiple of 32 but not of 256, and M = 1..9 rows (every remainder of the 4-row micro-kernel),
17 and 64. The quantize kernel is bit-exact; the matmul is exact in int32 per group of 32 and
differs from numpy's float64 evaluation of the rest only by fp32 rounding (measured: at most
7e-7 of the largest output; the bound below is 3e-6).
"""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from kernel_blocks import PACKED, block_params, export_block, scheduled_forward  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.frontend import nn  # noqa: E402

from mlcrun.compiler.pipeline import get_pipeline  # noqa: E402
from mlcrun.compiler.schedules import cpu as cpu_rules  # noqa: E402
from mlcrun.compiler.target import cpu_target, int8_dot  # noqa: E402
from mlcrun.quant import get_preset, numpy_ref  # noqa: E402
from mlcrun.quant.modules import quantize_activations  # noqa: E402
from mlcrun.quant.transform import (  # noqa: E402
    dequantize_params,
    quant_suffixes,
    weight_transform,
)

pytestmark = pytest.mark.skipif(not int8_dot(cpu_target()), reason="this CPU has no AVX2 or VNNI")
RNG = np.random.default_rng(0)
ROWS = (*range(1, 10), 17, 64)
SHAPES = [(37, 96), (5, 32), (48, 288)]  # (N, K)
TOL = 3e-6  # of the largest |output|
NATIVE = int8_dot(cpu_target())
# The dot products a CPU with NATIVE can run (512-bit VNNI comes with the 256-bit EVEX form)
RUNNABLE = {"avx512vnni": ("avx512vnni", "avxvnni", "avx2"), "avxvnni": ("avxvnni", "avx2")}
OTHER_DOTS = RUNNABLE.get(NATIVE, (NATIVE,))[1:]
# What the matmul kernel's TVMScript calls for each dot product
INTRINSIC = {"avx512vnni": "vpdpbusd.512", "avxvnni": "vpdpbusd.256", "avx2": "pmadd.ub.sw"}


def _compile(preset: str, n: int, k: int, vocab: int):
    _, mod, named = export_block(preset, n, k, vocab, "int8")
    target = cpu_target()
    ex = tvm.compile(mod, target, relax_pipeline=get_pipeline(target))
    return relax.VirtualMachine(ex, tvm.cpu()), named


def _row_major(p, name: str, w: np.ndarray) -> tuple:
    out = weight_transform(p, name, w)
    return tuple(out[name.replace("weight", s)] for s in quant_suffixes(p))


def _run(vm, named, preset, n, k, vocab):
    p = get_preset(preset)
    floats, arrays, args = block_params(preset, "int8", named, n, k, vocab, RNG)
    for rows in ROWS:
        x = RNG.standard_normal((1, rows, k)).astype("float32")
        x[0, 0, :32] = 0.0  # a zero group
        r = RNG.standard_normal((1, rows, n)).astype("float32")
        got = vm["forward"](tvm.runtime.tensor(x), tvm.runtime.tensor(r), args).numpy()[0]
        want = r[0] + numpy_ref.int8_linear(
            x[0], p.kind, _row_major(p, "proj.weight", floats["proj.weight"])
        )
        want += floats["proj.bias"]
        assert np.abs(got - want).max() <= TOL * np.abs(want).max(), f"M={rows}"
        h = RNG.standard_normal((rows, k)).astype("float32")
        got = vm["head"](tvm.runtime.tensor(h), args).numpy()
        table = _row_major(p, "embed.weight", floats["embed.weight"])
        want = numpy_ref.int8_linear(h, p.kind, table)
        assert np.abs(got - want).max() <= TOL * np.abs(want).max(), f"head M={rows}"
    ids = np.array([0, vocab - 1, 5, 5], np.int32)
    table = {k: v for k, v in arrays.items() if k.startswith("embed.")}
    want = dequantize_params(p, table, "int8")[ids]
    got = vm["lookup"](tvm.runtime.tensor(ids), args).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # an fma may round once less


@pytest.mark.parametrize("preset", ["q4f16_1", "q4f32_1", "q4f16_0", "q8f32", "q8f16"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_kernels_match_the_numpy_int8_model(preset, n, k):
    vocab = n + 3  # the tied head has its own odd N
    vm, named = _compile(preset, n, k, vocab)
    _run(vm, named, preset, n, k, vocab)


@pytest.mark.parametrize("preset", ["q4f16_1", "q4f16_0", "q8f32", "q8f16"])
def test_reference_te_bodies_read_the_same_layout(monkeypatch, preset):
    """Without an int8 dot product the int8 ops run their TE bodies (modules.py), which index
    the codes and the panelled scales on their own: the same numpy model must hold for them
    (N = 37: a short last panel)."""
    monkeypatch.setattr(cpu_rules, "int8_dot", lambda target: "")
    vm, named = _compile(preset, 37, 96, 40)
    p = get_preset(preset)
    floats, _, args = block_params(preset, "int8", named, 37, 96, 40, RNG)
    x = RNG.standard_normal((1, 5, 96)).astype("float32")
    r = np.zeros((1, 5, 37), "float32")
    got = vm["forward"](tvm.runtime.tensor(x), tvm.runtime.tensor(r), args).numpy()[0]
    weights = _row_major(p, "proj.weight", floats["proj.weight"])
    want = numpy_ref.int8_linear(x[0], p.kind, weights) + floats["proj.bias"]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.skipif(not OTHER_DOTS, reason=f"this CPU runs only {NATIVE}")
@pytest.mark.parametrize("preset", ["q4f16_1", "q4f16_0", "q8f32", "q8f16"])
def test_every_dot_product_gives_the_same_results(monkeypatch, preset):
    """Targets with only AVX-VNNI get 256-bit vpdpbusd (two halves per 16-lane panel), those
    with only AVX2 vpmaddubsw + vpmaddwd (q4 summed in int16 per group, q8 by the sign trick
    from a zero start): all exact in int32, so equal to this CPU's own kernel bit for bit,
    over every remainder of the 4-row micro-kernel, odd N and extreme codes (activations
    +-127, q8 weights -127 and 127, q4 0 and 15)."""
    vms = {NATIVE: _compile(preset, 37, 96, 40)[0]}
    for dot in OTHER_DOTS:
        monkeypatch.setattr(cpu_rules, "int8_dot", lambda target, dot=dot: dot)
        vms[dot], named = _compile(preset, 37, 96, 40)
    p = get_preset(preset)
    arrays = {}
    for name, shape in (("proj.weight", (37, 96)), ("embed.weight", (40, 96))):
        w = RNG.standard_normal(shape).astype("float32")
        w[:, :32] = np.where(w[:, :32] > 0, 1.0, -1.0)  # the group's max and min codes
        arrays.update(weight_transform(p, name, w, "int8"))
    arrays["proj.bias"] = RNG.standard_normal(37).astype("float32")
    args = [tvm.runtime.tensor(arrays[name]) for name, _ in named]
    for rows in (1, 2, 3, 4, 6, 9):
        x = RNG.standard_normal((1, rows, 96)).astype("float32")
        x[0, :, :32] = np.where(RNG.random((rows, 32)) > 0.5, 3.0, -3.0)  # codes +-127
        x, r = tvm.runtime.tensor(x), tvm.runtime.tensor(np.zeros((1, rows, 37), "float32"))
        want = vms[NATIVE]["forward"](x, r, args).numpy()
        for dot in OTHER_DOTS:
            np.testing.assert_array_equal(vms[dot]["forward"](x, r, args).numpy(), want, dot)


class _Quantize(nn.Module):
    def __init__(self, kind: str, k: int) -> None:
        self.kind, self.k = kind, k

    def forward(self, x: nn.Tensor):
        return quantize_activations(self.kind, self.k, x)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 3, 40])  # serial below 32 rows, parallel above
def test_quantize_kernel_is_bit_exact(kind, rows):
    k = 96
    spec = {"forward": {"x": nn.spec.Tensor(["m", k], "float32"), "$": PACKED}}
    target = cpu_target()
    with target:
        mod, _ = _Quantize(kind, k).export_tvm(spec)
    vm = relax.VirtualMachine(
        tvm.compile(mod, target, relax_pipeline=get_pipeline(target)), tvm.cpu()
    )
    x = RNG.standard_normal((rows, k)).astype("float32") * 4
    x[0, 32:64] = 0.0
    x[-1, :32] = 1e-38
    codes, scale, sums = (t.numpy() for t in vm["forward"](tvm.runtime.tensor(x), []))
    want_codes, want_scale, want_sums = numpy_ref.quantize_activations(x)
    if kind == "q4":
        want_codes = numpy_ref.q4_activation_order(want_codes)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(sums, want_sums)


@pytest.mark.parametrize("preset", ["q4f16_1+q8f32", "q4f16_0+q8f32"])
def test_matmul_and_epilogue_are_one_kernel(preset):
    funcs = scheduled_forward(preset, "int8")
    matmuls = [name for name in funcs if "int8_matmul" in name]
    assert matmuls == ["fused_int8_matmul_add_add1"], sorted(funcs)  # bias + residual fused
    script = funcs[matmuls[0]].script()
    assert INTRINSIC[NATIVE] in script and "T.parallel" in script
    assert "matmul_intermediate" not in script  # the epilogue reads the accumulators
    assert funcs[matmuls[0]].attrs.get("tirx.is_scheduled")
    # each micro-kernel prefetches, per group and panel, a later tile's 256 weight bytes (4
    # lines) and the line of its scales (and of its mins)
    per_panel = 4 + (1 if preset.startswith("q4f16_0") else 2)
    prefetches = script.count("llvm.prefetch")
    assert prefetches and prefetches % per_panel == 0, prefetches
    # the quantize kernel's group max is a tree of vector maxima over halves (LLVM's
    # vector.reduce.fmax became a chain of 16 scalar steps)
    quantize = funcs["quantize_activations"]
    script = quantize.script()
    assert quantize.attrs.get("tirx.is_scheduled") and "T.Shuffle" in script
    assert "reduce.fmax" not in script
