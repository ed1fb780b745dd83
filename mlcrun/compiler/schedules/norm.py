"""RMSNorm on the CPU: one pass for the sum of squares in vector lanes, one for the output.

relax legalizes `nn.rms_norm` into a chain of TOPI blocks (casts, x * x, a sum per row, the
rsqrt, the scaled product). The generic row-reduction schedule (dlight's `Reduction`) kept
them as separate passes through row-sized intermediate buffers and summed a row in scalar
code: one chain of dependent additions, about 4 cycles an element. That was 1 us for a row
of SmolLM2's 576 (a verify step of 5 tokens: 5 us per norm, 61 norms a step) and 0.4 ms for
a 512-token prefill chunk's. This rule replaces such a function's body: per row, the squares
summed into 16 lanes (a chain of H / 16 additions per lane), the lanes added, the function's
own rsqrt expression (its epsilon and 1 / H) applied to that sum, and the row written as
x * rsqrt * w in vectors. Rows run in parallel from `small.MIN_PARALLEL_ELEMENTS` elements of
work on, on the calling thread below (a thread-pool launch costs more than a decode step's
norm). Any function that is not exactly that chain is left to the next rule.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from .int8 import F32, _bcast, _buffers, _c, _flat, _ramp, _rows, _static, _with_body, lane_tree
from .small import MIN_PARALLEL_ELEMENTS

LANES = 16  # float32 lanes of a 512-bit vector (a narrower vector unit splits them)
# The blocks of relax's legalized rms_norm (TOPI), in order.
TOPI_BLOCKS = [
    "T_cast",
    "T_multiply",
    "T_multiply_red",
    "rsqrt",
    "T_cast_1",
    "T_rms_norm",
    "T_cast_2",
]


def _blocks(func: tirx.PrimFunc) -> dict | None:
    sch = s_tir.Schedule(func)
    root = sch.get_sblock(func.body.block.name_hint)
    blocks = {sch.get(b).name_hint: sch.get(b) for b in sch.get_child_blocks(root)}
    return blocks if list(blocks) == TOPI_BLOCKS else None


def _rsqrt_of(block):
    """The rsqrt block's value as a function of the row's sum (None if it reads anything but
    the sum)."""
    if len(block.reads) != 1 or not hasattr(block.body, "value"):
        return None
    red = block.reads[0].source
    load_type = type(red[tuple(_c(0) for _ in red.shape)])

    def of(total):
        def on_load(load):
            return total if load.source.same_as(red) else load

        return tvm_ffi.structural_map(block.body.value, [(load_type, on_load)])

    return of


def schedule(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The RMSNorm kernel for a legalized `nn.rms_norm` function, or None for anything else."""
    blocks = _blocks(func)
    bufs = _buffers(func)
    if blocks is None or len(bufs) != 3:
        return None
    x, w, out = bufs
    h = _static(x.shape[-1])
    if h is None or h % LANES or len(w.shape) != 1 or _static(w.shape[0]) != h:
        return None
    if [str(d) for d in x.shape] != [str(d) for d in out.shape]:
        return None
    rsqrt = _rsqrt_of(blocks["rsqrt"])
    if rsqrt is None:
        return None
    vecs = h // LANES
    chains = next(c for c in (4, 2, 1) if vecs % c == 0)  # independent sums (add latency)

    def row(m, xf, wf, of) -> None:
        def vec(buf, at):
            return buf[_ramp(at, LANES)].astype(f"{F32}x{LANES}")

        # The squares of the row, summed in `chains` independent vector chains (fully
        # unrolled: a loop would need a buffer for its running sum, and a buffer in a
        # parallel loop is a workspace allocation per row).
        parts = []
        for c in range(chains):
            part = None
            for v in range(c, vecs, chains):
                xv = vec(xf, m * h + v * LANES)
                part = xv * xv if part is None else part + xv * xv
            parts.append(part)
        while len(parts) > 1:
            parts = [a + b for a, b in zip(parts[::2], parts[1::2], strict=True)]
        scale = T.bind(rsqrt(T.bind(lane_tree(parts[0], lambda a, b: a + b, LANES))))
        with T.serial(_c(0), _c(vecs)) as v:
            value = _bcast(scale, LANES) * vec(xf, m * h + v * LANES) * vec(wf, v * LANES)
            T.buffer_store(
                of, value.astype(f"{out.dtype}x{LANES}"), [_ramp(m * h + v * LANES, LANES)]
            )

    rows = _rows(x)
    with IRBuilder() as ib:
        with T.prim_func():
            xf, wf, of = _flat(x), _flat(w), _flat(out)
            with T.If(rows * _c(h) >= _c(MIN_PARALLEL_ELEMENTS)):
                with T.Then():
                    with T.parallel(_c(0), rows) as m:
                        row(m, xf, wf, of)
                with T.Else():
                    with T.serial(_c(0), rows) as m:
                        row(m, xf, wf, of)
    return _with_body(func, ib.get().body)
