"""CPU schedules: numerics against numpy through the real pipeline, and loop structure.

Each case builds a small relax function with a symbolic row count (like prefill's seq_len),
compiles it with mlcrun's pipeline for the host CPU and runs it in the VM for several M:
1 takes the GEMV variant, 3 a small-M one (MR = 4, A padded), 17 the batch one (row tiles of
BATCH_MR, A padded) and 128 the GEMM one; test_small_m_matches_numpy runs every M of the
small-M variants, test_batch_rows_match_numpy every M of the batch variant.
"""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax, tirx  # noqa: E402
from tvm.relax.frontend import nn  # noqa: E402

from mlcrun.compiler.pipeline import get_pipeline, scheduled_tir_passes  # noqa: E402
from mlcrun.compiler.schedules import cpu as cpu_schedules  # noqa: E402
from mlcrun.compiler.schedules import norm, small  # noqa: E402
from mlcrun.compiler.schedules.matmul import (  # noqa: E402
    BATCH_MAX_ROWS,
    DEFAULT_L2_BYTES,
    GEMM_MIN_ROWS,
    ROWS_LONG_K_ACC_REGS,
    ROWS_SINGLE_ROW_MAX_MR,
    ROWS_VARIANTS,
    YMM_BITS,
    GemmTuning,
    MatmulInfo,
    tile_config,
)
from mlcrun.compiler.target import cpu_target, cuda_target, vector_bits  # noqa: E402

ROWS = (1, 3, 17, 128)
RNG = np.random.default_rng(0)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _module(n: int, k: int, dtype: str, epilogue: str) -> tvm.IRModule:
    """main(x[1, m, k], w[n, k], b[n], r[1, m, n]) with y = x @ w.T + the chosen epilogue."""
    m = tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType((1, m, k), dtype))
    w = relax.Var("w", relax.TensorType((n, k), dtype))
    b = relax.Var("b", relax.TensorType((n,), dtype))
    r = relax.Var("r", relax.TensorType((1, m, n), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b, r]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            if epilogue in ("bias", "bias_silu_mul"):
                y = bb.emit(relax.op.add(y, b))
            if epilogue == "residual":
                y = bb.emit(relax.op.add(r, y))
            if epilogue == "bias_silu_mul":
                y = bb.emit(relax.op.multiply(relax.op.nn.silu(y), r))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _reference(x, w, b, r, epilogue: str) -> np.ndarray:
    y = x.astype(np.float64) @ w.astype(np.float64).T
    if epilogue in ("bias", "bias_silu_mul"):
        y = y + b
    if epilogue == "residual":
        y = r + y
    if epilogue == "bias_silu_mul":
        y = _silu(y) * r
    return y


def _vm(mod: tvm.IRModule) -> relax.VirtualMachine:
    target = cpu_target()
    return relax.VirtualMachine(
        tvm.compile(mod, target, relax_pipeline=get_pipeline(target)), tvm.cpu()
    )


@pytest.mark.parametrize(
    ("n", "k", "dtype", "epilogue"),
    [
        (96, 64, "float32", "none"),  # tiles divide everything
        (30, 40, "float32", "bias"),  # N % 4 != 0 (NR=3), K % 16 != 0 (8 lanes)
        (64, 48, "float32", "residual"),
        (64, 32, "float32", "bias_silu_mul"),  # a chain of epilogue blocks
        (80, 64, "float16", "residual"),  # fp16 storage, fp32 accumulation, cast epilogue
        (36, 1040, "float32", "residual"),  # K >= GEMM_LONG_K (Zen 4: 6-row tiles of 8 lanes)
        (30, 1028, "float32", "bias"),  # the same with NR=3 and 4 lanes
    ],
)
def test_matmul_matches_numpy(n: int, k: int, dtype: str, epilogue: str) -> None:
    vm = _vm(_module(n, k, dtype, epilogue))
    w = RNG.standard_normal((n, k)).astype(dtype)
    b = RNG.standard_normal(n).astype(dtype)
    for rows in ROWS:
        x = RNG.standard_normal((1, rows, k)).astype(dtype)
        r = RNG.standard_normal((1, rows, n)).astype(dtype)
        args = [tvm.runtime.tensor(a) for a in (x, w, b, r)]
        got = vm["main"](*args).numpy()
        want = _reference(x, w, b, r, epilogue)
        tol = 4e-3 if dtype == "float16" else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.sqrt(k), err_msg=f"M={rows}")


