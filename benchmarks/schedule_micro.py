"""Micro-benchmark of the CPU matmul schedules on SmolLM2-135M shapes (fp32).

    .venv/bin/python benchmarks/schedule_micro.py --threads 2

* decode: one token's worth of GEMVs (M=1): 30 layers x {qkv, o, gate_up, down} with distinct
  weights (538 MB in all, far beyond the 32 MB L3) plus the tied lm_head, as GB/s of weights
  read. Compared with a STREAM-like triad in numpy on the same thread count (STREAM counting:
  3 arrays, write-allocate not counted, so it understates the machine) and with a pure read
  stream (the fair ceiling for a GEMV), and with numpy/OpenBLAS sgemv on the same weights.
  This VM's memory bandwidth drifts by up to 2x within minutes, so each token pass is timed
  right after a read-stream pass and the ratio is the median of those pairs.
* prefill: GEMM with M rows (default 512), GFLOP/s next to numpy (OpenBLAS) sgemm, TVM and
  numpy alternating call by call, on SmolLM2's shapes and (`--gemm-shapes qwen`) those of
  Qwen2.5-0.5B. `--gemm-only` skips the decode part (and its 538 MB of weights). With
  `--threads 1` both libraries run on the calling thread, so the GEMMs are timed by that
  thread's CPU time: a busy machine (other jobs on the other core) then moves the numbers by
  ~1-2% instead of 2x, which makes it the setting for comparing kernel variants.

The kernels are built as the pipeline builds them (relax legalize + fuse with a symbolic row
count, then mlcrun's CPU rules), so the timed code includes the GEMV/GEMM dispatch on M.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS = 576, 1536, 30, 49152, 9, 3
HEAD_DIM = HIDDEN // HEADS
# (name, N, K) of each Linear in a layer, with q/k/v and gate/up fused.
LAYER_SHAPES = [
    ("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    ("o", HIDDEN, HIDDEN),
    ("gate_up", 2 * INTER, HIDDEN),
    ("down", HIDDEN, INTER),
]
SHAPES = [*LAYER_SHAPES, ("lm_head", VOCAB, HIDDEN)]
# Qwen2.5-0.5B: hidden 896, intermediate 4864, 14 heads / 2 kv heads of 64 (GEMM shapes only).
QWEN_SHAPES = [("qkv", (14 + 2 * 2) * 64, 896), ("o", 896, 896), ("gate_up", 2 * 4864, 896)]
QWEN_SHAPES.append(("down", 896, 4864))


def _time(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up: thread pools, page faults
    return statistics.median(_time(fn) for _ in range(repeat))


def _paired(ref: Callable[[], object], fn: Callable[[], object], repeat: int) -> tuple:
    """Alternate `ref` and `fn`: (median ref time, median fn time, median of ref/fn)."""
    ref(), fn()
    pairs = [(_time(ref), _time(fn)) for _ in range(repeat)]
    return (
        statistics.median(r for r, _ in pairs),
        statistics.median(f for _, f in pairs),
        statistics.median(r / f for r, f in pairs),
    )


def _busy_seconds() -> tuple[float, float]:
    """(CPU seconds used by the whole machine, by this process) so far."""
    import resource

    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    own = resource.getrusage(resource.RUSAGE_SELF)
    return busy / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime


def triad_pass(threads: int, n: int = 1 << 25) -> tuple[Callable[[], None], int]:
    """a = b + s*c over 3 x 128 MiB, in L2-sized blocks (numpy makes no big temporary)."""
    import numpy as np

    a, b, c = (np.full(n, v, np.float32) for v in (0.0, 1.0, 2.0))
    block = 1 << 15
    temps = [np.empty(block, np.float32) for _ in range(threads)]
    pool = ThreadPoolExecutor(threads)

    def part(t: int) -> None:
        lo, hi = t * n // threads, (t + 1) * n // threads
        for s in range(lo, hi, block):
            e, tmp = min(s + block, hi), temps[t][: min(s + block, hi) - s]
            np.multiply(c[s:e], 3.0, out=tmp)
            np.add(b[s:e], tmp, out=a[s:e])

    return lambda: list(pool.map(part, range(threads))), 3 * n * 4


def read_pass(threads: int, n: int = 1 << 27) -> tuple[Callable[[], None], int]:
    """Pure read stream over 512 MiB: column sums of [rows, 2048] blocks (the accumulator row
    stays in L1, so numpy streams the input exactly once)."""
    import numpy as np

    a = np.ones(n, np.float32)
    pool = ThreadPoolExecutor(threads)

    def part(t: int) -> None:
        lo, hi = t * n // threads, (t + 1) * n // threads
        np.add.reduce(a[lo:hi].reshape(-1, 2048), axis=0)

    return lambda: list(pool.map(part, range(threads))), n * 4


def linear_func(n: int, k: int, dtype: str = "float32") -> Callable:
    """The compiled kernel of `x[1, m, k] @ w[n, k]^T`, scheduled as the pipeline does it."""
    import tvm
    from tvm import relax, tirx

    from mlcrun.compiler.pipeline import scheduled_tir_passes
    from mlcrun.compiler.target import cpu_target

    target = cpu_target()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, tirx.Var("m", "int64"), k), dtype))
    w = relax.Var("w", relax.TensorType((n, k), dtype))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    with target:
        mod = tvm.transform.Sequential(scheduled_tir_passes(target))(bb.get())
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    return lib["main"]


def make_weights(seed: int = 0) -> dict[str, list]:
    """Distinct fp32 weights per layer (538 MB in all), as numpy arrays."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        name: [
            rng.standard_normal((n, k), np.float32)
            for _ in range(1 if name == "lm_head" else LAYERS)
        ]
        for name, n, k in SHAPES
    }


