"""CPU kernels for bf16 activations: round x to bfloat16 once, multiply with vdpbf16ps.

quant/modules.py emits two TE ops per q0bf16 Linear when a model is compiled with bf16
activations (`--activations bf16`, or `auto` on a CPU with AVX512-BF16); their TE bodies state
the math. This rule recognises them by their `BF16_ATTR` block annotation and replaces each
function's body with a kernel written here (the structure of int8.py's):

* `round`: x -> bf16 bits, 32 elements at a time: two 16-float vectors become one vector of 32
  bf16 (vcvtne2ps2bf16: nearest even, denormals flushed; bit for bit
  numpy_ref.bf16_activations). Rows run in parallel from PARALLEL_ROWS rows on.
* `matmul` (+ whatever FuseOps fused after it: bias, residual add, ...): the weights are bf16
  bits in panels of 16 output rows x 2 K-elements (numpy_ref.tile_rows(., 2), i.e.
  [N/16, K/2, 16, 2]), so one 64-byte load holds the next K-pair of 16 outputs, and each
  vdpbf16ps multiplies it with one activation pair (32 bits) broadcast to the 16 lanes, adding
  both products into 16 float32 accumulators. A micro-kernel holds MR rows x NP panels of
  accumulators (one 16-float buffer each, so all stay in registers) and uses every loaded
  weight vector for its MR rows; the parallel loop runs over tiles of NP panels, each
  streaming all rows (decode M = 1, small-M batches and prefill alike), MR rows at a time,
  then the remaining 1..MR-1. The last N % 16 outputs run in scalar code after the parallel
  loop (only odd-shaped layers have them), with the products summed in vdpbf16ps's order.
  The first row tile prefetches the next tile's weights, one line per K-pair (int8.py's
  PREFETCH_TILES; SmolLM2 at M = 1, 2 threads, Zen 4: a step's matmuls 8.2-10.0 -> 7.5-9.8 ms,
  and its 4-token verify 294-363 -> 386 tokens/s).

The epilogue is int8.py's: the fused blocks after the matmul are inlined into one and its
value expression is evaluated on each output tile as it leaves the registers.

LLVM types the bf16 intrinsics' operands as `<32 x bfloat>`, which TVM cannot express (its
bfloat16 lowers to i16), so each is called through a small LLVM IR wrapper that takes and
returns i32 vectors and bitcasts (`pragma_import_llvm`: linked into the module and inlined).
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ...quant import numpy_ref
from ...quant.modules import BF16_ATTR
from .int8 import (
    PREFETCH_TILES,
    PanelLoops,
    _bcast,
    _buffers,
    _c,
    _epilogue,
    _flat,
    _ramp,
    _rows,
    _static,
    _with_body,
    prefetch,
)

LOG = logging.getLogger(__name__)

PANEL = numpy_ref.PANEL  # output rows per weight panel = float32 lanes of a 512-bit vdpbf16ps
NP_CHOICES = (4, 3, 2)  # panels per tile: the widest leaving >= MIN_TILES parallel tiles
MIN_TILES = 16
PARALLEL_ROWS = 32  # the round kernel runs rows in parallel from this many rows on
AMX_MIN_ROWS = 32  # the matmul takes AMX blocks from this many rows (one whole block) on
F32 = "float32"
F32X16 = "float32x16"
I32X16 = "int32x16"

DOT = "mlcrun_dpbf16ps"
CVT = "mlcrun_cvtne2ps2bf16"
# linkonce_odr: every kernel imports the same definitions into the one LLVM module.
LLVM_WRAPPERS = f"""
define linkonce_odr <16 x float> @{DOT}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) {{
  %ab = bitcast <16 x i32> %a to <32 x bfloat>
  %bb = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %ab,
                                                           <32 x bfloat> %bb)
  ret <16 x float> %r
}}
define linkonce_odr <16 x i32> @{CVT}(<16 x float> %hi, <16 x float> %lo) {{
  %r = call <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float> %hi,
                                                                  <16 x float> %lo)
  %i = bitcast <32 x bfloat> %r to <16 x i32>
  ret <16 x i32> %i
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
declare <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float>, <16 x float>)
"""

# AMX: one 32-row x 32-output block over the whole K. A tile register holds 16 rows of 64
# bytes: A = 16 activation rows x 32 bf16 (row stride K * 2 bytes), B = 16 K-pairs x 16
# outputs x 2 -- exactly 16 consecutive K-pairs of a weight panel (stride 64 bytes), C = 16 x
# 16 floats. Two A and two B tiles make four C tiles (all 8 tile registers); per 32 K-elements
# four tdpbf16ps. The C tiles go to `c` (32 x 32 floats, row stride 128 bytes) for the
# epilogue. The loop and the tile configuration (ldtilecfg) are LLVM's.
AMX_BLOCK = 32  # rows and outputs of one AMX block
AMX_K = 32  # K-elements per tile step
AMX = "mlcrun_amx_bf16_32x32"
AMX_WRAPPER = f"""
define linkonce_odr void @{AMX}(ptr %a, i64 %lda, ptr %b0, ptr %b1, i64 %steps, ptr %c) #0 {{
entry:
  %half = mul i64 %lda, 16
  %a1 = getelementptr i8, ptr %a, i64 %half
  %z = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %c00 = phi x86_amx [%z, %entry], [%d00, %loop]
  %c01 = phi x86_amx [%z, %entry], [%d01, %loop]
  %c10 = phi x86_amx [%z, %entry], [%d10, %loop]
  %c11 = phi x86_amx [%z, %entry], [%d11, %loop]
  %aoff = shl i64 %i, 6
  %pa0 = getelementptr i8, ptr %a, i64 %aoff
  %pa1 = getelementptr i8, ptr %a1, i64 %aoff
  %boff = shl i64 %i, 10
  %pb0 = getelementptr i8, ptr %b0, i64 %boff
  %pb1 = getelementptr i8, ptr %b1, i64 %boff
  %ta0 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pa0, i64 %lda)
  %ta1 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pa1, i64 %lda)
  %tb0 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pb0, i64 64)
  %tb1 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pb1, i64 64)
  %d00 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, x86_amx %c00,
                                                   x86_amx %ta0, x86_amx %tb0)
  %d01 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, x86_amx %c01,
                                                   x86_amx %ta0, x86_amx %tb1)
  %d10 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, x86_amx %c10,
                                                   x86_amx %ta1, x86_amx %tb0)
  %d11 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, x86_amx %c11,
                                                   x86_amx %ta1, x86_amx %tb1)
  %next = add i64 %i, 1
  %done = icmp eq i64 %next, %steps
  br i1 %done, label %exit, label %loop