def _check_fp32_residual_matmuls(shapes: list[tuple[int, int]], rows_list: tuple) -> None:
    """`r + x @ w.T` in fp32 against numpy for each (N, K) and each row count M."""
    for n, k in shapes:
        vm = _vm(_module(n, k, "float32", "residual"))
        w = RNG.standard_normal((n, k)).astype("float32")
        b = RNG.standard_normal(n).astype("float32")
        for rows in rows_list:
            x = RNG.standard_normal((1, rows, k)).astype("float32")
            r = RNG.standard_normal((1, rows, n)).astype("float32")
            got = vm["main"](*[tvm.runtime.tensor(a) for a in (x, w, b, r)]).numpy()
            want = _reference(x, w, b, r, "residual")
            np.testing.assert_allclose(
                got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k), err_msg=f"N={n} K={k} M={rows}"
            )


TUNINGS = {
    "zen4-few-rows": GemmTuning(l2_block_bytes=16 * 1024, long_k_ymm=True),
    "few-rows": GemmTuning(l2_block_bytes=16 * 1024, long_k_ymm=False),
    "whole-l2": GemmTuning(l2_block_bytes=1 << 21, long_k_ymm=False),
}


def test_gemm_tuning_follows_the_cpu() -> None:
    """Half the L2 per chunk (a default where sysfs says nothing); ymm long-K tiles and the
    streaming GEMV of a float32 W on Zen 4 only, that of a 16-bit W on every AMD Zen."""
    half = DEFAULT_L2_BYTES // 2
    assert GemmTuning.for_cpu(2 << 20, "sapphirerapids") == GemmTuning(1 << 20)
    assert GemmTuning.for_cpu(None, "znver4") == GemmTuning(half, True, True, True)
    assert GemmTuning.for_cpu(None, "znver3") == GemmTuning(half, stream_w=True, stream_w16=True)
    assert GemmTuning.for_cpu(None, "znver1") == GemmTuning(half, stream_w16=True)


@pytest.mark.parametrize("stream_w", [False, True], ids=["4-row", "zen4"])
def test_gemv_tunings_match_numpy(monkeypatch, stream_w: bool) -> None:
    """The float-W GEMV either way (Zen 4: one W row per tile up to GEMV_SINGLE_ROW_MAX_K,
    beyond it 4 rows with the tile GEMV_PREFETCH_TILES ahead prefetched, clamped at the last
    row), with the small-M and batch variants that share its chunks (Zen 4: one W row per
    tile up to GEMV_SINGLE_ROW_MAX_K in those of up to ROWS_SINGLE_ROW_MAX_MR rows, from
    GEMM_LONG_K wide tiles of 8 lanes in all of them), on shapes no tile divides."""
    tuning = GemmTuning(stream_w=stream_w)
    monkeypatch.setattr(cpu_schedules, "gemm_tuning", lambda target: tuning)
    # Prefetches per K step at N = 36, K = 1040 (chunks of 4 columns). Either way the batch
    # variant's 1 (one W row per row tile) and, in each small-M variant, the whole next tile
    # (NR rows: 4 for MR = 2, 2 for MR = 4 and 7, whose accumulators allow fewer columns;
    # with AVX2's 16 ymm registers, YMM_ACC_REGS, 7 rows take one). With stream_w (K >=
    # GEMM_LONG_K) every small-M variant has 8 lanes and the chunk's 4 columns
    # (ROWS_LONG_K_ACC_REGS; AVX2: 4, 2 and 1 by YMM_ACC_REGS), and the long-K GEMV
    # prefetches the tile GEMV_PREFETCH_TILES ahead (NR = 4).
    assert ROWS_VARIANTS == (2, 4, 7)
    assert ROWS_LONG_K_ACC_REGS // 7 >= 4
    ymm = vector_bits(cpu_target()) == YMM_BITS
    (func,) = _scheduled_prim_funcs(_module(36, 1040, "float32", "none")).values()
    prefetches = func.script().count("llvm.prefetch")
    small = ((4 + 2 + 1) if ymm else (4 + 4 + 4)) if stream_w else 2 + (1 if ymm else 2)
    assert prefetches == 1 + 4 + small
    # At N = 36, K = 72 (8 lanes: NR = 4 in every variant; AVX2: 4, 2 and 1) Zen 4 reads W as
    # one stream in the GEMV and in the small-M variants up to ROWS_SINGLE_ROW_MAX_MR rows (one
    # W row per tile, prefetching the next row as the batch variant does): 1 + 1 + 1 + 4
    # against 1 + 4 + 4 + 4.
    assert ROWS_SINGLE_ROW_MAX_MR == 4
    (func,) = _scheduled_prim_funcs(_module(36, 72, "float32", "none")).values()
    prefetches = func.script().count("llvm.prefetch")
    rows = (1 + 1 if stream_w else 4 + 2, 1) if ymm else (1 + 1 if stream_w else 4 + 4, 4)
    assert prefetches == 1 + sum(rows)
    shapes = [(30, 40), (200, 72), (36, 1040), (30, 1028)]
    _check_fp32_residual_matmuls(shapes, (1, 2, 3, 4, 5, 17))


