"""CPU schedule for NT matmuls `C[m, n] = sum_k A[m, k] * W[n, k]` plus fused epilogues.

Every nn.Linear lands here after FuseTransposeMatmul: A is the activation (rows = seq_len or
batch, symbolic), W the weight (static [N, K], K contiguous). Both operands are contiguous in
K, so the micro-kernel is a dot product: an [MR, NR] tile of outputs keeps MR*NR vector
accumulators of `lanes` floats (rfactor of K by the vector width), each k-step loads MR
activation vectors and NR weight vectors and issues MR*NR FMAs, and the tile ends with each
output's horizontal sum (log2(lanes) vector halving steps, `_tree_sum`) and the fused epilogue
(bias, residual add, cast ...) while the tile is still hot. No weight packing is needed, so
the same kernel serves decode, verification and prefill, in three kinds of variant:

* GEMV (M = 1, decode): MR = 1. Memory bound; the weight is streamed once and >= 32 chunks
  of N are spread over the thread pool. Measured at the speed of a pure read stream on an
  Intel Xeon with NR = 4 W rows per tile; on Zen 4 a float W is read as one stream per chunk
  (NR = 1) where rows are short, and 4 rows with a software prefetch where they are long
  (`GEMV_SINGLE_ROW_MAX_K`).
* Small M (2 <= M < `GEMM_MIN_ROWS`: a verify of K+1 tokens, batched decode): one tile of
  MR = 2, 4 or 7 rows (`ROWS_VARIANTS`, the smallest that covers M; A is padded to MR rows)
  and NR columns (MR*NR accumulators under 1 KiB, see `GEMM_MR`). The rows loop innermost
  of [chunk, column tile, row tile], so each W tile is loaded, and for a quantized W
  unpacked, once for all rows; a GEMV over the same M would unpack it once per row. A W
  streamed as stored (float32; a 16-bit float W on AMD Zen) has each K step touch the same
  cache line of every W row of the next column tile (`ROWS_PREFETCH_TILES`): the tile's
  rows are NR streams a row apart that the hardware prefetchers do not follow far enough
  ahead. (Where the GEMV reads one W row per tile, so do the variants of up to
  `ROWS_SINGLE_ROW_MAX_MR` rows.) At these M the step is still bound by reading W (a few
  FLOPs per weight byte), so the rows' arithmetic hides behind the prefetched stream.
  SmolLM2's F32 layers and lm_head, distinct weights per layer (538 MB), 2 threads, Intel
  Xeon (`schedule_micro.py`'s shapes, M rows against M = 1): M = 2, 3, 4, 5 took 1.15x,
  1.25x, 1.26x, 1.23x with the first W row of the next tile prefetched and the batch variant
  from 3 rows, 1.02x, 1.04x, 1.06x, 1.16x with the whole tile prefetched and these variants
  (with a variant for each M up to 7: within 0.03x of that, with 5 more kernels to compile
  per matmul).
* Batch (a float W, `ROWS_VARIANTS[-1]` < M < `BATCH_MAX_ROWS`: a long verify, batched
  decode of up to 31 sequences): the small-M loop nest with several row tiles of `BATCH_MR`
  rows inside each column tile, so a W tile (NR rows, a few KiB) comes from memory once and
  from L1 for the other row tiles. At these M the step reads all of W once and does ~M FLOPs
  per weight byte, so the weight stream and the arithmetic take about as long
  (Qwen2.5-0.5B's F32 weights at 16 rows, two cores: ~62 ms of reading, ~56 ms of FMAs);
  what decides the speed is overlapping them. The GEMM variant did not: it streams an L2
  chunk from memory for its first row tile, then computes, and the hardware prefetchers do
  not cross into the next tile's rows (they start 4 KiB pages apart). Here every K step of a
  row tile also prefetches one cache line of the next column tile (`_prefetch_next_tile`),
  so the next W tile arrives while this one computes. Qwen2.5-0.5B shape, F32, `mlcrun bench
  --mode kernel -b 8,16`, two threads, Intel Xeon: 8 sequences 62-64 -> 82-88 tok/s, 16
  sequences 93-101 -> 110-124 (prefetch alone: +15-23% of that). A quantized W keeps the
  GEMM from GEMM_MIN_ROWS: re-reading it per row tile would unpack it again each time.
* GEMM (M >= `BATCH_MAX_ROWS`, or `GEMM_MIN_ROWS` for a quantized W: prefill, large decode
  batches): MR = 3 rows share each W
  vector. A symbolic M is padded to a multiple of MR with `pad_einsum` (a copy of A, ~1/N of
  the work): a predicate on M inside the tile defeats TVM's buffer compaction (the
  accumulators then spill to a buffer of M rows) and halves the speed. Chunks of N sized
  to half the compiling CPU's L2 (`GemmTuning`) times row tiles run in parallel. On Zen 4,
  from K = `GEMM_LONG_K` on, tiles of 6 rows of 8 lanes (ymm; the same 768 B of
  accumulators, see `GEMM_MR`). At M=512 on one Zen 4 thread
  (timed by thread CPU time, `schedule_micro.py --threads 1 --gemm-only`): 95-100 GFLOP/s on
  every SmolLM2 and Qwen2.5-0.5B shape with K <= 896, as fast as numpy/OpenBLAS sgemm and
  near the core's one-zmm-FMA-per-cycle peak. With 3 rows the down projections (K = 1536,
  4864) reached only 86-90 and 55-73 (OpenBLAS 95-100): an A tile of 3 rows (18 KB, 58 KB)
  no longer stays in L1 beside the streaming W rows; 6 rows per W load bring them to ~100
  and 83-96. In a 512-token SmolLM2 prefill the GEMMs are ~85% of the time (gate_up 40%, down
  23%, qkv 13%, o 8%; attention 9%).

With a symbolic M all variants are built and joined under `if M < BATCH_MAX_ROWS` (or
GEMM_MIN_ROWS); the GEMV, small-M and batch variants share their chunking of N and run in one
parallel loop whose body picks the variant for M (`_merge_small` says why not one loop each).

Quantized weights (quant/modules.py): the function's first block dequantizes the packed
params into W [N, K], the matmul reads W. The GEMV and small-M variants inline that block
into their loads, so the codes are unpacked in registers (4-bit: one 8-byte load, a permute,
a variable shift and a mask give 16 lanes; LLVM finds that from the `k // 8` index) and no
float W ever exists. The GEMM instead computes the dequantize per parallel chunk of W rows
into an L2-sized [nb, K] buffer that all row tiles of A then reuse; tasks are whole chunks
(not chunk x row tile pairs), so each chunk is dequantized exactly once per call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.matmul import IterKind, IterTrait, make_iter_fusion_index_map
from tvm.sym.analyzer import Analyzer

# MR=3: the [MR, NR, lanes] fp32 accumulators (3*4*16*4 = 768 B) stay under TVM's 1 KiB
# stack-allocation limit. Larger ones become heap workspaces, which LLVM must assume alias
# the operands once any kernel in the module lacks `tirx.noalias` (TVM then drops noalias
# module-wide; in a q0f32 SmolLM2 build 10 of 44 PrimFuncs still lack it: the sliding-window
# KV kernels, compact_kv_copy_cpu, copy_single_page_cpu, shape funcs): every FMA would store
# its accumulator (3x slower). The limit is a constant of TVM (no PassContext option), and a
# "local" scope does not lift it (such a buffer becomes a workspace too). 4x4, 6x4, 4x6, 8x3
# and 5x5 tiles as workspaces (noalias intact in a one-kernel module) were 0.87-0.90x of 3x4
# on SmolLM2's K=576 shapes, on one thread. But from K = GEMM_LONG_K an A tile of 3 rows no
# longer stays in L1 and both operands stream from L2: there 6 rows x 4 columns of 8-lane
# (ymm) accumulators, 768 B, (6 + 4 loads per 24 FMAs instead of 3 + 4 per 12; Zen 4 issues
# two ymm FMAs per cycle, the flops of one zmm FMA) measured 1.15x at K=1536 (SmolLM2 down,
# 88 -> 101 GFLOP/s) and 1.31x at K=4864 (Qwen2.5-0.5B down, 64-73 -> 83-96), one thread,
# OpenBLAS 97-99; 16 lanes (a workspace) 1.05x and 1.25x. K blocking (A tile in
# L1, partial sums per K block via rfactor, merged before the horizontal sums) measured
# 0.6-0.8x; W chunks of 256 KiB - 1 MiB (was 128 KiB) were within +-2% (unstable at K=4864).
#
# Both measurements were on Zen 4 with W chunks of 128 KiB. On an Intel Xeon (two full-width
# zmm FMA pipes, 2 MiB L2; one thread, M=512) the long-K shapes were bound by something else:
# a chunk of 128 KiB holds only 4-8 rows of a K=4864 W, so the 10 MB A streamed from memory
# once per 4-8 columns (Qwen2.5-0.5B down: 56 GFLOP/s with either tile, numpy 161). Chunks of
# half the L2 (`GemmTuning`) measured 116 GFLOP/s there with 3x4 tiles of 16 lanes (6x4x8:
# 105), SmolLM2's down 93 -> 154, the K <= 896 shapes +0-9%. So the chunk budget is half the
# compiling CPU's L2, and the 6x4x8 long-K tile is kept for Zen 4 only (`long_k_ymm`).
GEMM_MR = 3
GEMM_LONG_K = 1024  # from this K on, GEMM_MR_LONG_K rows per tile (see above)
GEMM_MR_LONG_K = 6
LONG_K_LANES = 8  # 6 x 4 x 8 lanes x 4 B = 768 B of accumulators (16 lanes: a workspace)
# AVX2 without AVX-512 (256-bit vectors, 16 registers): GEMM tiles of 4 rows x 3 columns where
# N allows, else 6 x 2: 12 ymm accumulators either way, as in 3 x 4, but 3 x 4 ran at only 0.70x
# numpy/OpenBLAS sgemm on every SmolLM2 and Qwen2.5-0.5B shape (M=512, one thread of an AMD
# EPYC Zen 3, timed by thread CPU time, `schedule_micro.py --threads 1 --gemm-only`, tiles
# swapped in the same process): 4 x 3 0.95-0.98x at K <= 896 and 0.87x at K = 1536 (SmolLM2's
# down), 6 x 2 0.96-0.97x at K = 896 and 0.69x at K = 4864 (Qwen2.5-0.5B's down, N = 896; 3 x 4
# 0.67-0.72x there).
YMM_BITS = 256
YMM_GEMM_TILES = {3: 4, 2: 6}  # NR -> MR
# AVX2's few-row tiles (GEMV, small M, batch) keep at most this many of the 16 ymm registers
# as accumulators; 1 KiB of them allowed 4 x 4 and 7 x 4 (28), which spilled. SmolLM2 F32,
# a verify at depth 256 against a 1-token step, 2 threads, Zen 3: 5-6 tokens (7 rows x 1)
# 1.66-2.31x -> 1.17-1.27x, 4 tokens (4 x 2) 1.15-1.27x -> 1.10-1.19x.
YMM_ACC_REGS = 12
GEMM_MIN_ROWS = 8  # the GEMM variant wins from ~7 rows (measured on 3072x576 weights)
ROWS_VARIANTS = (2, 4, 7)  # MR of the small-M variants: each serves M up to its MR
BATCH_MR = 2  # rows per tile of the batch variant (fp32 W, 3 <= M < BATCH_MAX_ROWS)
BATCH_MAX_ROWS = 32  # from here the GEMM's L2 chunks pay (see "Batch" in the module doc)
PREFETCH_LOCALITY = 2  # llvm.prefetch locality of the row variants' W prefetch (prefetcht1)
# The GEMV of a float W on Zen 4 (`GemmTuning.stream_w`). Tiles of NR = 4 W rows read 4
# streams a row apart; with K <= GEMV_SINGLE_ROW_MAX_K a row is only 36-56 cache lines, so the
# hardware prefetchers keep retraining on short streams. One row per tile reads each chunk as
# one contiguous stream; with longer rows 4 streams (more misses in flight) win, given a
# software prefetch of the tile GEMV_PREFETCH_TILES ahead. 2 threads, Zen 4, GB/s of W read,
# (NR=4 -> chosen): SmolLM2 qkv 21.7 -> 28.9, o 29.6 -> 56.3 (L3-resident), gate_up 23.5 ->
# 43.4, lm_head 20.3 -> 27.4 (1 row); down (K = 1536) 30.3 -> 40.5, Qwen2.5-0.5B down
# (K = 4864) 40.8 -> 43.1 (prefetch; one row there: 28.7, 32.1); Qwen gate_up 27.9 -> 49.5.
# Zen 3 the same: SmolLM2's F32 decode step (2 threads, an AMD EPYC Zen 3, alternating runs,
# its memory bandwidth drifting) 28.3-32.5 -> 22.0-23.3 ms, and in 3 of 4 later pairs 10-20%
# less. (Zen 1 read a float32 W at its bandwidth either way.)
GEMV_SINGLE_ROW_MAX_K = 1023
GEMV_PREFETCH_TILES = 2
STREAM_W_CPUS = ("znver3", "znver4", "znver5")
# The small-M variants have one row tile, so the batch variant's prefetch (one W row of the
# next tile per row tile) fetched only the first of its NR rows. On Zen 4 all NR rows, one
# tile ahead: SmolLM2's 30 layers + lm_head, 2 threads, M = 2: 25.7 -> 19.8 ms, M = 4:
# 29.0 -> 20.1 ms (M = 1: 17.0; so a 4-token step 1.18x a 1-token one). The same on an Intel
# Xeon for a float32 W (module doc, "Small M"); 2 or 3 tiles ahead measured the same there.
ROWS_PREFETCH_TILES = 1
# Where the Zen 4 GEMV reads a float32 W as one stream per chunk (K <= GEMV_SINGLE_ROW_MAX_K),
# the small-M variants of up to this many rows do too (NR = 1; each K step prefetches the
# next W row's cache line at that K offset, as the batch variant does): their NR = 4 or 2 rows
# a row apart, prefetched a tile ahead, read W slower than the GEMV beside them. SmolLM2's F32
# layers and lm_head (distinct weights, 538 MB), 2 threads, Zen 4, M rows against M = 1
# interleaved (`schedule_micro.py`'s shapes), this VM's memory in a slow phase (M = 1: 16.8
# ms) / a fast one (11.0 ms, 49 GB/s): M = 2 1.06x -> 0.98x / 1.28x -> 1.02x, M = 3 1.07x ->
# 1.04x / 1.32x -> 1.30x, M = 4 1.05x -> 1.05x / 1.31x -> 1.29x. MR = 7 lost with one row
# (M = 5: 1.13x -> 1.27x / 1.54x -> 1.96x), so it keeps its tile. In a model, a chain verify of
# 2 tokens against a decode step: 1.34x -> 1.09x (fast phase). A 16-bit W widened in the
# loads takes the same tiles wherever its GEMV streams (`GemmTuning.stream_w16`, any AMD Zen):
# with 3 or 2 W rows per tile prefetched a tile ahead, SmolLM2 BF16's verify steps of 2 and 4
# tokens on 2 threads of a Zen 3 cost 1.42x and 1.81x a decode step, with one row 1.18x and
# 1.50x (two models in one process, alternating, 6 rounds; the row's next line prefetched as
# for a float32 W: no better). Hot in the caches the wider tiles are faster (a 3072 x 576
# layer, M = 4: 132 against 169 us); the model's weights come from memory.
ROWS_SINGLE_ROW_MAX_MR = 4
# From K = GEMM_LONG_K the Zen 4 small-M variants of a float32 W take LONG_K_LANES lanes and
# as many W rows per tile as ROWS_LONG_K_ACC_REGS accumulator registers allow (2 rows: 14,
# 4 rows: 7, 7 rows: 4, where the chunk's columns divide so). Their A tile (MR rows of K
# floats: 78 KB at 4 rows of K = 4864) no longer stays in L1 and is read again from L2 for
# every W tile; twice the W rows per tile halve that traffic. Qwen2.5-0.5B's down (N 896,
# K 4864), 24 distinct weights, 2 threads, Zen 4, M rows against M = 1 interleaved, 16 lanes
# and the 1 KiB of accumulators' NR (4, 2, 2) -> these: M = 2 1.08-1.16x -> 1.07-1.12x,
# M = 4 1.34-1.52x -> 1.05-1.23x, M = 5 1.64-1.88x -> 1.23-1.75x, M = 7 1.65x -> 1.23x;
# SmolLM2's down (N 576, K 1536): M = 4 1.35x -> 1.13x, M = 7 1.90x -> 1.21x, M = 2 the same.
ROWS_LONG_K_ACC_REGS = 28  # of AVX-512's 32 vector registers; the rest hold A and W vectors
DEFAULT_L2_BYTES = 1024 * 1024  # a core's L2 where the machine does not say (Zen 4: 1 MiB)
GEMM_MIN_CHUNKS = 8  # a GEMM with a dequantized W runs one task per chunk: keep some
GEMV_MIN_CHUNKS = 32  # parallel chunks for the GEMV: the pool splits a loop statically
MAX_ACC_BYTES = 1023  # TVM puts a buffer on the stack only when it is smaller than 1 KiB
QUANT_GROUP = 32  # elements per scale of the quantized formats (quant/presets.py)


@dataclass(frozen=True)
class GemmTuning:
    """What the matmul tiling takes from the CPU it is compiled for (see GEMM_MR, GEMV_*)."""

    l2_block_bytes: int = DEFAULT_L2_BYTES // 2  # W rows per parallel chunk stay within this
    long_k_ymm: bool = False  # 6 x 4 tiles of 8 lanes from K = GEMM_LONG_K (Zen 4)
    stream_w: bool = False  # a float32 W's GEMV and small-M tiles shaped for Zen 4's prefetchers
    stream_w16: bool = False  # the same for a 16-bit float W widened in the loads (AMD Zen)

    def streams(self, w_bits: int) -> bool:
        """Whether the GEMV and small-M tiles of a W streamed as stored with `w_bits` per
        element (0: a packed W, never) are shaped for the prefetchers (GEMV_SINGLE_ROW_MAX_K)."""
        return (w_bits == 32 and self.stream_w) or (w_bits == 16 and self.stream_w16)

    @classmethod
    def for_cpu(cls, l2_bytes: int | None, mcpu: str) -> GemmTuning:
        """Chunks of half the L2 (the other half: A tiles, the epilogue, prefetch); on Zen 4
        (`znver4`) the ymm long-K tiles (a zmm FMA is two ymm halves there); from Zen 3 on
        (STREAM_W_CPUS) the GEMV and small-M tiles shaped for its prefetchers
        (GEMV_SINGLE_ROW_MAX_K)."""
        zen4 = mcpu == "znver4"
        zen = mcpu.startswith("znver")
        l2_half = (l2_bytes or DEFAULT_L2_BYTES) // 2
        stream_w = mcpu in STREAM_W_CPUS
        return cls(l2_half, long_k_ymm=zen4, stream_w=stream_w, stream_w16=zen)


@dataclass(frozen=True)
class TileConfig:
    """One matmul variant: rows per tile, columns per tile, K lanes, columns per chunk."""

    mr: int
    nr: int
    lanes: int
    nb: int  # columns per parallel chunk (multiple of nr, divides N)
    kind: str = "gemv"  # "gemv" (M = 1), "rows" (small M) or "gemm"
    prefetch_tiles: int = 0  # GEMV of a float W: prefetch the W tile this many tiles ahead

    @property
    def inline_weight(self) -> bool:
        """A quantized W is unpacked inside the loads (GEMV, small M), not into a buffer."""
        return self.kind != "gemm"


@dataclass(frozen=True)
class MatmulInfo:
    """What the schedule needs to know about a recognised matmul PrimFunc."""

    rows: tirx.PrimExpr  # M: product of the activation's row dims (symbolic or static)
    n: int
    k: int
    acc_bits: int  # accumulator dtype bits (float32: 32)
    w_bits: int  # weight element bits (decides the GEMM block size)
    index_map: tirx.IndexMap  # block iters -> (rows, n, k)


def _is_reduction(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def _main_block(sch: s_tir.Schedule) -> s_tir.schedule.SBlockRV | None:
    """The single reduction block of the function (None if there are 0 or several)."""
    root = sch.get_sblock(sch.mod["main"].body.block.name_hint)
    reductions = [b for b in sch.get_child_blocks(root) if _is_reduction(sch, b)]
    return reductions[0] if len(reductions) == 1 else None


def _iter_traits(stmt: tirx.SBlock) -> list[IterTrait] | None:
    """Classify block iters as I (rows: in A and C), J (in W and C), K (reduce) or T (unit)."""
    if len(stmt.reads) != 2 or len(stmt.writes) != 1:
        return None
    used = []
    for region in [*stmt.reads, stmt.writes[0]]:
        if any(
            not (isinstance(r.extent, tirx.IntImm) and r.extent.value == 1) for r in region.region
        ):
            return None  # not a point access
        used.append({v for r in region.region for v in tirx.analysis.undefined_vars(r.min)})
    a_vars, w_vars, c_vars = used
    traits = []
    for iv in stmt.iter_vars:
        v, ext = iv.var, iv.dom.extent
        if isinstance(ext, tirx.IntImm) and ext.value == 1:
            kind = IterKind.kIter_T
        elif iv.iter_type == tirx.IterVar.CommReduce and v in a_vars and v in w_vars:
            kind = IterKind.kIter_K
        elif (
            iv.iter_type == tirx.IterVar.DataPar and v in c_vars and (v in a_vars) != (v in w_vars)
        ):
            kind = IterKind.kIter_I if v in a_vars else IterKind.kIter_J
        else:
            return None  # batch dims shared by A and W, or an unknown access pattern
        traits.append(IterTrait(kind, ext))
    kinds = [t.kind for t in traits]
    if kinds.count(IterKind.kIter_J) != 1 or kinds.count(IterKind.kIter_K) != 1:
        return None
    return traits


def analyze(func: tirx.PrimFunc) -> MatmulInfo | None:
    """Recognise `C[I.., J] = sum_K A[I.., K] * W[J, K]`: both operands contiguous in K."""
    sch = s_tir.Schedule(func)
    block = _main_block(sch)
    if block is None:
        return None
    stmt = sch.get(block)
    traits = _iter_traits(stmt)
    if traits is None:
        return None
    k_var = next(iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce)
    for region in stmt.reads:  # inner reduction: K is the last index of A and of W
        last = region.region[-1].min
        if not (isinstance(last, tirx.Var) and last.same_as(k_var)):
            return None
    ext = {kind: [t.extent for t in traits if t.kind == kind] for kind in IterKind}
    j_ext, k_ext = ext[IterKind.kIter_J][0], ext[IterKind.kIter_K][0]
    if not isinstance(j_ext, tirx.IntImm) or not isinstance(k_ext, tirx.IntImm):
        return None
    rows: tirx.PrimExpr = tirx.IntImm(str(k_ext.ty), 1)
    for e in ext[IterKind.kIter_I]:
        rows = rows * e
    index_map = make_iter_fusion_index_map(
        traits, [IterKind.kIter_I, IterKind.kIter_J, IterKind.kIter_K]
    )
    return MatmulInfo(
        rows=Analyzer().simplify(rows),
        n=int(j_ext.value),
        k=int(k_ext.value),
        acc_bits=stmt.writes[0].source.dtype.bits,
        w_bits=stmt.reads[1].source.dtype.bits,
        index_map=index_map,
    )


def _largest_divisor(n: int, candidates: list[int]) -> int:
    return next((c for c in candidates if n % c == 0), 1)


def tile_config(
    info: MatmulInfo,
    vector_bits: int,
    kind: str,
    mr: int = 1,
    nb: int | None = None,
    tuning: GemmTuning = GemmTuning(),  # noqa: B008 - frozen, shared default
    streamed_bits: int = 0,
) -> TileConfig:
    """Tile sizes of a `kind` variant with `mr` rows per tile (GEMV, small M): MR x NR
    accumulators must fit the register file (32 zmm with AVX-512) and stay under 1 KiB (the
    stack, see GEMM_MR). `nb` imposes another variant's chunking (the small-M variants run in
    the GEMV's parallel loop), NR then the largest that divides it. `streamed_bits`: W is read
    as it is stored with so many bits per element (0: packed codes), which decides the GEMV's
    shape on AMD Zen (`GemmTuning.streams`)."""
    max_lanes = max(vector_bits // info.acc_bits, 1)
    lanes = _largest_divisor(info.k, [c for c in (64, 32, 16, 8, 4, 2) if c <= max_lanes])
    if kind == "gemm":
        ymm_only = vector_bits == YMM_BITS  # AVX2: 16 vector registers (see YMM_GEMM_TILES)
        nr = _largest_divisor(info.n, [3, 2, 4] if ymm_only else [4, 3, 2])
        tiles = info.n // nr
        # Largest chunk whose W rows fit the L2 budget, so the A rows streamed over it reuse W,
        # but at least GEMM_MIN_CHUNKS chunks where N allows (tasks of a dequantized W).
        max_tiles = max(tuning.l2_block_bytes // (nr * info.k * info.w_bits // 8), 1)
        max_tiles = min(max_tiles, max(tiles // GEMM_MIN_CHUNKS, 1))
        per_chunk = max(d for d in range(1, min(tiles, max_tiles) + 1) if tiles % d == 0)
        long_k = tuning.long_k_ymm and info.k >= GEMM_LONG_K
        mr = GEMM_MR_LONG_K if long_k else GEMM_MR
        if ymm_only:
            mr = YMM_GEMM_TILES.get(nr, mr)
        elif mr != GEMM_MR:
            lanes = _largest_divisor(info.k, [c for c in (LONG_K_LANES, 4, 2) if c <= lanes])
        return TileConfig(mr=mr, nr=nr, lanes=lanes, nb=nr * per_chunk, kind=kind)
    max_nr = max(min(MAX_ACC_BYTES // (mr * lanes * info.acc_bits // 8), 4), 1)
    if vector_bits == YMM_BITS:  # the accumulators must leave registers for A and W
        max_nr = max(min(max_nr, YMM_ACC_REGS // mr), 1)
    if nb is not None:  # the chunking of another variant: NR must divide it
        return TileConfig(mr, _largest_divisor(nb, list(range(max_nr, 1, -1))), lanes, nb, kind)
    nr = _largest_divisor(info.n, [c for c in (4, 3, 2) if c <= max_nr])
    tiles = info.n // nr
    # GEMV: no reuse across chunks, so prefer many small chunks for load balance.
    divisors = [d for d in range(1, tiles + 1) if tiles % d == 0 and tiles // d >= GEMV_MIN_CHUNKS]
    cfg = TileConfig(mr=mr, nr=nr, lanes=lanes, nb=nr * max(divisors, default=1), kind=kind)
    if kind == "gemv" and tuning.streams(streamed_bits):  # see GEMV_SINGLE_ROW_MAX_K
        if info.k <= GEMV_SINGLE_ROW_MAX_K:
            return replace(cfg, nr=1)  # same chunks: the small-M variants share them
        return replace(cfg, prefetch_tiles=GEMV_PREFETCH_TILES)
    return cfg


def _weight_producer(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV
) -> s_tir.schedule.SBlockRV | None:
    """The block computing the matmul's W operand in this function (a dequantize), if any."""
    w_buf = sch.get(block).reads[1].source
    for producer in sch.get_producers(block):
        if any(w.source.same_as(w_buf) for w in sch.get(producer).writes):
            return producer
    return None


