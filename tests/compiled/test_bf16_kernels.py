"""bf16-activation kernels (compiler/schedules/bf16.py) through the real pipeline, against the
numpy model of the same arithmetic (quant/numpy_ref: bf16_activations, bf16_linear).

Odd shapes on purpose: N not a multiple of 16 (the last outputs run in scalar code, the tied
head's too), K a multiple of 32, M in 1, 3, 8, 17 (remainders of the 4-row micro-kernel), 64,
and, where the target has AMX, 33 and 102 (32-row AMX blocks, then the rows past the last
block and an odd last panel through the micro-kernels). The rounding kernel is bit-exact
(denormals flushed as vcvtne2ps2bf16 does); the matmul sums the same exact products as numpy
in another order (pairs per lane, or per tile), so it differs by fp32 summation only (bound:
2e-6 of the largest output).
"""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from kernel_blocks import PACKED, block_params, export_block, scheduled_forward  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.frontend import nn  # noqa: E402

from mlcrun.compiler.pipeline import get_pipeline  # noqa: E402
from mlcrun.compiler.target import amx_bf16, bf16_dot_bits, cpu_target  # noqa: E402
from mlcrun.quant import get_preset, numpy_ref  # noqa: E402
from mlcrun.quant.modules import bf16_activations  # noqa: E402
from mlcrun.quant.transform import dequantize_params  # noqa: E402

pytestmark = pytest.mark.skipif(
    not bf16_dot_bits(cpu_target()), reason="this CPU has no AVX512-BF16"
)
RNG = np.random.default_rng(0)
ROWS = (1, 3, 8, 17, 64) + ((33, 102) if amx_bf16(cpu_target()) else ())
SHAPES = [(37, 96), (5, 32), (48, 288), (200, 64)]  # (N, K)
TOL = 2e-6  # of the largest |output|


def _compile(n: int, k: int, vocab: int):
    _, mod, named = export_block("q0bf16", n, k, vocab, "bf16")
    target = cpu_target()
    ex = tvm.compile(mod, target, relax_pipeline=get_pipeline(target))
    return relax.VirtualMachine(ex, tvm.cpu()), named


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_bf16_kernels_match_the_numpy_bf16_model(n, k):
    vocab = n + 3  # the tied head has its own odd N
    vm, named = _compile(n, k, vocab)
    p = get_preset("q0bf16")
    floats, arrays, args = block_params("q0bf16", "bf16", named, n, k, vocab, RNG)
    w_bits = numpy_ref.to_bf16(floats["proj.weight"])
    table_bits = numpy_ref.to_bf16(floats["embed.weight"])
    for rows in ROWS:
        x = RNG.standard_normal((1, rows, k)).astype("float32")
        x[0, 0, :5] = [1e-39, -1e-40, 0.0, np.float32(1 + 2**-8), 3e-38]  # denormals, a tie
        r = RNG.standard_normal((1, rows, n)).astype("float32")
        got = vm["forward"](tvm.runtime.tensor(x), tvm.runtime.tensor(r), args).numpy()[0]
        want = r[0] + (numpy_ref.bf16_linear(x[0], w_bits) + floats["proj.bias"])
        assert np.abs(got - want).max() <= TOL * np.abs(want).max(), f"M={rows}"
        h = RNG.standard_normal((rows, k)).astype("float32")
        got = vm["head"](tvm.runtime.tensor(h), args).numpy()
        want = numpy_ref.bf16_linear(h, table_bits)
        assert np.abs(got - want).max() <= TOL * np.abs(want).max(), f"head M={rows}"
    ids = np.array([0, vocab - 1, 5, 5], np.int32)
    table = {key: v for key, v in arrays.items() if key.startswith("embed.")}
    want = dequantize_params(p, table, "bf16")[ids]
    np.testing.assert_array_equal(vm["lookup"](tvm.runtime.tensor(ids), args).numpy(), want)


class _Round(nn.Module):
    def __init__(self, k: int) -> None:
        self.k = k

    def forward(self, x: nn.Tensor):
        return bf16_activations(self.k, x)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_round_kernel_is_bit_exact(rows):
    k = 96
    spec = {"forward": {"x": nn.spec.Tensor(["m", k], "float32"), "$": PACKED}}
    target = cpu_target()
    with target:
        mod, _ = _Round(k).export_tvm(spec)
    ex = tvm.compile(mod, target, relax_pipeline=get_pipeline(target))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = RNG.standard_normal((rows, k)).astype("float32") * 10.0 ** RNG.integers(-40, 38, (rows, k))
    x = x.astype("float32")
    x[0, :8] = [1e-39, -1e-40, 0.0, -0.0, np.inf, -np.inf, 1 + 2**-8, 1 + 3 * 2**-8]
    x[0, 8] = np.float32(3.4e38)
    got = vm["forward"](tvm.runtime.tensor(x), []).numpy()
    np.testing.assert_array_equal(got, numpy_ref.bf16_activations(x))
    assert got[0, 0] == 0 and got[0, 1] == 0x8000  # denormals flushed, sign kept


def test_matmul_and_epilogue_are_one_vdpbf16ps_kernel():
    funcs = scheduled_forward("q0bf16", "bf16")
    matmuls = [name for name in funcs if "bf16_matmul" in name]
    assert matmuls == ["fused_bf16_matmul_add_add1"], sorted(funcs)  # bias + residual fused
    script = funcs[matmuls[0]].script()
    assert "mlcrun_dpbf16ps" in script and "T.parallel" in script
    assert "matmul_intermediate" not in script  # the epilogue reads the accumulators
    assert funcs[matmuls[0]].attrs.get("tirx.is_scheduled")
    assert "llvm.prefetch" in script  # a later tile's weights, by the first row tile
    rounding = funcs["bf16_activations"]
    assert rounding.attrs.get("tirx.is_scheduled") and "mlcrun_cvtne2ps2bf16" in rounding.script()
    # with AMX, blocks of 32 rows take the tile kernel, fewer rows the vector one
    assert ("mlcrun_amx_bf16_32x32" in script) == amx_bf16(cpu_target())


def test_amx_only_where_the_cpu_the_os_and_mlcrun_amx_allow_it(monkeypatch):
    from mlcrun.compiler import target as compiler_target

    flags = {"avx512_bf16", "amx_tile", "amx_bf16"}
    monkeypatch.setattr(compiler_target, "request_amx", lambda: True)
    monkeypatch.delenv("MLCRUN_AMX", raising=False)
    assert compiler_target._amx_usable(flags)
    assert not compiler_target._amx_usable(flags - {"amx_bf16"})
    monkeypatch.setenv("MLCRUN_AMX", "0")
    assert not compiler_target._amx_usable(flags)
    monkeypatch.setenv("MLCRUN_AMX", "1")
    monkeypatch.setattr(compiler_target, "request_amx", lambda: False)  # the OS refuses
    assert not compiler_target._amx_usable(flags)