@pytest.mark.parametrize("tuning", TUNINGS.values(), ids=TUNINGS.keys())
def test_gemm_tunings_match_numpy(monkeypatch, tuning: GemmTuning) -> None:
    """Whatever CPU compiles it: W chunks of a few rows (many chunks) up to a whole L2 (one
    chunk, or GEMM_MIN_CHUNKS), with and without Zen 4's 6x8-lane long-K tiles, on shapes no
    tile divides (N = 30: NR = 3; K = 1028: 4 lanes) and M not a multiple of the tile rows."""
    monkeypatch.setattr(cpu_schedules, "gemm_tuning", lambda target: tuning)
    _check_fp32_residual_matmuls([(36, 1040), (30, 1028), (200, 72)], (BATCH_MAX_ROWS, 37, 40))


def test_avx2_gemm_tiles_match_numpy(monkeypatch) -> None:
    """AVX2's GEMM tiles (16 ymm registers: 4 rows x 3 columns where N % 3 == 0, else 6 x 2),
    built for a 256-bit target whatever this CPU (an AVX-512 one runs them too), on M that no
    tile's rows divide and K of 8 and 4 lanes."""

    def tile(n: int, bits: int) -> tuple[int, int]:
        cfg = tile_config(MatmulInfo(tirx.Var("m", "int64"), n, 72, 32, 32, None), bits, "gemm")
        return cfg.mr, cfg.nr

    assert (tile(36, 256), tile(40, 256), tile(36, 512)) == ((4, 3), (6, 2), (3, 4))
    monkeypatch.setattr(cpu_schedules, "vector_bits", lambda target: 256)
    shapes = [(36, 72), (40, 1040), (200, 72), (30, 1028)]
    _check_fp32_residual_matmuls(shapes, (BATCH_MAX_ROWS, 37, 40))


@pytest.mark.parametrize(
    ("n", "k", "dtype", "epilogue"),
    [
        (30, 40, "float32", "bias"),  # NR=3 (GEMV) / 2, 3 (small M): N % 4 != 0, 8 lanes
        (54, 72, "float32", "residual"),  # N = 2 * 27: chunks of 27 columns where NR must divide
        (50, 48, "float16", "bias_silu_mul"),  # fp16 storage, cast epilogue, a chain of blocks
    ],
)
def test_small_m_matches_numpy(n: int, k: int, dtype: str, epilogue: str) -> None:
    """Every M from 1 to GEMM_MIN_ROWS: the GEMV, each small-M variant at its MR and below
    (A padded to MR rows), from GEMM_MIN_ROWS the batch variant (float32 W) or the GEMM, on
    shapes no tile divides evenly."""
    assert max(ROWS_VARIANTS) == GEMM_MIN_ROWS - 1
    vm = _vm(_module(n, k, dtype, epilogue))
    w = RNG.standard_normal((n, k)).astype(dtype)
    b = RNG.standard_normal(n).astype(dtype)
    for rows in range(1, GEMM_MIN_ROWS + 1):
        x = RNG.standard_normal((1, rows, k)).astype(dtype)
        r = RNG.standard_normal((1, rows, n)).astype(dtype)
        args = [tvm.runtime.tensor(a) for a in (x, w, b, r)]
        got = vm["main"](*args).numpy()
        want = _reference(x, w, b, r, epilogue)
        tol = 4e-3 if dtype == "float16" else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.sqrt(k), err_msg=f"M={rows}")