def _group_steps(k: int, cfg: TileConfig) -> int:
    """K vector steps per quantization group (QUANT_GROUP elements), 1 if they do not tile K."""
    steps = QUANT_GROUP // cfg.lanes if QUANT_GROUP % cfg.lanes == 0 else 1
    return steps if (k // cfg.lanes) % steps == 0 else 1


def _inline_producers(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, keep: s_tir.schedule.SBlockRV | None
) -> None:
    """Inline elementwise producers (casts, dequantize) into the matmul's operand reads."""
    for producer in sch.get_producers(block):
        if keep is None or not sch.get(producer).same_as(sch.get(keep)):
            sch.compute_inline(producer)


def _consumers_in_order(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> list:
    root = sch.get_sblock(sch.mod["main"].body.block.name_hint)
    children = sch.get_child_blocks(root)
    target = sch.get(block)
    pos = next(i for i, b in enumerate(children) if sch.get(b).same_as(target))
    return list(children[pos + 1 :])


def _epilogue_in_tile(
    sch: s_tir.Schedule, consumers: list, loop: s_tir.schedule.LoopRV, depth: int
) -> None:
    """Compute the epilogue per tile; a block that cannot move (and all after it, which
    depend on it) stays a separate loop nest, parallel over its outer loop."""
    for i, block in enumerate(consumers):
        try:
            sch.reverse_compute_at(block, loop)
        except Exception:  # noqa: BLE001 - e.g. a broadcast or reducing epilogue
            for rest in consumers[i:]:
                sch.parallel(sch.get_loops(rest)[0])
            return
        inner = sch.get_loops(block)[depth:]
        if inner and isinstance(sch.get(inner[-1]).extent, tirx.IntImm):
            sch.vectorize(inner[-1])


def _tree_sum(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> list:
    """Split the sum of each output's `lanes` partial sums into log2(lanes) halving steps
    (the upper half added to the lower half as a vector): 2 instructions per step and output
    instead of one scalar add and one extract per lane. Returns the new blocks, first first."""
    steps = []
    width = lanes
    while width > 2:
        lane = sch.get_loops(block)[-1]
        _, hi = sch.split(lane, [2, width // 2])
        steps.append(sch.rfactor(hi, len(sch.get(block).writes[0].region)))
        width //= 2
    return steps


def schedule_matmul(func: tirx.PrimFunc, info: MatmulInfo, cfg: TileConfig) -> tirx.PrimFunc:
    """Apply one tile variant (see module doc); raises on any pattern it cannot handle."""
    sch = s_tir.Schedule(func)
    block = _main_block(sch)
    # A dequantized W: the GEMV unpacks it inside its loads (inlined), the GEMM dequantizes
    # each chunk of W rows once (compute_at below).
    deq = _weight_producer(sch, block)
    # A float W (no dequantize): the row variants prefetch its next column tile (below); a
    # 16-bit float W widened in the loads: the stored tensor, where the config asks for it.
    float_w = sch.get(block).reads[1].source if deq is None else None
    if deq is not None and cfg.prefetch_tiles:
        float_w = _same_shape_source(sch, deq, info)
    quant_gemv = deq is not None and cfg.inline_weight
    _inline_producers(sch, block, keep=deq)
    sch.transform_block_layout(block, info.index_map)
    rows_static = isinstance(info.rows, tirx.IntImm)
    if cfg.mr > 1 and not (rows_static and info.rows.value % cfg.mr == 0):
        # Pad M (copies A into [ceil(M/MR)*MR, K]) so the tile loop carries no predicate.
        sch.pad_einsum(block, [cfg.mr, 1, 1])
        for pad in sch.get_producers(block):  # the A copy: parallel rows, vector along K
            if deq is not None and sch.get(pad).same_as(sch.get(deq)):
                continue
            *outer, kk = sch.get_loops(pad)
            fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
            if cfg.kind == "gemm":
                sch.parallel(fused)
            sch.vectorize(sch.split(kk, [None, cfg.lanes])[1])
    if quant_gemv:
        sch.compute_inline(deq)
    deq = None if quant_gemv else deq
    consumers = _consumers_in_order(sch, block)
    # Chains like add -> cast collapse into the last consumer; what stays is computed per tile.
    for c in consumers[:-1]:
        try:
            sch.compute_inline(c)
        except Exception:  # noqa: BLE001 - block feeds several outputs; keep it as is
            pass
    consumers = _consumers_in_order(sch, block)

    m, n, k = sch.get_loops(block)
    ko, ki = sch.split(k, [None, cfg.lanes])
    # Vector accumulators: rf[.., m, n, lane], lanes innermost so each update is one FMA.
    rf = sch.rfactor(ki, len(sch.get(block).writes[0].region))
    halvings = _tree_sum(sch, block, cfg.lanes)
    m, n, ko, ki = sch.get_loops(rf)
    mo, mi = sch.split(m, [None, cfg.mr])
    no, nm, ni = sch.split(n, [None, cfg.nb // cfg.nr, cfg.nr])
    # GEMM: an A tile stays in L1 while the chunk's W rows (sized for L2) stream past it.
    # GEMV: the few rows loop innermost so each W tile is read from memory once.
    # (Blocking K as well would need the accumulators spilled between K blocks, and LLVM does
    # not promote them back to registers: measured 40% slower at K=576, so K stays whole.)
    tile = [no, mo, nm] if cfg.kind == "gemm" else [no, nm, mo]
    k_unroll = _group_steps(info.k, cfg) if quant_gemv else 1
    if k_unroll > 1:
        # All K steps of a quantization group in one body, so LLVM loads (and, for fp16,
        # converts) its scale and min once per group rather than once per vector.
        ko, kg = sch.split(ko, [None, k_unroll])
        sch.reorder(*tile, ko, kg, mi, ni, ki)
        sch.unroll(kg)
    else:
        sch.reorder(*tile, ko, mi, ni, ki)
    # Horizontal sum and epilogue right after the accumulation, while the data is hot.
    for step in halvings:  # loops [half, pair, rows?, cols] -> [rows?, cols, pair, half]
        sch.reverse_compute_at(step, tile[-1])
        half, pair, *outputs = sch.get_loops(step)[len(tile) :]
        sch.reorder(*outputs, pair, half)
        for loop in (*outputs, pair):
            sch.unroll(loop)
        sch.vectorize(half)
    sch.reverse_compute_at(block, tile[-1])
    lane, *outputs = sch.get_loops(block)[len(tile) :]  # [lane, rows?, cols]
    if outputs:
        sch.reorder(*outputs, lane)  # lanes innermost: one short sum per output
    for loop in outputs:
        sch.unroll(loop)
    _epilogue_in_tile(sch, consumers, tile[-1], len(tile))
    if deq is not None:
        # One task per W chunk: dequantize its rows into a [nb, K] buffer (L2-sized), then
        # every row tile of A passes over it.
        sch.compute_at(deq, no)
        *_, dk = sch.get_loops(deq)
        sch.vectorize(sch.split(dk, [None, cfg.lanes])[1])
        sch.parallel(no)
    else:
        # GEMM: (chunk, row tile) pairs in parallel; each thread gets a contiguous range, so
        # it keeps one W chunk in its L2 across consecutive row tiles.
        sch.parallel(sch.fuse(no, mo) if cfg.kind == "gemm" else no)
    sch.vectorize(ki)
    sch.unroll(mi)
    sch.unroll(ni)
    init = sch.decompose_reduction(rf, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    func = sch.mod["main"]
    if float_w is not None and (cfg.kind == "rows" or cfg.prefetch_tiles):
        loops = [sch.get(loop).loop_var for loop in (no, nm, mo, ko)]
        func = func.with_body(_prefetch_next_tile(func.body, float_w, loops, cfg, info))
    return func


def _same_shape_source(sch: s_tir.Schedule, deq, info: MatmulInfo) -> tirx.Buffer | None:
    """The stored [N, K] tensor a dequantize block only widens (q0f16, q0bf16: one element
    per weight), or None (packed codes, scales)."""
    reads = sch.get(deq).reads
    if len(reads) != 1:
        return None
    source = reads[0].source
    if [_static_dim(d) for d in source.shape] != [info.n, info.k] or source.dtype.bits != 16:
        return None
    return source


def _static_dim(dim) -> int | None:
    return int(dim.value) if isinstance(dim, tirx.IntImm) else None


def _prefetch_next_tile(
    body: tirx.Stmt, w: tirx.Buffer, loops: list, cfg: TileConfig, info: MatmulInfo
) -> tirx.Stmt:
    """Prefetch a later column tile's W rows while this one computes (module doc, "Batch").
    Row variants: each K step of row tile `mo` touches one cache line of W row `next tile +
    mo % NR`, at the same K offset, so the NR rows of the next tile are fetched during the row
    tiles of this one instead of stalling its first row tile. GEMV (`cfg.prefetch_tiles`):
    each K step touches that K offset's cache line in all NR rows of the tile so many ahead."""
    chunk, tile, row_tile, k_step = loops

    def const(value: int, dtype: str = str(chunk.ty)) -> tirx.PrimExpr:
        return tirx.IntImm(dtype, value)

    def prefetch(row: tirx.PrimExpr) -> tirx.Stmt:
        row = tirx.min(row, const(info.n - 1))
        addr = tirx.address_of(tirx.BufferLoad(w, [row, k_step * const(cfg.lanes)]))
        # llvm.prefetch(ptr, rw = read, locality = 2 (prefetcht1: L2 and out), cache = data)
        args = [const(v, "int32") for v in (0, PREFETCH_LOCALITY, 1)]
        return tirx.Evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", addr, *args))

    ahead = max(cfg.prefetch_tiles, 1)
    first = chunk * const(cfg.nb) + (tile + const(ahead)) * const(cfg.nr)
    if cfg.prefetch_tiles:
        stmts = [prefetch(first + const(r)) for r in range(cfg.nr)]
    else:
        stmts = [prefetch(first + tirx.floormod(row_tile, const(cfg.nr)))]

    def prepend(loop: tirx.For) -> tirx.For:
        new_body = tirx.SeqStmt([*stmts, loop.body])
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, new_body,
                        loop.thread_binding, loop.annotations)  # fmt: skip

    new = _replace_loop(body, k_step, prepend)
    if new is None:
        raise ValueError("the K loop of the row tiles was not found")
    return new


def _replace_loop(stmt: tirx.Stmt, var: tirx.Var, fn) -> tirx.Stmt | None:
    """`stmt` with the loop over `var` replaced by fn(loop), rebuilding only the path to it;
    None where that loop is not inside `stmt`. (TVM's Python API has no statement mutator.)"""
    if isinstance(stmt, tirx.For):
        if stmt.loop_var.same_as(var):
            return fn(stmt)
        body = _replace_loop(stmt.body, var, fn)
        return None if body is None else tirx.For(
            stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding,
            stmt.annotations,
        )  # fmt: skip
    if isinstance(stmt, tirx.SeqStmt):
        seq = list(stmt.seq)
        for i, item in enumerate(seq):
            new = _replace_loop(item, var, fn)
            if new is not None:
                return tirx.SeqStmt(seq[:i] + [new] + seq[i + 1 :])
        return None
    if isinstance(stmt, tirx.IfThenElse):
        for then in (True, False):
            branch = stmt.then_case if then else stmt.else_case
            new = None if branch is None else _replace_loop(branch, var, fn)
            if new is not None:
                cases = (new, stmt.else_case) if then else (stmt.then_case, new)
                return tirx.IfThenElse(stmt.condition, *cases)
        return None
    block = getattr(stmt, "block", None)  # SBlockRealize -> SBlock
    if block is not None:
        body = _replace_loop(block.body, var, fn)
        if body is None:
            return None
        new_block = type(block)(
            block.iter_vars, block.reads, block.writes, block.name_hint, body, block.init,
            block.alloc_buffers, block.match_buffers, block.annotations,
        )  # fmt: skip
        return type(stmt)(stmt.iter_values, stmt.predicate, new_block)
    return None


def _split_root(func: tirx.PrimFunc) -> tuple | None:
    """(root block, statements before the parallel loop, the parallel loop) of a variant."""
    block = func.body.block
    stmts = list(block.body.seq) if isinstance(block.body, tirx.SeqStmt) else [block.body]
    loop = stmts[-1]
    if not (isinstance(loop, tirx.For) and loop.kind == tirx.ForKind.PARALLEL):
        return None
    if any(isinstance(s, tirx.For) and s.kind == tirx.ForKind.PARALLEL for s in stmts[:-1]):
        return None
    return block, stmts[:-1], loop


def _substitute(stmt: tirx.Stmt, var: tirx.Var, value: tirx.PrimExpr) -> tirx.Stmt:
    return tirx.PrimFunc([var], stmt).specialize({var: value}).body


def _merge_small(variants: list) -> tirx.Stmt | None:
    """One parallel loop over W chunks whose body picks the variant for M, or None when the
    variants' chunk loops differ. TVM's TIR CSE binds a constant subexpression (the
    dequantize's lane index vectors `ramp // 8`, `ramp % 8 * 4`) at the innermost statement
    that holds all its uses: with one parallel loop per variant that is the function body,
    outside the loops, so the parallel lambdas receive those vectors through their closure
    and LLVM, no longer seeing constants, unpacks the codes with gathers (4x slower). With
    the dispatch inside the loop they are bound inside the lambda."""
    parts = [_split_root(f) for _, f in variants]
    if any(p is None for p in parts):
        return None
    extents = {int(p[2].extent) for p in parts if isinstance(p[2].extent, tirx.IntImm)}
    if len(extents) != 1 or any(not isinstance(p[2].extent, tirx.IntImm) for p in parts):
        return None
    first = parts[0][2]
    chunk = tirx.Var("chunk", first.loop_var.ty)
    pre: list[tirx.Stmt] = []
    body: tirx.Stmt | None = None
    allocs = []
    for (cond, _), (block, before, loop) in reversed(list(zip(variants, parts))):
        allocs = list(block.alloc_buffers) + allocs
        inner = _substitute(loop.body, loop.loop_var, chunk)
        body = inner if body is None else tirx.IfThenElse(cond, inner, body)
        if before:
            stmt = tirx.SeqStmt(before) if len(before) > 1 else before[0]
            pre.insert(0, tirx.IfThenElse(cond, stmt, None))
    loop = tirx.For(chunk, first.min, first.extent, tirx.ForKind.PARALLEL, body)
    root = parts[0][0]
    new_block = type(root)(
        iter_vars=[],
        reads=[],
        writes=[],
        name_hint=root.name_hint,
        body=tirx.SeqStmt([*pre, loop]) if pre else loop,
        alloc_buffers=allocs,
    )
    return type(variants[0][1].body)(iter_values=[], predicate=True, block=new_block)


def _chain(variants: list) -> tirx.Stmt:
    """`if cond: variant elif ...` over (condition, PrimFunc) pairs, the last one the else."""
    (cond, first), rest = variants[0], variants[1:]
    return first.body if not rest else tirx.IfThenElse(cond, first.body, _chain(rest))


def _small_m_config(
    info: MatmulInfo, vector_bits: int, mr: int, nb: int | None, tuning: GemmTuning, w_bits: int
) -> TileConfig:
    """A small-M variant: one row tile of `mr` rows. A float32 W's next column tile (a 16-bit
    float W's on AMD Zen) is prefetched whole (all NR rows) during this one
    (ROWS_PREFETCH_TILES); the batch variant's row tiles share that prefetch out instead, one
    W row each. Where the GEMV reads W as one stream (`GemmTuning.streams`: a float32 W on
    Zen 3 and later, a 16-bit one on any AMD Zen), the variants of up to
    ROWS_SINGLE_ROW_MAX_MR rows take its one-row tile instead; from GEMM_LONG_K they take
    wide tiles of 8 lanes (ROWS_LONG_K_ACC_REGS)."""
    cfg = tile_config(info, vector_bits, "rows", mr, nb=nb)
    if tuning.streams(w_bits):
        if info.k <= GEMV_SINGLE_ROW_MAX_K and mr <= ROWS_SINGLE_ROW_MAX_MR:
            return replace(cfg, nr=1)  # one stream per chunk, as the GEMV
        if info.k >= GEMM_LONG_K:  # wide tiles of 8 lanes (ROWS_LONG_K_ACC_REGS)
            lanes = _largest_divisor(info.k, [c for c in (LONG_K_LANES, 4, 2) if c <= cfg.lanes])
            acc_bytes = mr * lanes * info.acc_bits // 8
            regs = YMM_ACC_REGS if vector_bits == YMM_BITS else ROWS_LONG_K_ACC_REGS
            max_nr = max(min(regs // mr, MAX_ACC_BYTES // acc_bytes), 1)
            nr = _largest_divisor(cfg.nb, list(range(max_nr, 1, -1)))
            cfg = replace(cfg, lanes=lanes, nr=nr)
    if w_bits == 32 or tuning.streams(w_bits):
        cfg = replace(cfg, prefetch_tiles=ROWS_PREFETCH_TILES)
    return cfg


def schedule(
    func: tirx.PrimFunc,
    vector_bits: int,
    tuning: GemmTuning = GemmTuning(),  # noqa: B008 - frozen, shared default
) -> tirx.PrimFunc | None:
    """Schedule a matmul PrimFunc, or return None if it is not one we handle."""
    info = analyze(func)
    if info is None:
        return None
    # The batch variant re-reads W once per row tile: fine from L1 for a float W, but a
    # quantized one would be unpacked again each time; the GEMM dequantizes it once.
    sch = s_tir.Schedule(func)
    deq = _weight_producer(sch, _main_block(sch))
    batch = deq is None
    # Bits per element of a W streamed as stored: float32, or 16-bit floats only widened in
    # the loads (q0f16, q0bf16); 0 for packed codes
    streamed = info.w_bits if batch else 16 if _same_shape_source(sch, deq, info) is not None else 0
    gemm_rows = BATCH_MAX_ROWS if batch else GEMM_MIN_ROWS
    if isinstance(info.rows, tirx.IntImm):
        m = info.rows.value
        if m >= gemm_rows:
            cfg = tile_config(info, vector_bits, "gemm", tuning=tuning)
        elif m > ROWS_VARIANTS[-1]:
            cfg = tile_config(info, vector_bits, "rows", BATCH_MR)
        elif m == 1:
            cfg = tile_config(info, vector_bits, "gemv", tuning=tuning, streamed_bits=streamed)
        else:
            mr = next(r for r in ROWS_VARIANTS if r >= m)
            cfg = _small_m_config(info, vector_bits, mr, None, tuning, streamed)
        return schedule_matmul(func, info, cfg)
    gemv = tile_config(info, vector_bits, "gemv", tuning=tuning, streamed_bits=streamed)
    small = [(2, schedule_matmul(func, info, gemv))]
    for mr in ROWS_VARIANTS:
        cfg = _small_m_config(info, vector_bits, mr, gemv.nb, tuning, streamed)
        small.append((mr + 1, schedule_matmul(func, info, cfg)))
    if batch:
        cfg = tile_config(info, vector_bits, "rows", BATCH_MR, nb=gemv.nb)
        small.append((BATCH_MAX_ROWS, schedule_matmul(func, info, cfg)))
    large = schedule_matmul(func, info, tile_config(info, vector_bits, "gemm", tuning=tuning))
    dtype = str(info.rows.ty)
    conds, lo = [], 0
    for hi, f in small:  # exclusive conditions: lo <= M < hi
        c = info.rows < tirx.IntImm(dtype, hi)
        conds.append((tirx.And(info.rows >= tirx.IntImm(dtype, lo), c) if lo else c, f))
        lo = hi
    merged = _merge_small(conds)
    body = tirx.IfThenElse(
        info.rows < tirx.IntImm(dtype, gemm_rows),
        merged if merged is not None else _chain(conds),
        large.body,
    )
    return func.with_body(body)