def numpy_token(weights: dict[str, list]) -> Callable[[], None]:
    import numpy as np

    xs = {name: np.ones((1, ws[0].shape[1]), np.float32) for name, ws in weights.items()}
    return lambda: [xs[name] @ w.T for name, ws in weights.items() for w in ws]


def gemm_cases(shapes: list, rows: int) -> list[tuple]:
    """(name, GFLOP, A [rows, k], W [n, k]) of each GEMM shape, random fp32 operands."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [
        (
            name,
            2 * rows * n * k / 1e9,
            *(rng.standard_normal(s, np.float32) for s in [(rows, k), (n, k)]),
        )
        for name, n, k in shapes
    ]


def numpy_gemm(cases: list[tuple], repeat: int) -> dict[str, float]:
    """numpy/OpenBLAS GFLOP/s of each case (run before any TVM kernel: TVM's idle workers spin
    for a while and would steal the cores)."""
    return {
        name: flop / _median_time(lambda a=a, w=w: a @ w.T, repeat) for name, flop, a, w in cases
    }


def tvm_gemm(cases: list[tuple], repeat: int, numpy_rates: dict | None) -> dict[str, tuple]:
    """{name: (TVM GFLOP/s, numpy GFLOP/s)}, medians. Without `numpy_rates` (one thread) TVM
    and numpy alternate call by call, timed by the thread's CPU time."""
    import tvm

    dev = tvm.cpu()
    result = {}
    for name, flop, a, w in cases:
        f = linear_func(w.shape[0], w.shape[1])
        x, wt = tvm.runtime.tensor(a[None], dev), tvm.runtime.tensor(w, dev)
        o = tvm.runtime.empty((1, a.shape[0], w.shape[0]), "float32", dev)

        def run(f=f, x=x, wt=wt, o=o) -> None:
            f(x, wt, o)

        if numpy_rates is not None:
            result[name] = (flop / _median_time(run, repeat), numpy_rates[name])
            continue
        run(), a @ w.T  # warm up
        clock = time.thread_time
        times = [(_time(run, clock), _time(lambda a=a, w=w: a @ w.T, clock)) for _ in range(repeat)]
        result[name] = tuple(flop / statistics.median(t[i] for t in times) for i in (0, 1))
    return result