@pytest.mark.parametrize(
    ("n", "k", "epilogue"),
    [
        (30, 40, "bias"),  # NR = 3 in chunks of 3 columns; the prefetched row clamps at N - 1
        (54, 72, "residual"),  # chunks of 27 columns: NR must divide them
        (200, 1028, "bias_silu_mul"),  # 4 lanes, a chain of epilogue blocks
    ],
)
def test_batch_rows_match_numpy(n: int, k: int, epilogue: str) -> None:
    """Every M of the batch variant (GEMM_MIN_ROWS .. BATCH_MAX_ROWS - 1: several row tiles per
    column tile, A padded to BATCH_MR rows, the next tile's W prefetched) and the first GEMM
    size, against numpy."""
    vm = _vm(_module(n, k, "float32", epilogue))
    w = RNG.standard_normal((n, k)).astype("float32")
    b = RNG.standard_normal(n).astype("float32")
    for rows in range(GEMM_MIN_ROWS - 1, BATCH_MAX_ROWS + 1):
        x = RNG.standard_normal((1, rows, k)).astype("float32")
        r = RNG.standard_normal((1, rows, n)).astype("float32")
        got = vm["main"](*[tvm.runtime.tensor(a) for a in (x, w, b, r)]).numpy()
        want = _reference(x, w, b, r, epilogue)
        np.testing.assert_allclose(
            got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k), err_msg=f"N={n} K={k} M={rows}"
        )