exit:
  %p01 = getelementptr i8, ptr %c, i64 64
  %p10 = getelementptr i8, ptr %c, i64 2048
  %p11 = getelementptr i8, ptr %c, i64 2112
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c, i64 128, x86_amx %d00)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %p01, i64 128, x86_amx %d01)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %p10, i64 128, x86_amx %d10)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %p11, i64 128, x86_amx %d11)
  ret void
}}
declare x86_amx @llvm.x86.tilezero.internal(i16, i16)
declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)
declare x86_amx @llvm.x86.tdpbf16ps.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)
declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)
attributes #0 = {{ noinline }}
"""


def _with_wrappers(amx: bool = False):
    """Scope whose body may call the wrappers (imported once per function)."""
    ir = LLVM_WRAPPERS + (AMX_WRAPPER if amx else "")
    return T.attr(tirx.const(0, "int32"), "pragma_import_llvm", ir)


def _annotated_blocks(sch: s_tir.Schedule) -> list:
    root = sch.get_sblock(sch.mod["main"].body.block.name_hint)
    return [b for b in sch.get_child_blocks(root) if BF16_ATTR in sch.get(b).annotations]


# ----------------------------------------------------------------- round kernel
def _round_kernel(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    bufs = _buffers(func)
    xs = [b for b in bufs if b.dtype == F32]
    outs = [b for b in bufs if b.dtype == "uint16"]
    if len(bufs) != 2 or len(xs) != 1 or len(outs) != 1:
        return None
    x, out = xs[0], outs[0]
    k = _static(out.shape[-1])
    if k is None or k % 32 or _static(x.shape[-1]) != k:
        return None

    def row(m, xf, of) -> None:
        with T.serial(_c(0), _c(k // 32)) as j:
            base = m * k + j * 32
            lo, hi = xf[_ramp(base, 16)], xf[_ramp(base + 16, 16)]
            pair = T.call_pure_extern(I32X16, CVT, hi, lo)
            T.buffer_store(of, tirx.reinterpret("uint16x32", pair), [_ramp(base, 32)])

    rows = _rows(out)
    with IRBuilder() as ib:
        with T.prim_func():
            xf, of = _flat(x), _flat(out)
            with _with_wrappers():
                with T.If(rows >= PARALLEL_ROWS):
                    with T.Then():
                        with T.parallel(_c(0), rows) as m:
                            row(m, xf, of)
                    with T.Else():
                        with T.serial(_c(0), rows) as m:
                            row(m, xf, of)
    return _with_body(func, ib.get().body)


# ----------------------------------------------------------------- matmul kernel
class _MatmulKernel(PanelLoops):
    """Emits the matmul kernel's body with the IR builder (see the module docstring)."""

    def __init__(self, acts, weight, out, epilogue, amx: bool) -> None:
        self.acts, self.weight, self.out, self.epilogue = acts, weight, out, epilogue
        self.n, self.k = _static(weight.shape[0]), _static(weight.shape[1])
        self.pairs = self.k // 2
        self.panels, self.tail = divmod(self.n, PANEL)
        self.np = next(
            (p for p in NP_CHOICES if self.panels % p == 0 and self.panels // p >= MIN_TILES), 1
        )
        # AMX blocks need whole 32-element K steps and at least one pair of panels
        self.amx = amx and self.k % AMX_K == 0 and self.panels >= 2

    def _act(self, m, kp):
        """The activation pair kp of row m (32 bits), broadcast to the 16 lanes."""
        word = tirx.reinterpret("int32", self.af[_ramp(m * self.k + kp * 2, 2)])
        return _bcast(word, 16)

    def _weights(self, panel, kp):
        """The K-pair kp of the 16 rows of a (full) panel: 32 bf16 as int32x16."""
        off = panel * (PANEL * self.k) + kp * (2 * PANEL)
        return tirx.reinterpret(I32X16, self.wf[_ramp(off, 32)])

    def _lead(self, m) -> list:
        lead, rest = [], m
        for d in reversed(list(self.out.shape[:-1])):
            lead.insert(0, rest % d)
            rest = rest // d
        return lead

    def micro(self, m0, mr: int, p0, npn: int) -> None:
        accs = [[T.alloc_buffer((PANEL,), F32) for _ in range(npn)] for _ in range(mr)]
        zero = _bcast(tirx.const(0, F32), 16)
        all16 = _ramp(_c(0), 16)
        for r in range(mr):
            for j in range(npn):
                T.buffer_store(accs[r][j], zero, [all16])
        with T.serial(_c(0), _c(self.pairs)) as kp:
            if PREFETCH_TILES:  # int8.py's: the first row tile, the tile so many ahead
                with T.If(m0 == _c(0)):
                    with T.Then():
                        for j in range(npn):
                            ahead = self.panel_ahead(p0, j)
                            prefetch(self.wf, ahead * (PANEL * self.k) + kp * (2 * PANEL))
            acts = [self._act(m0 + r, kp) for r in range(mr)]
            for j in range(npn):
                w = self._weights(p0 + j, kp)
                for r in range(mr):
                    value = T.call_pure_extern(F32X16, DOT, accs[r][j][all16], w, acts[r])
                    T.buffer_store(accs[r][j], value, [all16])
        for r in range(mr):
            lead = self._lead(m0 + r)
            for j in range(npn):
                col = (p0 + j) * PANEL
                with T.vectorized(_c(0), _c(PANEL)) as lane:
                    value = self.epilogue(accs[r][j][lane], lead, col + lane)
                    T.buffer_store(self.out, value, [*lead, col + lane])

    def tail_outputs(self, rows) -> None:
        """The last N % 16 outputs (a panel of `tail` rows, [K/2, tail, 2]), in scalar code
        with vdpbf16ps's order: per pair the odd product, then the even one."""
        width, base = self.tail, self.panels * PANEL * self.k

        def f32(bits):
            return tirx.reinterpret(F32, bits.astype("uint32") << tirx.const(16, "uint32"))

        with T.serial(_c(0), rows) as m:
            with T.serial(_c(0), _c(width)) as lane:
                acc = T.alloc_buffer((1,), F32)
                T.buffer_store(acc, tirx.const(0, F32), [_c(0)])
                with T.serial(_c(0), _c(self.pairs)) as kp:
                    value = acc[_c(0)]
                    for half in (1, 0):
                        a = f32(self.af[m * self.k + kp * 2 + half])
                        w = f32(self.wf[base + (kp * width + lane) * 2 + half])
                        value = value + a * w
                    T.buffer_store(acc, value, [_c(0)])
                col = self.panels * PANEL + lane
                lead = self._lead(m)
                T.buffer_store(self.out, self.epilogue(acc[_c(0)], lead, col), [*lead, col])

    def amx_loops(self, rows) -> None:
        """Rows in blocks of 32 x output panels in pairs through AMX (in parallel; a thread's
        consecutive blocks share a pair of panels, whose weights stay in its caches while
        the activation rows pass); then the rows past the last whole block against every
        panel, the rows of the blocks against an odd last panel, and the N % 16 tail, through
        the vdpbf16ps micro-kernels."""
        blocks = rows // AMX_BLOCK
        pairs = self.panels // 2
        done = blocks * AMX_BLOCK
        with T.parallel(_c(0), blocks * pairs) as t:
            c = T.alloc_buffer((AMX_BLOCK * AMX_BLOCK,), F32)
            b, pair = t % blocks, t // blocks
            a_at = b * (AMX_BLOCK * self.k)
            w_at = pair * (2 * PANEL * self.k)
            T.evaluate(
                T.call_extern(
                    "void",
                    AMX,
                    T.address_of(self.af[a_at]),
                    _c(2 * self.k),  # bytes per activation row
                    T.address_of(self.wf[w_at]),
                    T.address_of(self.wf[w_at + PANEL * self.k]),
                    _c(self.k // AMX_K),
                    T.address_of(c[_c(0)]),
                )
            )
            with T.serial(_c(0), _c(AMX_BLOCK)) as r:
                lead = self._lead(b * AMX_BLOCK + r)
                for j in range(2):
                    col = (pair * 2 + j) * PANEL
                    with T.vectorized(_c(0), _c(PANEL)) as lane:
                        value = self.epilogue(c[r * AMX_BLOCK + j * PANEL + lane], lead, col + lane)
                        T.buffer_store(self.out, value, [*lead, col + lane])
        with T.If(done < rows):
            with T.Then():
                self.panel_tiles(rows, start=done)
        if self.panels % 2:
            self.row_tiles(done, _c(self.panels - 1), 1)
        if self.tail:
            self.tail_outputs(rows)

    def build(self):
        rows = _rows(self.acts)
        with IRBuilder() as ib:
            with T.prim_func():
                self.af, self.wf = _flat(self.acts), _flat(self.weight)
                with _with_wrappers(self.amx):
                    if not self.amx:
                        self.panel_loops(rows)
                    else:
                        with T.If(rows >= AMX_MIN_ROWS):
                            with T.Then():
                                self.amx_loops(rows)
                            with T.Else():
                                self.panel_loops(rows)
        return ib.get().body


def _matmul_kernel(func: tirx.PrimFunc, amx: bool) -> tirx.PrimFunc | None:
    sch = s_tir.Schedule(func)
    (block,) = _annotated_blocks(sch)
    reads = [r.source for r in sch.get(block).reads]
    if len(reads) != 2:
        return None
    acts, weight = reads
    n, k = _static(weight.shape[0]), _static(weight.shape[1])
    if (
        acts.dtype != "uint16"
        or weight.dtype != "uint16"
        or n is None
        or k is None
        or k % 2
        or _static(acts.shape[-1]) != k
    ):
        return None
    found = _epilogue(sch, block, func)
    if found is None:
        return None
    out, epilogue = found
    return _with_body(func, _MatmulKernel(acts, weight, out, epilogue, amx).build())


def schedule(func: tirx.PrimFunc, bf16_bits: int, amx: bool = False) -> tirx.PrimFunc | None:
    """The vdpbf16ps kernel for a bf16-activation op of quant/modules.py (with `amx`, its
    matmul multiplies blocks of 32 rows in AMX tiles), or None for any other function (or
    when the target has no AVX512-BF16: the TE body then runs as scheduled by the generic
    rules)."""
    sch = s_tir.Schedule(func)
    blocks = _annotated_blocks(sch)
    if len(blocks) != 1:
        return None
    kind = str(sch.get(blocks[0]).annotations[BF16_ATTR])
    if not bf16_bits:
        LOG.warning("bf16 activations without AVX512-BF16: %s runs its reference TE body", kind)
        return None
    result = _round_kernel(func) if kind == "round" else _matmul_kernel(func, amx)
    if result is None:
        LOG.warning("bf16 rule: unexpected %s function; it runs its reference TE body", kind)
    return result
