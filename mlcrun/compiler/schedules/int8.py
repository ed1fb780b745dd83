"""CPU kernels for int8 activations: quantize x per group of 32, multiply with VNNI or AVX2.

quant/modules.py emits two TE ops per q4/q8 Linear when a model is compiled with
`--activations int8`; their TE bodies state the math (and are what a CPU without this rule
would run, slowly). This rule recognises them by their `INT8_ATTR` block annotation and
replaces each function's body with a kernel written here:

* `quantize_q4` / `quantize_q8`: per row and group of 32, amax (a tree of vector maxima over
  halves, `lane_tree`: LLVM's vector.reduce.fmax was 16 dependent scalar steps), codes =
  rint(x * 127 / amax) as int8 (q4: each 8 elements even ones first, the order the q4 kernel's
  nibbles come in), the scale amax / 127 and the exact code sum. Bit for bit
  numpy_ref.quantize_activations. Rows run in parallel from PARALLEL_ROWS rows on; a decode
  step's few rows stay on the calling thread (no thread-pool launch).
* `matmul_q4` / `matmul_q4_sym` / `matmul_q8` (+ whatever FuseOps fused after them: bias,
  residual add, ...): the weights are in panels of 16 output rows (numpy_ref.tile_rows), so
  each `vpdpbusd` multiplies 64 weight bytes -- 4 K-elements of 16 outputs, the unsigned
  operand (q4 codes 0..15 after an AND or a shift of their word; q8 codes + 128) -- with 4
  activation codes broadcast to the 16 lanes (the signed operand), adding into 16 int32
  output lanes. Per group of 32 the int32 sums become float once: y += dot * (w_scale *
  a_scale) (+ w_min * a_scale * a_sum for q4 with mins); q8's +128 and the symmetric q4's
  (q4f16_0) -8 are undone exactly by starting the int32 sum at -128 * a_sum or -8 * a_sum
  (`_Operands.zero`).
  A micro-kernel holds MR rows x NP panels of accumulators (MR * NP * 2 zmm registers) and
  unpacks each weight vector once for its MR rows; the parallel loop runs over tiles of NP
  panels, each streaming all rows (M = 1 decode, small-M batches and prefill alike: the tile's
  weights stay in L1 while the rows pass, MR rows at a time, the rest 1..MR-1 at the end).
  From MR + 1 to NARROW_ROWS rows (a verify of 5-8 tokens) a tile runs one panel at a time
  with all its rows instead (MR x NP accumulators either way), so each weight vector is
  unpacked once, not once for 4 rows and again for the rest: SmolLM2 Q4_1, 2 threads, Intel
  Xeon, alternating runs of a 5-, 6- and 8-token verify step: 6.48 -> 5.99, 6.89 -> 6.33 and
  8.33 -> 7.53 ms.
  Panels that do not fill a tile and the last N % 16 outputs run after the parallel loop
  (scalar code for the latter: only odd-shaped layers have them).
  The first row tile of a tile prefetches the next tile (PREFETCH_TILES), group by group: its
  weight lines and the lines of its scales and mins. A thread's tiles are contiguous, but one
  row passes a tile so fast that the hardware prefetchers fall behind: SmolLM2's q4f16_1
  layers at M = 1, 2 threads, Zen 4: a step's matmuls 4.5-4.75 -> 3.3-3.6 ms (2 or 4 tiles
  ahead: no better, within the noise).

The epilogue is applied to each output tile as it leaves the registers: the fused blocks
after the matmul are inlined into one, and its value expression is evaluated with the
accumulated sum in place of the matmul's result.

Targets (compiler/target.py `int8_dot`): 512-bit vpdpbusd with AVX512-VNNI; with only AVX-VNNI
(VEX, 256-bit) each 16-lane tile is two 8-lane halves (same layout, same results). Without
VNNI, AVX2 does what one vpdpbusd does in two steps, as llama.cpp does there: `vpmaddubsw`
multiplies unsigned by signed bytes and adds neighbouring pairs into int16 lanes, and
`vpmaddwd` by ones adds pairs of those into int32 lanes. vpmaddubsw saturates at 32767:
* q4: codes 0..15 times activations in [-127, 127] give at most 2 * 15 * 127 = 3810 per
  pair, so a whole group (8 vpmaddubsw into each int16 lane) stays within 30480 and is summed
  in int16; one vpmaddwd per group then widens it.
* q8: the stored codes + 128 (up to 255) would overflow, so the sign trick: the unsigned
  operand is |code| (up to 128), the signed one the activations with the code's sign
  (`vpsignb`), at most 2 * 128 * 127 = 32512 per pair; each step widens at once. The codes are
  exact signed values then, so the int32 sum starts at 0 instead of -128 * a_sum.
AVX2 has 16 vector registers: its tiles are one panel wide (4 rows x 2 halves of 8 outputs),
and the rows of q8 and of the symmetric q4 run each half in its own pass (`micro`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm_ffi
from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ...quant import numpy_ref
from ...quant.modules import INT8_ATTR

LOG = logging.getLogger(__name__)

GROUP = 32  # activation / weight group (quant/presets.py GROUP_SIZE)
PANEL = numpy_ref.PANEL  # output rows per weight panel = int32 lanes of a 512-bit vpdpbusd
MR = 4  # rows per micro-kernel: 4 x 2 panels = 8 int32 + 8 float zmm accumulators
NARROW_ROWS = 8  # up to this many rows, one pass per panel (PanelLoops.row_tiles; 512-bit VNNI)
PARALLEL_ROWS = 32  # the quantize kernel runs rows in parallel from this many rows on
PREFETCH_TILES = 1  # the first row tile prefetches the tile so many ahead (module doc)
LINE = 64  # bytes per cache line
I64 = "int64"
F32 = "float32"


def _c(value: int) -> tirx.PrimExpr:
    return tirx.const(value, I64)


def _ramp(base: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    return tirx.Ramp(base, _c(1), lanes)


def _bcast(value: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    return tirx.Broadcast(value, lanes)


def _flat(buf, dtype: str | None = None):
    """A 1-D view of a buffer (same data)."""
    size = _c(1)
    for d in buf.shape:
        size = size * d
    return T.decl_buffer((size,), dtype or buf.dtype, data=buf.data)


def _rows(buf) -> tirx.PrimExpr:
    """The product of all but the last dim (the activations' rows)."""
    rows = _c(1)
    for d in buf.shape[:-1]:
        rows = rows * d
    return rows


def _with_body(func: tirx.PrimFunc, body) -> tirx.PrimFunc:
    """`func` running `body` (inside a root block: relax passes expect one)."""
    root = s_tir.SBlock([], [], [], "root", body)
    return func.with_body(s_tir.SBlockRealize([], True, root))


def lane_tree(vec: tirx.PrimExpr, combine, lanes: int) -> tirx.PrimExpr:
    """combine over the lanes of `vec`, as a tree of halves (LLVM's vector.reduce.fmax became
    16 dependent scalar steps with NaN checks, ~130 cycles a group of 32 activations)."""
    while lanes > 1:
        lanes //= 2
        low = tirx.Shuffle([vec], [tirx.IntImm("int32", i) for i in range(lanes)])
        high = tirx.Shuffle([vec], [tirx.IntImm("int32", lanes + i) for i in range(lanes)])
        vec = combine(low, high)
    return vec


def prefetch(buf, *index) -> None:
    """Emit a prefetch of the cache line holding buf[index] (one index per dimension)."""
    addr = tirx.address_of(tirx.BufferLoad(buf, list(index)))
    # llvm.prefetch(ptr, rw = read, locality = 2 (prefetcht1: L2 and out), cache = data)
    args = [tirx.const(v, "int32") for v in (0, 2, 1)]
    T.evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", addr, *args))


def _static(expr) -> int | None:
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


# ----------------------------------------------------------------- finding the ops
def _annotated_blocks(sch: s_tir.Schedule) -> list:
    root = sch.get_sblock(sch.mod["main"].body.block.name_hint)
    return [b for b in sch.get_child_blocks(root) if INT8_ATTR in sch.get(b).annotations]


def _buffers(func: tirx.PrimFunc) -> list:
    """The function's buffer params (skipping scalar ones such as symbolic shape vars)."""
    return [p for p in func.params if "Buffer" in type(p.ty).__name__]


# ----------------------------------------------------------------- quantize kernel
def _quantize_kernel(func: tirx.PrimFunc, kind: str) -> tirx.PrimFunc | None:
    bufs = _buffers(func)
    xs = [b for b in bufs if b.dtype == F32 and len(b.shape) >= 1]
    codes = [b for b in bufs if b.dtype == "int8"]
    sums = [b for b in bufs if b.dtype == "int32"]
    if len(bufs) != 4 or len(codes) != 1 or len(sums) != 1 or len(xs) != 2:
        return None
    codes, sums = codes[0], sums[0]
    k = _static(codes.shape[-1])
    x = next((b for b in xs if _static(b.shape[-1]) == k), None)
    scale = next((b for b in xs if b is not x), None)
    if k is None or k % GROUP or x is None or _static(scale.shape[-1]) != k // GROUP:
        return None
    g_count = k // GROUP
    order = list(range(GROUP))
    if kind == "q4":  # position p holds element src(p): each word's even elements first
        order = [p - p % 8 + (p % 4) * 2 + (p % 8) // 4 for p in range(GROUP)]

    def row(m, xf, cf, sf, uf) -> None:
        with T.serial(_c(0), _c(g_count)) as g:
            base = m * k + g * GROUP
            halves = [xf[_ramp(base + h * 16, 16)] for h in range(2)]
            amax = T.bind(
                lane_tree(tirx.max(tirx.abs(halves[0]), tirx.abs(halves[1])), tirx.max, 16)
            )
            live = amax >= tirx.const(numpy_ref.AMAX_FLOOR, F32)
            inv = tirx.Select(live, tirx.const(127, F32) / amax, tirx.const(0, F32))
            total = None
            for h in range(2):
                part = order[h * 16 : (h + 1) * 16]
                vec = tirx.Shuffle(halves, [tirx.IntImm("int32", i) for i in part])
                q = tirx.nearbyint(vec * _bcast(inv, 16))
                q = tirx.max(
                    tirx.min(q, _bcast(tirx.const(127, F32), 16)), _bcast(tirx.const(-127, F32), 16)
                )
                q32 = q.astype("int32x16")
                T.buffer_store(cf, q32.astype("int8x16"), [_ramp(base + h * 16, 16)])
                total = q32 if total is None else total + q32
            T.buffer_store(
                uf,
                tirx.call_llvm_pure_intrin("int32", "llvm.vector.reduce.add", total),
                [m * g_count + g],
            )
            T.buffer_store(sf, amax / tirx.const(127, F32), [m * g_count + g])

    rows = _rows(codes)
    with IRBuilder() as ib:
        with T.prim_func():
            xf, cf, sf, uf = _flat(x), _flat(codes), _flat(scale), _flat(sums)
            with T.If(rows >= PARALLEL_ROWS):
                with T.Then():
                    with T.parallel(_c(0), rows) as m:
                        row(m, xf, cf, sf, uf)
                with T.Else():
                    with T.serial(_c(0), rows) as m:
                        row(m, xf, cf, sf, uf)
    return _with_body(func, ib.get().body)


# ----------------------------------------------------------------- matmul kernel
@dataclass(frozen=True)
class _Operands:
    kind: str  # "q4" | "q8"
    codes: object  # [..., K] int8 activation codes
    ascale: object  # [..., K/32] f32
    asum: object  # [..., K/32] int32
    weight: object  # q4: [N, K/8] uint32 words; q8: [N, K] uint8 (codes + 128), in panels
    wscale: object  # [N, K/32] in panels: a panel's groups of 16 scales one after another
    wmin: object | None  # the same (q4 with mins)
    zero: int  # the weight code of zero: q8 128 (codes + 128), symmetric q4 8, q4 with mins 0
    n: int
    k: int


def _operands(func: tirx.PrimFunc, block_stmt, kind: str, symmetric: bool) -> _Operands | None:
    """The matmul's inputs, from its block's reads (the TE op reads codes, scale, weight,
    w_scale[, w_min] in that order) and the params (the code sums are not read by the TE
    body)."""
    reads = [r.source for r in block_stmt.reads]
    with_mins = kind == "q4" and not symmetric
    if len(reads) != (5 if with_mins else 4):
        return None
    codes, ascale, weight, wscale = reads[:4]
    wmin = reads[4] if with_mins else None
    zero = 128 if kind == "q8" else numpy_ref.Q4_ZERO if symmetric else 0
    asum = [
        b
        for b in _buffers(func)
        if b.dtype == "int32" and len(b.shape) == len(ascale.shape)
        and _static(b.shape[-1]) == _static(ascale.shape[-1])
    ]  # fmt: skip
    n, k = _static(wscale.shape[0]), _static(codes.shape[-1])
    wdtype = "uint32" if kind == "q4" else "uint8"
    if (
        len(asum) != 1
        or n is None
        or k is None
        or k % GROUP
        or codes.dtype != "int8"
        or weight.dtype != wdtype
        or _static(wscale.shape[1]) != k // GROUP
    ):
        return None
    return _Operands(kind, codes, ascale, asum[0], weight, wscale, wmin, zero, n, k)


def _epilogue(sch: s_tir.Schedule, block, func: tirx.PrimFunc):
    """(output buffer, fn(acc, lead_indices, col) -> value) for the blocks fused after the
    matmul, or None if they are not one elementwise chain over the matmul's output."""
    result = sch.get(block).writes[0].source
    params = _buffers(func)
    root = sch.get_sblock(sch.mod["main"].body.block.name_hint)
    children = sch.get_child_blocks(root)
    pos = next(i for i, b in enumerate(children) if sch.get(b).same_as(sch.get(block)))
    after = list(children[pos + 1 :])
    if not after:
        if not any(result.same_as(p) for p in params):
            return None
        return result, lambda acc, lead, col: acc
    for b in after[:-1]:  # a chain add -> add -> cast collapses into its last block
        sch.compute_inline(b)
    last = sch.get(after[-1])
    store = last.body
    if not hasattr(store, "value") or len(last.writes) != 1:
        return None
    out = last.writes[0].source
    block_vars = [iv.var for iv in last.iter_vars]
    indices = list(store.indices)
    if not any(out.same_as(p) for p in params) or len(indices) != len(block_vars):
        return None
    if not all(isinstance(i, tirx.Var) and i.same_as(v) for i, v in zip(indices, block_vars)):
        return None
    if [str(d) for d in out.shape] != [str(d) for d in result.shape]:
        return None
    acc = tirx.Var("acc", F32)
    ok = [True]

    def on_load(load):
        source = load.source
        if source.same_as(result):
            if not all(
                isinstance(i, tirx.Var) and i.same_as(v) for i, v in zip(load.indices, block_vars)
            ):
                ok[0] = False
            return acc
        if not any(source.same_as(p) for p in params):
            ok[0] = False  # reads another intermediate
        return load

    load_type = type(result[tuple(_c(0) for _ in result.shape)])
    expr = tvm_ffi.structural_map(store.value, [(load_type, on_load)])
    if not ok[0]:
        return None

    def apply(value, lead, col):
        targets = [*lead, col]

        def on_var(var):
            if var.same_as(acc):
                return value
            for v, e in zip(block_vars, targets, strict=True):
                if var.same_as(v):
                    return e
            return var

        return tvm_ffi.structural_map(expr, [(tirx.Var, on_var)])

    return out, apply


class PanelLoops:
    """The loop nest of a panel kernel (int8 here, bf16.py): tiles of `np` panels of 16
    outputs in parallel, each streaming every row through `micro` MR rows at a time; the
    panels left over one at a time; then the last N % 16 outputs (`tail_outputs`)."""

    panels: int  # whole panels of N
    np: int  # panels per parallel tile
    tail: int  # N % 16

    def micro(self, m0, mr: int, p0, npn: int) -> None: ...

    def tail_outputs(self, rows) -> None: ...

    def panel_ahead(self, p0, j: int):
        """The panel PREFETCH_TILES tiles after panel p0 + j, clamped to the last whole one."""
        return tirx.min(p0 + j + PREFETCH_TILES * self.np, _c(self.panels - 1))

    narrow_rows = 0  # see row_tiles

    def row_tiles(self, rows, p0, npn: int, start=None) -> None:
        """Rows start (default 0) .. rows-1 against panels p0 .. p0+npn-1: MR at a time, then
        the remainder. From MR + 1 to `narrow_rows` rows (a verify step's few), one pass per
        panel for all the rows instead, so each weight vector is unpacked once, not once
        for MR rows and again for the rest."""
        count = rows if start is None else rows - start
        if self.narrow_rows > MR and start is None:
            with T.If(tirx.all(count > MR, count <= self.narrow_rows)):
                with T.Then():
                    for mr in range(MR + 1, self.narrow_rows + 1):
                        with T.If(count == mr):
                            with T.Then():
                                for j in range(npn):
                                    self.micro(_c(0), mr, p0 + j, 1)
                with T.Else():
                    self._mr_tiles(rows, count, p0, npn, start)
        else:
            self._mr_tiles(rows, count, p0, npn, start)

    def _mr_tiles(self, rows, count, p0, npn: int, start) -> None:
        with T.serial(_c(0), count // MR) as mo:
            self.micro(mo * MR if start is None else start + mo * MR, MR, p0, npn)
        for rem in range(1, MR):
            with T.If(count % MR == rem):
                with T.Then():
                    self.micro(rows - rem, rem, p0, npn)

    def panel_tiles(self, rows, start=None) -> None:
        """Rows start (default 0) .. rows-1 against every whole panel: tiles of np panels in
        parallel, then the panels left over one at a time."""
        tiles = self.panels // self.np
        if tiles:
            with T.parallel(_c(0), _c(tiles)) as t:
                self.row_tiles(rows, t * self.np, self.np, start)
        for p in range(tiles * self.np, self.panels):  # fewer than np panels left
            self.row_tiles(rows, _c(p), 1, start)

    def panel_loops(self, rows) -> None:
        self.panel_tiles(rows)
        if self.tail:
            self.tail_outputs(rows)


class _MatmulKernel(PanelLoops):
    """Emits the matmul kernel's body with the IR builder (see the module docstring)."""

    def __init__(self, ops: _Operands, out, epilogue, dot: str) -> None:
        self.ops, self.out, self.epilogue = ops, out, epilogue
        self.lanes = 16 if dot == "avx512vnni" else 8  # int32 lanes per dot product
        self.intrin = f"llvm.x86.avx512.vpdpbusd.{32 * self.lanes}"
        self.pairs = dot == "avx2"  # vpmaddubsw + vpmaddwd (module doc)
        self.groups = ops.k // GROUP
        self.cols = _static(ops.weight.shape[1])  # words (q4) or bytes (q8) per row
        self.steps = 4 if ops.kind == "q4" else 8  # words / 4-byte quads per group
        self.panels, self.tail = divmod(ops.n, PANEL)
        wide = not self.pairs and self.panels % 2 == 0 and self.panels >= 2
        self.np = 2 if wide else 1
        self.narrow_rows = NARROW_ROWS if wide and self.lanes == 16 else 0

    # -- pieces
    def _dot(self, acc, weights, acts):
        return tirx.call_llvm_pure_intrin(f"int32x{self.lanes}", self.intrin, acc, weights, acts)

    def _pair_dot(self, weights, acts):
        """AVX2 vpmaddubsw: unsigned weight bytes x signed activation bytes, neighbouring
        products added into 16 int16 lanes (saturating; see the module doc for the bounds)."""
        return tirx.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", weights, acts)

    def _widen(self, pairs):
        """AVX2 vpmaddwd by ones: neighbouring int16 lanes added into 8 int32 lanes."""
        ones = _bcast(tirx.const(1, "int16"), 16)
        return tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, ones)

    def _signed_q8_dot(self, acc, weights, acts):
        """acc + the int32 dot of q8 codes (stored + 128) and activations, on AVX2: the sign
        trick keeps vpmaddubsw's pairs under 32767 (module doc)."""

        def sign(x, by):  # x with the sign of `by` (0 where by is 0); -(-128) wraps to 128
            return tirx.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", x, by)

        codes = tirx.reinterpret("int8x32", weights) ^ _bcast(tirx.const(-128, "int8"), 32)
        return acc + self._widen(self._pair_dot(sign(codes, codes), sign(acts, codes)))

    def _act(self, m, offset):
        """4 activation codes at row m, column `offset`, broadcast as the signed operand."""
        word = tirx.reinterpret("int32", self.a8[_ramp(m * self.ops.k + offset, 4)])
        return tirx.reinterpret(f"int8x{4 * self.lanes}", _bcast(word, self.lanes))

    def _weight_vectors(self, panel, g, step, half):
        """The unsigned operand(s) for one step of a group: q4 -> (low, high) nibbles of the
        words, q8 -> (codes,)."""
        lanes, byte_t = self.lanes, f"int8x{4 * self.lanes}"
        if self.ops.kind == "q4":
            off = panel * (PANEL * self.cols) + (g * 4 + step) * PANEL + half * lanes
            words = self.wf[_ramp(off, lanes)]
            mask = _bcast(tirx.const(0x0F0F0F0F, "uint32"), lanes)
            four = _bcast(tirx.const(4, "uint32"), lanes)
            return (
                tirx.reinterpret(byte_t, words & mask),
                tirx.reinterpret(byte_t, (words >> four) & mask),
            )
        off = panel * (PANEL * self.cols) + (g * 8 + step) * (4 * PANEL) + half * 4 * lanes
        return (tirx.reinterpret(byte_t, self.wf[_ramp(off, 4 * lanes)]),)

    def _prefetch_group(self, panel, g) -> None:
        """Prefetch group g of `panel`: its weight bytes, one cache line per 64, and the line
        holding its 16 scales (and mins)."""
        per_group = PANEL * GROUP // (2 if self.ops.kind == "q4" else 1)  # weight bytes
        elem = 4 if self.ops.kind == "q4" else 1  # bytes per element of wf
        first = panel * (PANEL * self.cols) + g * (per_group // elem)
        lines = [(self.wf, first + _c(b // elem)) for b in range(0, per_group, LINE)]
        col = (panel * self.groups + g) * PANEL
        lines += [(buf, col) for buf in (self.sf, self.mf) if buf is not None]
        for buf, index in lines:
            prefetch(buf, index)

    def _dot_start(self, row, signed_codes: bool = False):
        """The int32 start of a group's dot product: -zero * (the activation codes' sum), so
        the sum of codes * activations comes out as that of (codes - zero) * activations (0
        where the kernel multiplies the signed codes themselves: AVX2's q8)."""
        if not self.ops.zero or signed_codes:
            return tirx.const(0, "int32")
        return self.us[row] * tirx.const(-self.ops.zero, "int32")

    def _act_offsets(self, g, step):
        if self.ops.kind == "q4":  # the word's even codes, then its odd ones
            return (g * GROUP + step * 8, g * GROUP + step * 8 + 4)
        return (g * GROUP + step * 4,)

    def _store(self, m, col, value_of_lane) -> None:
        """out[row m, col + lane] = epilogue(value) for the 16 lanes of a tile."""
        lead_shape = list(self.out.shape[:-1])
        lead = []
        rest = m
        for d in reversed(lead_shape):
            lead.insert(0, rest % d)
            rest = rest // d
        with T.vectorized(_c(0), _c(PANEL)) as lane:
            value = self.epilogue(value_of_lane(lane), lead, col + lane)
            T.buffer_store(self.out, value, [*lead, col + lane])

    def _group_sums(self, f, acc, at, m0, mr: int, panel, g, h) -> None:
        """f[at(r)[0]] += the group's integer sums acc[at(r)[1]] of half h of `panel` as
        floats, for rows r < mr: times the weight and activation scales, plus the mins' term
        (q4 with mins). AVX2's q4 sums are int16 pairs, widened first."""
        lanes = self.lanes
        col = (panel * self.groups + g) * PANEL + h * lanes
        ws = self.sf[_ramp(col, lanes)].astype(f"float32x{lanes}")
        wm = None if self.mf is None else self.mf[_ramp(col, lanes)].astype(f"float32x{lanes}")
        for r in range(mr):
            row = (m0 + r) * self.groups + g
            da = self.ds[row]
            fi, ai = at(r)
            dot = acc[ai]
            if acc.dtype == "int16":
                dot = self._widen(dot) + _bcast(self._dot_start(row), lanes)
            term = dot.astype(f"float32x{lanes}") * (ws * _bcast(da, lanes))
            if wm is not None:
                term = term + wm * _bcast(da * self.us[row].astype(F32), lanes)
            T.buffer_store(f, f[fi] + term, [fi])

    # -- the micro-kernel: mr rows x npn panels
    def micro(self, m0, mr: int, p0, npn: int) -> None:
        lanes, halves = self.lanes, PANEL // self.lanes
        tiles = mr * npn * PANEL
        # AVX2's q4 sums a group's products in int16 lanes, two per output (module doc)
        sums16 = self.pairs and self.ops.kind == "q4"
        width = 2 * lanes if sums16 else lanes  # accumulator lanes per 8- or 16-output half
        f = T.alloc_buffer((tiles,), F32)
        acc = T.alloc_buffer((tiles * width // lanes,), "int16" if sums16 else "int32")
        zero_f = _bcast(tirx.const(0, F32), lanes)
        for i in range(tiles // lanes):
            T.buffer_store(f, zero_f, [_ramp(_c(i * lanes), lanes)])

        def idx(r, j, h):  # the float sums of rows r, panel j, half h
            return _ramp(_c((r * npn + j) * PANEL + h * lanes), lanes)

        def at(r, j, h):  # their integer sums
            return _ramp(_c(((r * npn + j) * PANEL + h * lanes) * width // lanes), width)

        def step_dot(value, w, a):
            if sums16:
                return value + self._pair_dot(w, a)
            if self.pairs:
                return self._signed_q8_dot(value, w, a)
            return self._dot(value, w, a)

        # VNNI: one pass over the groups for all panels and halves of the tile; so AVX2's q4
        # with mins (int16 sums) and a single row of any kind, whose halves then share the
        # activations' broadcasts and per-row factors. AVX2's q8 and symmetric q4 with more
        # rows: one pass per half panel, so that the rows' accumulators, operands and
        # broadcasts fit the 16 registers. One Zen 3 thread, a 3072 x 576 layer, thread CPU
        # time, per half / one pass: q4f16_1 1 row 65.6 / 57.3 us, 4 rows 149 / 145, 5 rows
        # 200 / 187, 64 rows 2401 / 2345; q8f32 1 row 63.8 / 53.4, 2 rows 85.0 / 94.2, 4 rows
        # 257 / 283. In one pass the symmetric q4 (q4f16_0) spilled twice q4f16_1's vectors
        # (each row's broadcast activations kept on the stack for the second half: 44 stores
        # and 44 reloads a group at 4 rows against 22); per half, AVX2 code on one Intel Xeon
        # thread, 2 / 4 / 8 / 64 rows: 55.9 / 99.9 / 191 / 1623 -> 54.2 / 89.1 / 173 / 1495
        # us, where q4f16_1 per half was up to 14% slower.
        parts = [(j, h) for j in range(npn) for h in range(halves)]
        per_half = self.pairs and self.ops.wmin is None and mr > 1  # all but q4 with mins
        for n_pass, part in enumerate([[p] for p in parts] if per_half else [parts]):
            with T.serial(_c(0), _c(self.groups)) as g:
                if PREFETCH_TILES and n_pass == 0:
                    with T.If(m0 == _c(0)):
                        with T.Then():
                            for j in range(npn):
                                self._prefetch_group(self.panel_ahead(p0, j), g)
                for r in range(mr):
                    row = (m0 + r) * self.groups + g
                    start = tirx.const(0, "int16") if sums16 else self._dot_start(row, self.pairs)
                    for j, h in part:
                        T.buffer_store(acc, _bcast(start, width), [at(r, j, h)])
                for step in range(self.steps):
                    offsets = self._act_offsets(g, step)
                    for j, h in part:
                        weights = self._weight_vectors(p0 + j, g, step, h)
                        for r in range(mr):
                            value = acc[at(r, j, h)]
                            for w, off in zip(weights, offsets):
                                value = step_dot(value, w, self._act(m0 + r, off))
                            T.buffer_store(acc, value, [at(r, j, h)])
                for j, h in part:
                    both = lambda r, j=j, h=h: (idx(r, j, h), at(r, j, h))  # noqa: E731
                    self._group_sums(f, acc, both, m0, mr, p0 + j, g, h)
        for r in range(mr):
            for j in range(npn):
                base = (r * npn + j) * PANEL
                self._store(m0 + r, (p0 + j) * PANEL, lambda lane, base=base: f[_c(base) + lane])

    def tail_outputs(self, rows) -> None:
        """The last N % 16 outputs (a panel of `tail` lanes), in scalar code."""
        ops, width = self.ops, self.tail
        base_panel = self.panels * PANEL * self.cols
        with T.serial(_c(0), rows) as m:
            with T.serial(_c(0), _c(width)) as lane:
                f = T.alloc_buffer((1,), F32)
                T.buffer_store(f, tirx.const(0, F32), [_c(0)])
                with T.serial(_c(0), _c(self.groups)) as g:
                    row = m * self.groups + g
                    dot = T.alloc_buffer((1,), "int32")
                    T.buffer_store(dot, self._dot_start(row), [_c(0)])
                    with T.serial(_c(0), _c(self.steps)) as step:
                        total = dot[_c(0)]
                        if ops.kind == "q4":
                            word = self.wf[base_panel + (g * 4 + step) * width + lane]
                            for c in range(8):
                                code = (word >> tirx.const(4 * c, "uint32")) & tirx.const(
                                    15, "uint32"
                                )
                                pos = c // 2 + 4 * (c % 2)
                                a = self.a8[m * ops.k + g * GROUP + step * 8 + pos]
                                total = total + code.astype("int32") * a.astype("int32")
                        else:
                            for b in range(4):
                                u = self.wf[base_panel + ((g * 8 + step) * width + lane) * 4 + b]
                                a = self.a8[m * ops.k + g * GROUP + step * 4 + b]
                                total = total + u.astype("int32") * a.astype("int32")
                        T.buffer_store(dot, total, [_c(0)])
                    col = self.panels * PANEL * self.groups + g * width + lane
                    da = self.ds[row]
                    term = dot[_c(0)].astype(F32) * (self.sf[col].astype(F32) * da)
                    if self.mf is not None:
                        term = term + self.mf[col].astype(F32) * (da * self.us[row].astype(F32))
                    T.buffer_store(f, f[_c(0)] + term, [_c(0)])
                lead_shape = list(self.out.shape[:-1])
                lead, rest = [], m
                for d in reversed(lead_shape):
                    lead.insert(0, rest % d)
                    rest = rest // d
                col = self.panels * PANEL + lane
                T.buffer_store(self.out, self.epilogue(f[_c(0)], lead, col), [*lead, col])

    def build(self):
        ops = self.ops
        rows = _rows(ops.codes)
        with IRBuilder() as ib:
            with T.prim_func():
                self.a8 = _flat(ops.codes)
                self.ds, self.us = _flat(ops.ascale), _flat(ops.asum)
                self.wf, self.sf = _flat(ops.weight), _flat(ops.wscale)
                self.mf = _flat(ops.wmin) if ops.wmin is not None else None
                self.panel_loops(rows)
        return ib.get().body


def _matmul_kernel(func: tirx.PrimFunc, name: str, dot: str) -> tirx.PrimFunc | None:
    """`name`: "q4", "q4_sym" (no mins) or "q8"."""
    sch = s_tir.Schedule(func)
    (block,) = _annotated_blocks(sch)
    kind, _, form = name.partition("_")
    ops = _operands(func, sch.get(block), kind, form == "sym")
    if ops is None:
        return None
    found = _epilogue(sch, block, func)
    if found is None:
        return None
    out, epilogue = found
    body = _MatmulKernel(ops, out, epilogue, dot).build()
    return _with_body(func, body)


def schedule(func: tirx.PrimFunc, dot: str) -> tirx.PrimFunc | None:
    """The kernel for an int8-activation op of quant/modules.py multiplying with `dot`
    (compiler/target.py INT8_DOTS), or None for any other function (or when `dot` is "": the
    TE body then runs as scheduled by the generic rules)."""
    sch = s_tir.Schedule(func)
    blocks = _annotated_blocks(sch)
    if len(blocks) != 1:
        return None
    kind = str(sch.get(blocks[0]).annotations[INT8_ATTR])
    if not dot:
        LOG.warning("int8 activations without AVX2 or VNNI: %s runs its reference TE body", kind)
        return None
    if kind.startswith("quantize_"):
        result = _quantize_kernel(func, kind.removeprefix("quantize_"))
    else:
        result = _matmul_kernel(func, kind.removeprefix("matmul_"), dot)
    if result is None:
        LOG.warning("int8 rule: unexpected %s function; it runs its reference TE body", kind)
    return result