def tvm_decode(weights: dict[str, list]) -> tuple[Callable[[], None], dict[str, Callable]]:
    """The whole token's GEMVs, and one callable per shape running its 30 weights."""
    import numpy as np
    import tvm

    dev = tvm.cpu()
    calls = {}
    for name, ws in weights.items():
        n, k = ws[0].shape
        f = linear_func(n, k)
        tensors = [tvm.runtime.tensor(w, dev) for w in ws]
        x = tvm.runtime.tensor(np.ones((1, 1, k), np.float32), dev)
        o = tvm.runtime.empty((1, 1, n), "float32", dev)
        calls[name] = lambda f=f, ts=tensors, x=x, o=o: [f(x, w, o) for w in ts]

    def token() -> None:
        for call in calls.values():
            call()

    return token, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="TVM and BLAS worker threads")
    parser.add_argument("--rows", type=int, default=512, help="prefill rows (tokens)")
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--gemm-only", action="store_true", help="skip the decode GEMVs")
    parser.add_argument("--gemm-shapes", choices=["smollm2", "qwen"], default="smollm2")
    args = parser.parse_args()
    # Both pools read these once, at start-up; TVM's runtime.config_threadpool has no effect.
    for var in ("TVM_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tvm

    from mlcrun.compiler.target import cpu_target

    print(f"target: {cpu_target()}")
    print(f"threads: {args.threads} (TVM NumThreads={tvm.get_global_func('runtime.NumThreads')()})")
    cases = gemm_cases(SHAPES if args.gemm_shapes == "smollm2" else QWEN_SHAPES, args.rows)
    # One thread: measured alternating, by CPU time (see the module doc).
    numpy_rates = numpy_gemm(cases, args.repeat) if args.threads > 1 else None
    if not args.gemm_only:
        decode(args)
    print(f"\nprefill GEMM ({args.gemm_shapes}, M={args.rows}, fp32)   TVM GFLOP/s   numpy GFLOP/s")
    for name, (tvm_rate, np_rate) in tvm_gemm(cases, args.repeat, numpy_rates).items():
        print(f"  {name:<26s} {tvm_rate:12.1f} {np_rate:15.1f}")


def decode(args: argparse.Namespace) -> None:
    """The decode part: one token's GEMVs against the read stream, the triad and numpy."""
    weights = make_weights()
    nbytes = sum(w.nbytes for ws in weights.values() for w in ws)
    triad, triad_bytes = triad_pass(args.threads)
    read, read_bytes = read_pass(args.threads)
    triad_gbps = triad_bytes / _median_time(triad, args.repeat) / 1e9
    # numpy before TVM: TVM's idle workers spin for a while and would steal the cores.
    t_read_np, t_np, ratio_np = _paired(read, numpy_token(weights), args.repeat)

    busy0, own0, wall0 = *_busy_seconds(), time.perf_counter()
    token, calls = tvm_decode(weights)
    t_read, t_token, ratio = _paired(read, token, args.repeat)
    per_shape = {name: _median_time(call, args.repeat) for name, call in calls.items()}
    busy1, own1, wall1 = *_busy_seconds(), time.perf_counter()
    others = max(busy1 - busy0 - (own1 - own0), 0.0) / (wall1 - wall0)

    read_gbps = read_bytes / t_read / 1e9
    print(f"other processes during the TVM runs: {others:.2f} cores busy on average")
    print(f"numpy triad {triad_gbps:.1f} GB/s; numpy read stream {read_gbps:.1f} GB/s")
    print("\ndecode GEMV (M=1, fp32)        us/call     GB/s")
    for name, t in per_shape.items():
        count = len(weights[name])
        print(
            f"  {name:<26s} {t / count * 1e6:9.1f} {weights[name][0].nbytes * count / t / 1e9:8.1f}"
        )
    gbps = nbytes / t_token / 1e9
    # ratio = t_read / t_token per pair -> GEMV GB/s as a fraction of the read stream's.
    frac = ratio * nbytes / read_bytes
    print(
        f"  one token, 30 layers + lm_head ({nbytes / 1e6:.0f} MB): {t_token * 1e3:.2f} ms, "
        f"{gbps:.1f} GB/s = {100 * frac:.0f}% of the read stream, "
        f"{100 * gbps / triad_gbps:.0f}% of the triad -> {1 / t_token:.0f} tokens/s from GEMVs"
    )
    np_gbps, np_frac = nbytes / t_np / 1e9, ratio_np * nbytes / read_bytes
    print(
        f"  numpy/OpenBLAS sgemv, same token: {t_np * 1e3:.2f} ms, {np_gbps:.1f} GB/s = "
        f"{100 * np_frac:.0f}% of the read stream ({read_bytes / t_read_np / 1e9:.1f} GB/s then)"
    )


if __name__ == "__main__":
    main()