def _rms_norm_module(shape: tuple, dtype: str = "float32") -> tvm.IRModule:
    """rms_norm over the last dim of x [batch, *shape] (batch symbolic)."""
    bsz = tirx.Var("batch", "int64")
    x = relax.Var("x", relax.TensorType((bsz, *shape), dtype))
    g = relax.Var("g", relax.TensorType((shape[-1],), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(
    "shape",
    [(1, 96), (1, 48), (1, 576), (3, 64), (1, 40)],
    ids=["2 chains", "1 chain", "4 chains", "per head", "not 16 lanes"],
)
def test_rms_norm_matches_numpy(shape) -> None:
    """RMSNorm kernels (norm.py) over a few rows (serial) and many (parallel), on rows of 16-
    lane multiples with 1, 2 or 4 sum chains and on q/k heads (a 3-D x); a row that is not a
    multiple of 16 lanes is left to the generic reduction schedule."""
    h = shape[-1]
    mod = relax.transform.LegalizeOps()(_rms_norm_module(shape))
    func = next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))
    assert (norm.schedule(func) is not None) == (h % norm.LANES == 0)
    vm = _vm(_rms_norm_module(shape))
    g = RNG.standard_normal(h).astype("float32")
    for rows in (1, 5, 300):
        x = RNG.standard_normal((rows, *shape)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(g)).numpy()
        want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5) * g
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rms_norm_rule_takes_only_a_plain_rms_norm() -> None:
    """A function with more than the legalized rms_norm blocks (here an add fused before it)
    is not RMSNorm's kernel's to replace."""
    bsz = tirx.Var("batch", "int64")
    x = relax.Var("x", relax.TensorType((bsz, 1, 64), "float32"))
    g = relax.Var("g", relax.TensorType((64,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(x, x))
            out = bb.emit_output(relax.op.nn.rms_norm(y, g, axes=[-1], epsilon=1e-5))
        bb.emit_func_output(out)
    mod = relax.transform.FuseTIR()(
        relax.transform.FuseOps(2)(relax.transform.LegalizeOps()(bb.get()))
    )
    funcs = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    fused = [f for f in funcs if len(f.params) == 3 and "add" in str(f)]
    assert fused and all(norm.schedule(f) is None for f in fused)


def test_embedding_take_and_silu_mul() -> None:
    """Injective kernels: the embedding gather and the MLP's split + SiLU * up."""
    vocab, h = 50, 32
    n = tirx.Var("n", "int64")
    ids = relax.Var("ids", relax.TensorType((n,), "int32"))
    table = relax.Var("table", relax.TensorType((vocab, 2 * h), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [ids, table]):
        with bb.dataflow():
            emb = bb.emit(relax.op.take(table, ids, axis=0))  # [n, 2h]
            parts = bb.emit(relax.op.split(emb, 2, axis=-1))
            gate, up = bb.emit(relax.TupleGetItem(parts, 0)), bb.emit(relax.TupleGetItem(parts, 1))
            out = bb.emit_output(relax.op.multiply(relax.op.nn.silu(gate), up))
        bb.emit_func_output(out)
    vm = _vm(bb.get())
    tab = RNG.standard_normal((vocab, 2 * h)).astype("float32")
    idx = RNG.integers(0, vocab, 7).astype("int32")
    got = vm["main"](tvm.runtime.tensor(idx), tvm.runtime.tensor(tab)).numpy()
    e = tab[idx]
    np.testing.assert_allclose(got, _silu(e[:, :h]) * e[:, h:], rtol=1e-5, atol=1e-6)


def _silu_module() -> tvm.IRModule:
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.silu(x))
        bb.emit_func_output(out)
    return bb.get()


def test_silu_uses_a_polynomial_exp_and_stays_accurate() -> None:
    """float32 SiLU legalizes to x / (1 + fast_exp(-x)): no libm exp or sigmoid call is left
    in the kernel (LLVM cannot vectorize those), and the result stays within a few ulp of
    float64 SiLU over the whole range, saturated tails included."""
    mod = _silu_module()
    texts = [f.script() for f in _scheduled_prim_funcs(mod).values()]
    assert texts and not any("T.exp(" in t or "T.sigmoid(" in t for t in texts)
    vm = _vm(mod)
    x = np.concatenate([np.linspace(-100, 100, 200_001), [-88.4, -87.0, 0.0, 88.4]])
    x = x.astype("float32")
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    want = _silu(x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)


def _scheduled_prim_funcs(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    target = cpu_target()
    with target:
        mod = tvm.transform.Sequential(scheduled_tir_passes(target))(mod)
    return {g.name_hint: f for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


@pytest.mark.parametrize("epilogue", ["none", "residual", "bias_silu_mul"])
def test_matmuls_are_parallel_and_vectorized(epilogue: str) -> None:
    funcs = _scheduled_prim_funcs(_module(64, 64, "float32", epilogue))
    matmuls = {name: f for name, f in funcs.items() if "matmul" in name}
    assert matmuls, f"no matmul kernel in {sorted(funcs)}"
    for name, func in funcs.items():
        assert func.attrs.get("tirx.is_scheduled"), f"{name} left unscheduled"
    for name, func in matmuls.items():
        script = func.script()
        assert "T.parallel" in script, f"{name} has no parallel loop"
        assert "T.vectorized" in script, f"{name} has no vectorized loop"
        dispatch = f"if m < T.int64({BATCH_MAX_ROWS})"
        assert dispatch in script, f"{name} lacks the GEMV/GEMM dispatch on M"
        # the row variants prefetch the next column tile of the float W
        assert "llvm.prefetch" in script, f"{name} does not prefetch W"


def test_batch_decode_layout() -> None:
    """Decode activations are [batch, 1, hidden]: rows come from the batch dim."""
    n, k = 64, 64
    batch = tirx.Var("batch", "int64")
    x = relax.Var("x", relax.TensorType((batch, 1, k), "float32"))
    w = relax.Var("w", relax.TensorType((n, k), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    vm = _vm(bb.get())
    w_np = RNG.standard_normal((n, k)).astype("float32")
    for rows in (1, 2, 3, 5, 7, 8):
        x_np = RNG.standard_normal((rows, 1, k)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(x_np), tvm.runtime.tensor(w_np)).numpy()
        np.testing.assert_allclose(got, x_np @ w_np.T, rtol=1e-5, atol=1e-4)


class _Block(nn.Module):
    """RMSNorm -> gate/up Linear -> SiLU * up -> down Linear, plus the residual."""

    def __init__(self, hidden: int, inter: int) -> None:
        self.norm = nn.RMSNorm(hidden, -1, 1e-5, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=True)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = nn.op.split(self.gate_up(self.norm(x)), 2, axis=-1)
        return x + self.down(nn.op.silu(gate) * up)


def _export_block(target: tvm.target.Target, hidden: int = 48, inter: int = 80):
    model = _Block(hidden, inter)
    spec = {
        "forward": {
            "x": nn.spec.Tensor([1, "seq_len", hidden], "float32"),
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }
    }
    with target:
        return model.export_tvm(spec)


def test_nn_module_through_pipeline() -> None:
    """An exported nn.Module (packed params, symbolic seq_len) against numpy."""
    target = cpu_target()
    mod, named = _export_block(target)
    vm = relax.VirtualMachine(
        tvm.compile(mod, target, relax_pipeline=get_pipeline(target)), tvm.cpu()
    )
    params = {
        name: RNG.standard_normal([int(d) for d in p.shape]).astype("float32") * 0.3
        for name, p in named
    }
    args = [tvm.runtime.tensor(params[name]) for name, _ in named]
    for seq in (1, 6, 33):
        x = RNG.standard_normal((1, seq, 48)).astype("float32")
        got = vm["forward"](tvm.runtime.tensor(x), args).numpy()
        h = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-5) * params["norm.weight"]
        gate, up = np.split(h @ params["gate_up.weight"].T, 2, axis=-1)
        want = x + (_silu(gate) * up) @ params["down.weight"].T + params["down.bias"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"seq_len={seq}")


def test_cuda_build_compiles_without_gpu() -> None:
    """The cuda path (dlight GPU rules) builds here; the .so is not run."""
    target = cuda_target("sm_90")
    mod, _ = _export_block(target)
    executable = tvm.compile(mod, target, relax_pipeline=get_pipeline(target))
    assert executable is not None


def test_exported_kernels_are_left_alone() -> None:
    """The paged KV cache's kernels (some lack the scheduled attr) must not be rescheduled."""
    from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

    target = cpu_target()
    bb = relax.BlockBuilder()
    with target, bb.function("create_paged_kv_cache", []):
        ints = [tirx.Var(n, "int64") for n in ("b", "s", "c", "p", "w")]
        cache = TIRPagedKVCache(
            attn_kind="mha", max_batch_size=ints[0], max_total_seq_len=ints[1],
            prefill_chunk_size=ints[2], page_size=ints[3], support_sliding_window=ints[4],
            layer_partition=relax.ShapeExpr([0, 1]), num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, qk_head_dim=16, v_head_dim=16, mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0, rope_mode=RopeMode.NORMAL, rope_scale=1,
            rope_theta=10000, rope_scaling={}, rope_ext_factors=relax.prim_value(0),
            rotary_dim=16, enable_disaggregation=False, dtype="float32", target=target,
        )  # fmt: skip
        bb.emit_func_output(cache._expr)
    before = {
        f.attrs["global_symbol"]: f
        for _, f in bb.get().functions_items()
        if isinstance(f, tirx.PrimFunc)
    }
    with target:
        after = tvm.transform.Sequential(scheduled_tir_passes(target))(bb.get())
    after = {
        f.attrs["global_symbol"]: f
        for _, f in after.functions_items()
        if isinstance(f, tirx.PrimFunc)
    }
    assert set(after) == set(before)
    for name, func in before.items():  # same body, only the scheduled mark added
        tvm.ir.assert_structural_equal(after[name].body, func.body)


@pytest.mark.parametrize("long_k_ymm", [False, True], ids=["3-row", "zen4"])
@pytest.mark.parametrize(("n", "k"), [(1536, 576), (576, 1536)])  # K >= GEMM_LONG_K: long-K tile
def test_matmul_accumulators_fit_on_the_stack(monkeypatch, n: int, k: int, long_k_ymm) -> None:
    """TVM puts small "global" allocations on the stack; anything else is a heap workspace
    that LLVM must assume aliases the operands as soon as one kernel in the module lacks
    `tirx.noalias` (the KV cache's kernels do, and TVM 0.27 then drops noalias for the whole
    module): the accumulators would be stored after every FMA, 3x slower. So no parallel task
    of a matmul may allocate a workspace, with either long-K tile."""
    import re

    tuning = GemmTuning(long_k_ymm=long_k_ymm)
    monkeypatch.setattr(cpu_schedules, "gemm_tuning", lambda target: tuning)
    funcs = _scheduled_prim_funcs(_module(n, k, "float32", "residual"))
    (name,) = [n for n in funcs if "matmul" in n]
    target = cpu_target()
    lib = tvm.compile(tvm.IRModule({name: funcs[name].with_attr("global_symbol", name)}), target)
    llvm_ir = lib.mod.inspect_source("ll")
    tasks = re.findall(r"define [^\n]*@__tvm_parallel_lambda[^\n]*\{(.*?)\n\}", llvm_ir, re.S)
    assert len(tasks) >= 3, "expected the GEMV, A-padding and GEMM parallel tasks"
    for body in tasks:
        assert "TVMBackendAllocWorkspace" not in body


def test_no_kernel_of_a_block_stays_serial() -> None:
    """Every kernel of the exported block (norm, matmuls, SiLU * up, residual) is parallel."""
    mod, _ = _export_block(cpu_target())
    funcs = _scheduled_prim_funcs(mod)
    assert len(funcs) >= 3, sorted(funcs)
    for name, func in funcs.items():
        assert "T.parallel" in func.script(), f"{name} stays a single-threaded loop nest"


def _row_kernels(cols: int) -> dict[str, tirx.PrimFunc]:
    """y = x + 1 over rows of `cols` elements, rows in a parallel loop: 4 rows ("static"),
    n rows ("symbolic"), and n rows through a scratch buffer per row ("allocating")."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def static(X: T.Buffer((4, cols), "float32"), Y: T.Buffer((4, cols), "float32")):
        for r in T.parallel(4):
            for c in T.vectorized(cols):
                with T.sblock("y"):
                    Y[r, c] = X[r, c] + T.float32(1)

    @T.prim_func(s_tir=True)
    def symbolic(x: T.handle, y: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, cols), "float32")
        Y = T.match_buffer(y, (n, cols), "float32")
        for r in T.parallel(n):
            for c in T.vectorized(cols):
                with T.sblock("y"):
                    Y[r, c] = X[r, c] + T.float32(1)

    @T.prim_func(s_tir=True)
    def allocating(x: T.handle, y: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, cols), "float32")
        Y = T.match_buffer(y, (n, cols), "float32")
        for r in T.parallel(n):
            with T.sblock("row"):
                scratch = T.sblock_alloc_buffer((cols,), "float32")
                for c in T.serial(cols):
                    scratch[c] = X[r, c] + T.float32(1)
                for c in T.serial(cols):
                    Y[r, c] = scratch[c]

    return {"static": static, "symbolic": symbolic, "allocating": allocating}


def test_small_parallel_loops_run_serially() -> None:
    """small.serial_when_small: a loop whose whole work is small runs serially; one of
    symbolic extent keeps its launch from as many rows as make the work large, with a serial
    copy below; large work, or a body that allocates (no copy possible), is left alone."""
    limit = small.MIN_PARALLEL_ELEMENTS
    narrow, wide = _row_kernels(64), _row_kernels(2 * limit)
    assert "T.parallel" not in small.serial_when_small(narrow["static"]).script()
    assert "T.parallel(4)" in small.serial_when_small(wide["static"]).script()
    for kernel in (wide["symbolic"], narrow["allocating"]):
        script = small.serial_when_small(kernel).script()
        assert "if " not in script and "T.parallel(n)" in script, script

    guarded = small.serial_when_small(narrow["symbolic"])
    script = guarded.script()
    assert f"if n >= {limit // 64}:" in script, script
    assert "T.parallel(n)" in script and "for r in range(n):" in script, script
    # Both branches compute the same thing.
    lib = tvm.compile(
        tvm.IRModule({"main": guarded.with_attr("global_symbol", "main")}), target=cpu_target()
    )["main"]
    for rows in (1, limit // 64 - 1, limit // 64, 3 * limit // 64):
        x = RNG.standard_normal((rows, 64)).astype("float32")
        y = tvm.runtime.tensor(np.zeros_like(x))
        lib(tvm.runtime.tensor(x), y)
        np.testing.assert_array_equal(y.numpy(), x + 1, err_msg=f"{rows} rows")


def test_a_reshape_stays_a_view() -> None:
    """The relax pipeline turns a kernel it recognises as a reshape into a view; the small-
    kernel guard must leave it recognisable (a guarded reshape ran as a copy kernel)."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 64), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(x, relax.const(1.0, "float32")))
            z = bb.emit(relax.op.reshape(y, (n, 4, 16)))
            w = bb.emit_output(relax.op.multiply(z, z))
        bb.emit_func_output(w)
    target = cpu_target()
    executable = tvm.compile(bb.get(), target, relax_pipeline=get_pipeline(target))
    calls = [line.split()[1] for line in executable.as_text().splitlines() if "call " in line]
    assert "vm.builtin.reshape" in calls and "reshape" not in calls, calls
    vm = relax.VirtualMachine(executable, tvm.cpu())
    a = RNG.standard_normal((3, 64)).astype("float32")
    got = vm["main"](tvm.runtime.tensor(a)).numpy()
    np.testing.assert_allclose(got, ((a + 1) ** 2).reshape(3, 4, 16), rtol=1e-6)
