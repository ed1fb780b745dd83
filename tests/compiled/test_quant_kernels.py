"""Quantized Linear / Embedding kernels through the real pipeline, against numpy.

A QuantLinear is one TE op (dequantize + NT matmul); after FuseOps/FuseTIR it must be one
PrimFunc together with its epilogue, and the schedule must inline the dequantize into the
GEMV and the small-M variants (decode and verify read the packed weights, never a float
matrix) and dequantize once per chunk of W rows in the GEMM (prefill).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from kernel_blocks import export_block  # noqa: E402
from tvm import relax, tirx  # noqa: E402

from mlcrun.compiler.pipeline import get_pipeline, scheduled_tir_passes  # noqa: E402
from mlcrun.compiler.schedules import cpu as cpu_schedules  # noqa: E402
from mlcrun.compiler.schedules.matmul import GEMM_MIN_ROWS, GemmTuning  # noqa: E402
from mlcrun.compiler.target import cpu_target, cuda_target  # noqa: E402
from mlcrun.quant import get_preset  # noqa: E402
from mlcrun.quant.modules import QuantEmbedding  # noqa: E402
from mlcrun.quant.transform import dequantize_params, weight_transform  # noqa: E402

RNG = np.random.default_rng(0)
PRESETS = ("q0f16", "q8f32", "q8f16", "q4f32_1", "q4f16_1", "q4f16_0")
# GEMV for M = 1, the small-M variants (MR = 2, 4, 7; A padded to MR rows) below
# GEMM_MIN_ROWS, padded GEMM from there
ROWS = (1, 2, 3, 4, 5, 7, 8, 17, 64)


def _export(preset: str, n: int, k: int, vocab: int = 40):
    model, mod, named = export_block(preset, n, k, vocab)
    assert isinstance(model.embed, QuantEmbedding)
    return mod, named


def _params(preset: str, named, floats: dict[str, np.ndarray]):
    """Quantized params in the exported order, and the float weights they stand for."""
    p = get_preset(preset)
    arrays, dequantized = {}, {}
    for name, w in floats.items():
        out = weight_transform(p, name, w)
        arrays.update(out)
        dequantized[name] = dequantize_params(p, out) if w.ndim == 2 else w
    assert sorted(arrays) == sorted(name for name, _ in named)
    return [tvm.runtime.tensor(arrays[name]) for name, _ in named], dequantized


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(("n", "k"), [(7, 96), (30, 160), (64, 128)])
def test_quantized_kernels_match_numpy(preset: str, n: int, k: int) -> None:
    _check_block(preset, n, k, ROWS)


def _check_block(preset: str, n: int, k: int, rows_list: tuple) -> None:
    """forward (r + the Linear + bias), the tied head and the lookup against numpy."""
    mod, named = _export(preset, n, k)
    target = cpu_target()
    vm = relax.VirtualMachine(
        tvm.compile(mod, target, relax_pipeline=get_pipeline(target)), tvm.cpu()
    )
    floats = {
        "proj.weight": RNG.standard_normal((n, k)).astype("float32"),
        "proj.bias": RNG.standard_normal(n).astype("float32"),
        "embed.weight": RNG.standard_normal((40, k)).astype("float32"),
    }
    args, w = _params(preset, named, floats)
    for rows in rows_list:
        x = RNG.standard_normal((1, rows, k)).astype("float32")
        r = RNG.standard_normal((1, rows, n)).astype("float32")
        got = vm["forward"](tvm.runtime.tensor(x), tvm.runtime.tensor(r), args).numpy()
        want = r + x @ w["proj.weight"].T + w["proj.bias"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=f"M={rows}")
        h = RNG.standard_normal((rows, k)).astype("float32")
        got = vm["head"](tvm.runtime.tensor(h), args).numpy()
        np.testing.assert_allclose(got, h @ w["embed.weight"].T, rtol=1e-5, atol=1e-4)
    ids = np.array([0, 39, 5, 5], np.int32)
    got = vm["lookup"](tvm.runtime.tensor(ids), args).numpy()
    np.testing.assert_allclose(got, w["embed.weight"][ids], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stream_w16", [False, True], ids=["4-row", "zen"])
@pytest.mark.parametrize("preset", ["q0f16", "q0bf16"])
def test_16_bit_weight_gemv_tunings_match_numpy(monkeypatch, preset: str, stream_w16: bool):
    """A 16-bit W widened in the loads, either GEMV shape (GemmTuning.stream_w16, AMD Zen:
    one W row per tile up to GEMV_SINGLE_ROW_MAX_K, in the GEMV and in the small-M variants of
    up to ROWS_SINGLE_ROW_MAX_MR rows; beyond it 4 rows with the stored tensor prefetched
    GEMV_PREFETCH_TILES tiles ahead, and the small-M variants prefetching the next tile), on
    shapes no tile divides; K = 1040 takes the long-K path."""
    tuning = GemmTuning(stream_w16=stream_w16)
    monkeypatch.setattr(cpu_schedules, "gemm_tuning", lambda target: tuning)
    prefetches = _prefetches(preset, 36, 1040)
    # Zen: 4 rows of the tile ahead in the long-K GEMV, the whole next tile in each small-M
    # variant (the wide 8-lane tiles: NR = 4, 4, 4 with AVX-512, 4, 2, 1 with AVX2's 16
    # registers); elsewhere no prefetch of a packed W
    assert prefetches >= 4 + 2 + 2 + 2 if stream_w16 else prefetches == 0, prefetches
    # K = 160: Zen's GEMV and 2- and 4-row variants read one W row per tile, unprefetched,
    # and only the 7-row variant prefetches its next tile (NR rows); the 4-row tuning
    # prefetches nothing.
    prefetches = _prefetches(preset, 36, 160)
    assert 1 <= prefetches <= 4 if stream_w16 else prefetches == 0, prefetches
    for n, k in [(30, 160), (36, 1040)]:
        _check_block(preset, n, k, (1, 2, 4, 5, 9))


def _prefetches(preset: str, n: int, k: int) -> int:
    """The prefetches in the scheduled Linear (+ bias + residual) of an n x k block."""
    (matmul,) = [f for name, f in _kernels(preset, n, k).items() if "add" in name]
    return matmul.script().count("llvm.prefetch")


def _kernels(preset: str, n: int = 64, k: int = 128) -> dict[str, tirx.PrimFunc]:
    mod, _ = _export(preset, n, k)
    target = cpu_target()
    with target:
        mod = tvm.transform.Sequential(scheduled_tir_passes(target))(mod)
    return {g.name_hint: f for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _blocks(stmt: tirx.Stmt) -> list[str]:
    return re.findall(r'sblock\("(\w+)"\)', str(stmt))


@pytest.mark.parametrize("preset", ["q4f16_1", "q4f16_0", "q8f32", "q8f16"])
def test_dequantize_and_epilogue_are_one_scheduled_kernel(preset: str) -> None:
    funcs = _kernels(preset)
    reading_codes = {
        name: f for name, f in funcs.items() if any("q_weight" in str(p.name) for p in f.params)
    }
    # forward's Linear (+bias +residual), the tied head, the embedding gather: nothing else
    # touches the packed weights, and there is no separate dequantize kernel.
    assert len(reading_codes) == 3, sorted(funcs)
    assert not any(name.startswith("dequantize") and "matmul" not in name and "take" not in name
                   for name in funcs)  # fmt: skip
    fused = [name for name in reading_codes if "add" in name]
    assert len(fused) == 1, sorted(reading_codes)  # dequantize + matmul + bias + residual
    for name, func in reading_codes.items():
        assert func.attrs.get("tirx.is_scheduled"), name
        script = func.script()
        assert "T.parallel" in script and "T.vectorized" in script, name
        if "matmul" not in name:
            continue
        branch = func.body
        while not isinstance(branch, tirx.IfThenElse):
            branch = branch.body
        assert f"< T.int64({GEMM_MIN_ROWS})" in str(branch.condition)
        gemv, gemm = _blocks(branch.then_case), _blocks(branch.else_case)
        assert "dequantize" not in gemv, f"{name}: the GEMV or small-M kernel materializes W"
        # The GEMV and small-M variants share one parallel loop (see matmul._merge_small).
        assert str(branch.then_case).count("T.parallel") == 1, name
        assert "dequantize" in gemm, f"{name}: the GEMM should dequantize chunks once"


@pytest.mark.parametrize("preset", ["q4f16_1", "q4f16_0+q8f32"])
def test_quantized_block_compiles_for_cuda(preset: str) -> None:
    """The cuda path (the dlight GPU rules on the dequantize TE bodies, exact activations)
    builds the q4 kernels here; the .so is not run."""
    target = cuda_target("sm_90")
    _, mod, _ = export_block(preset, 64, 128, 40, target=target)
    assert tvm.compile(mod, target, relax_pipeline=get_pipeline(target)) is not None
