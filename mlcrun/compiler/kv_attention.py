"""CPU attention kernels for the paged KV cache (swapped in by `kv_kernels.replace_kv_kernels`).

Same signatures and math as TVM 0.27's `TIRPagedKVCache` CPU kernels (scores in log2 units,
softmax with a running max, the log2-sum-exp written beside each output row, -5e4 and a zero
row for a row that sees no key), computed in float32 whatever the cache's dtype: K, V and q are
loaded as stored (float32 or float16) and widened. Two shapes of work:

* Decode (`decode_attention`): one query token per sequence. At depth it is bound by memory:
  between two visits of a layer the weights stream through the caches, so its K/V come from
  DRAM (SmolLM2 at depth 512: 786 KB a layer). A page is stored as [K/V, KV head, 16 slots,
  head_dim], so one (sequence, KV head) pair reads 4 KB blocks at a stride of the whole page
  (24 KB with 3 KV heads): this VM reads that at a quarter of the contiguous rate (numpy sums:
  6 against 22 GB/s). A task is therefore a run of consecutive pages of one sequence for
  *every* KV head: each page is read front to back (the K blocks of all heads, then the V
  blocks). Per page and query head: per key a 16-lane partial product over the head dimension,
  then the 16 keys' vectors summed lane-wise by a 4-stage shuffle tree into one vector of 16
  scores (lane j = key j: 15 adds and 30 shuffles instead of 16 horizontal sums), the softmax
  on that vector (the page's max by a rotation tree, the running sum kept as a vector), then
  the page's V rows loaded once for the group into register accumulators. Slots past a
  sequence's end are masked by lane; the V loop stops before them (an unused slot may hold
  NaN). The page size is a compile-time 16 (TVM's CPU kernels only work with 16).
  Split (flash-decoding): a batch of fewer than SPLIT_TASKS sequences cuts each sequence into
  chunks of pages, so that one long sequence keeps every thread busy (one task per (sequence,
  KV head) gave 2 threads 2 and 1 of SmolLM2's 3 KV heads). The thread pool hands each thread a
  contiguous run of ceil(tasks / threads) tasks, so the chunk count decides the balance
  (`_chunk_count`): a sequence alone in its call (batch-1 decode, a speculative verify) is cut
  into a power of two of near-equal chunks, 2 from LONE_SPLIT_PAGES pages on and then one per
  LONE_CHUNK_PAGES pages, up to SPLIT_TASKS, which 2, 4 or 8 threads share evenly; in a larger
  batch each sequence takes chunks of about max(MIN_SPLIT_PAGES, ceil(batch pages /
  SPLIT_TASKS)) pages. (A lone sequence used to take chunks of MIN_SPLIT_PAGES: at 300 tokens,
  19 pages, 5 chunks, 3 for one of 2 threads and 2 for the other; and fewer, longer chunks also
  save the per-chunk start and merge. Kernels alone, SmolLM2's 9/3 heads, float32 pages evicted
  from the caches between calls as a step's weights evict them, 2 threads, Zen 4: a 5-token
  verify's cached part at depth 300 88 -> 74 us, at 1000 238 -> 206 us; 8 tokens 117 -> 98 and
  319 -> 270 us; decode at 300 34 -> 32 us. In the model (SmolLM2 q4f16_1, three runs): a
  5-token verify at depth 350 6-9% faster, a decode step there 2-5%.) A chunk of a split
  sequence writes its unnormalized output, running max and sum to a workspace (fewer than 2 *
  SPLIT_TASKS chunks: a fixed size), merged after the parallel loop on the calling thread,
  relative to the largest max (a second parallel loop would add a fork and join to every
  layer). Larger batches, and sequences of one chunk, write their rows directly. While a page
  is computed, the next one is prefetched into L2 (`PREFETCH_PAGES`), K rows beside the scores,
  V rows beside the values: at depth a page comes from DRAM (above) and the hardware
  prefetchers do not run ahead of it (SmolLM2 at depth 512, 2 threads: the attention calls of a
  step 2.5-2.9 -> 1.9-2.2 ms).
* Few new tokens over cached pages (`prefill_paged_attention` for a sequence of at most
  SHORT_ROWS[dtype] // G new tokens: a speculative verify of K tokens, a short chunk): every
  new row sees every cached key (with `causal`, the keys up to the row's own position: a
  per-token count of visible slots, masked by lane like a page's end), so this is a decode
  with q_n x G rows per KV head. Tasks, split and merge are decode's; per page, the page
  steps run for every KV head and token (the token loop unrolled to SHORT_ROWS // G under a
  guard: a runtime row offset cost 40% in address arithmetic); a float16 page is widened
  once into a float32 copy first. Each page is read once for all the rows, front to back,
  where the tiles read it once per tile and KV head at the page's stride: at depth 1024 on
  one thread with float32 pages, 2 new tokens of SmolLM2 (9/3 heads) take 0.55x the tiles'
  time, 4 tokens 0.77x, 8 tokens 0.90x. But the decode structure spends more instructions
  per row (a shuffle tree and a scalar softmax step per row and page) than a full tile, so
  it wins only while the tiles are starved of rows or of bandwidth: past 24 rows per KV head
  (float32; 28 and 32 rows: 1.0x and 0.87x) or 6 rows (float16: half the bytes; 8 and 9 rows
  lose 5%, 12 rows 20%) the tiles stay. Both kinds of task share one parallel loop, the
  short ones first.
  Where a short sequence's rows per KV head fill 16-row tiles well enough (at least
  TILE_WORTH rows per tile they need), its page step is the tiles' instead (`tile_pass`): the
  same tasks, pages front to back, split and merge, but per page and KV head the rows' tiles
  (state kept per (KV head, tile) for the whole task) take the page's keys as one 16 x 16
  chunk each, and their state becomes the rows' running max, sum and output at the end.
  A tile's page step costs about what 11 rows' decode steps cost (hot pages, 2 threads,
  9/3 heads: 15 rows per KV head at depth 64 13.9 -> 11.3 us, at depth 320 58.5 -> 45.8;
  12 rows 12.3 -> 11.4 and 46.5 -> 43.6; 9 rows 9.7 -> 11.0 and 37.1 -> 43.6, so they stay
  rows; 14/2 heads, 14 rows at depth 320: 36.0 -> 30.6; 21 rows, two tiles: 55.9 -> 57.1).
  A float32 page read in place has its successor prefetched inside the first tile's score
  loop, one K and one V line per dimension, not all at once before it: a tile's page step
  is bound by its multiply-adds and the page comes from DRAM, and 128 prefetches issued
  together overlapped little with the arithmetic (4 new tokens at depth 512: 45 us a call
  with the pages in L2, 69 us cold, where a decode call reading the same pages cold takes
  35). Measured with the caches as cold as in a model step (SmolLM2's 9/3 heads, 30 layers'
  pages used in turn with 2.7 MB read between calls, 2 threads, Intel Xeon), 4 new tokens
  at depth 64 / 256 / 512: 19.6 -> 18.9, 36.9 -> 33.7, 69 -> 60 us a call; 8 tokens (two
  tiles) within 2%. In the model (SmolLM2 Q4_0, a 4-token verify at depth 512, three
  alternating pairs of processes): 5.49 -> 5.10 ms a step (medians). With the pages already
  in L2, which a model step's weights do not leave them, it costs 18%. (AVX2's key-blocked
  tiles prefetch in their first pass: not measured.)
* Few new tokens among themselves (`prefill_ragged_attention` of a call with at most
  RAGGED_SHORT tokens and keys in all: a verify's ragged part): row by row on the calling
  thread, each (token, head) row over the few keys it sees (a 16-lane product per key summed
  by a rotation tree, the softmax, the weighted values). The tiles below would pad those keys
  to a chunk of 16 and copy it for every 16 rows, and a thread-pool launch costs more than
  the work (SmolLM2, 2 threads, a 2-token verify's ragged call: 3.8 -> 0.6 us per layer).
* Row tiles (prefill over the chunk itself or of a long chunk over cached pages, and both tree
  kernels): a task is a tile of 16 query rows that read the same keys (consecutive (token,
  head) rows of one sequence and one KV head: with GQA a tile spans a few tokens times the
  group's heads), one row per vector lane. Per 16 keys: qk = a 16-key x 16-row block of
  multiply-adds with the key element broadcast (no horizontal sums; in passes of
  TILE_KEY_BLOCKS keys over the head dimension, so that a pass's scores stay in the CPU's
  vector registers: all 16 with AVX-512, 4 with AVX2), the online softmax on
  whole vectors, then the 16 x head_dim output block updated in 4-dimension strips. Every K/V
  element loaded serves 16 rows. Masks (causal, token tree, the ragged end of a page) are a
  compare and a select per key and row; a chunk past the end of a sequence is copied into a
  zero-filled buffer first (as is every float16 chunk, widened once), so no row ever
  multiplies an unused page slot.

Sliding windows (Gemma 3's sliding_attention layers; `window` of `decode_attention` and
`prefill_paged_attention`): the cache calls separate kernels for those layers, whose
`length_info` also gives each sequence's window offset (its first visible slot; `_LengthInfo`),
and masks a causal chunk's row i to the last window - i - 1 cached keys (`_window_rows`). The
pages before the first visible slot are not read, the first one read is masked by lane below
it, and in the tiles each row carries its first visible slot as a second mask value. So a
local layer reads at most a window of keys however long the sequence (Gemma 3 270M, depth
2048, 2 threads: decode 40 -> 78 tokens/s, a 256-token chunk 78 -> 810 tokens/s, against
TVM's scalar windowed kernels).

Token trees (`tree_ragged_attention`, `tree_paged_attention`): a node sees key j when j is
before the tree (cached history) or j is the node itself or one of its ancestors; the cache
passes each tree as DFS intervals `[first, end)` per node, so "j is an ancestor of i" is
`first[j] <= first[i] < end[j]`. Tasks are balanced by pairing short and long tiles (causal
rows near the start of a prompt see few keys).
"""
# ruff: noqa: B023 -- the lambdas passed to T.macro calls are expanded while the loop body is
# parsed (TVMScript), i.e. at once, never called later with a rebound variable.

from __future__ import annotations

import math

from tvm.script import tirx as T

from .schedules.int8 import prefetch as prefetch_line

# Keys per pass of a row tile's scores (`_row_tile`): a pass keeps that many keys' scores of
# its 16 rows in registers while it runs over the head dimension. With AVX-512 all 16 (16 zmm
# of 32); with AVX2 a 16-lane vector is two ymm of its 16 registers, so 16 keys (32 ymm)
# spilled, and 4 keys (8) measured best: SmolLM2's 9/3 heads, float32 pages, one thread of a
# Zen 3, thread CPU time, 4 and 8 new tokens over 256 and 1024 cached ones: 16 / 8 / 4 / 2 keys
# per pass 80.6 / 78.9 / 57.5 / 72.8, 153 / 150 / 106 / 138, 608 / 548 / 470 / 482, 1163 /
# 1037 / 879 / 927 us.
TILE_KEY_BLOCKS = {512: 16, 256: 4}


def tile_key_block(vector_bits: int) -> int:
    """Keys per score pass of the row tiles for a CPU with `vector_bits`-bit vectors."""
    return TILE_KEY_BLOCKS.get(vector_bits, min(TILE_KEY_BLOCKS.values()))


LANES = 16  # float32 lanes of a 512-bit vector: rows per tile, dimensions per decode vector
KEYS = 16  # keys per chunk: one page of the CPU cache
PAGE = 16  # TVM 0.27's CPU KV-cache kernels are built for 16-token pages
LOG2E = math.log2(math.e)
MASKED = -1e30  # the score of a key a row does not see (below any real score)
EMPTY = -5e4  # TVM's running-max start and the lse of a row without keys

# 2^f on [0, 1): Taylor coefficients of e^(f ln 2) to degree 7 (relative error < 2e-7, about
# 3 float32 ulps), evaluated by Horner's rule.
_EXP2_COEFFS = [math.log(2) ** k / math.factorial(k) for k in range(8)]


def exp2_nonpositive(x):
    """2^x for x <= 0 in plain arithmetic, so that a loop of it vectorizes (LLVM turns exp2 into
    one libm call per lane). Inputs below -126 give 2^-126 (their weight in a softmax that
    includes 2^0 is far below float32 resolution)."""
    x = T.max(x, T.float32(-126))
    whole = T.floor(x)
    frac = x - whole
    poly = T.float32(_EXP2_COEFFS[-1])
    for coeff in reversed(_EXP2_COEFFS[:-1]):
        poly = poly * frac + T.float32(coeff)
    bits = T.shift_left(whole.astype("int32") + 127, 23)
    return poly * T.reinterpret("float32", bits)


def _balanced(p, count):
    """Task p of `count` -> a tile, pairing short causal tiles with long ones (0, n-1, 1, ...),
    so the thread pool's contiguous ranges of tasks carry similar work."""
    return T.if_then_else(p % 2 == 0, p // 2, count - 1 - p // 2)


def supported(head_dim: int) -> bool:
    """Decode vectorizes the head dimension in LANES; the tiles need nothing more."""
    return head_dim % LANES == 0


# ------------------------------------------------------------------------------- shuffles


def _shuffle_indices(step: int) -> tuple[list[int], list[int]]:
    """One stage of a 16 x 16 transpose by shuffles: rows i and i + step (i & step == 0)
    exchange their off-diagonal blocks of `step` lanes. Indices into concat(row i, row i+step)."""
    first = [16 + j - step if j & step else j for j in range(16)]
    second = [16 + j if j & step else j + step for j in range(16)]
    return first, second


_STAGES = {step: _shuffle_indices(step) for step in (8, 4, 2, 1)}
_ROTATE = {step: [(j + step) % LANES for j in range(LANES)] for step in (8, 4, 2, 1)}


# ----------------------------------------------------------------------------------- decode

SPLIT_TASKS = 16  # decode splits sequences into page chunks when the batch has fewer sequences
PREFETCH_PAGES = 1  # decode-structure kernels: prefetch the page this many pages ahead
MIN_SPLIT_PAGES = 4  # pages per split chunk in a batch: at least 4 (64 keys)
LONE_SPLIT_PAGES = 2  # a sequence alone in its call splits in two from this many pages ...
LONE_CHUNK_PAGES = 8  # ... and into more chunks (a power of two) of at least this many pages
# Paged prefill: a sequence of at most SHORT_ROWS[dtype] // G new tokens (rows per KV head) takes
# the decode structure, a longer one 16-row tiles. Measured crossovers (depth 1024, one thread):
# float32 pages 24 rows win, 28 and 32 lose; float16 pages (half the bytes, so the tiles' compute
# matters more) 6 rows win, 8 and 9 lose.
SHORT_ROWS = {"float32": 24, "float16": 6}
# A short sequence's page step runs in row tiles from TILE_WORTH rows per KV head and tile
# needed on (11 rows in one tile, 22 in two; measured in the module docstring). With AVX2's
# key-blocked tiles (TILE_KEY_BLOCKS) from 8: one Zen 3 thread, SmolLM2's 9/3 heads, float32
# pages, 3, 6 and 7 new tokens (9, 18, 21 rows) over 64-1024 cached ones 20-50% faster in
# tiles (depth 256: 143 -> 93, 177 -> 117, 201 -> 116 us); 2 tokens (6 rows) stay rows
# (tiles 5-37% slower at depth 64-256).
TILE_WORTH = 11
TILE_WORTH_BY_BITS = {512: TILE_WORTH, 256: 8}


def tile_worth(vector_bits: int) -> int:
    """TILE_WORTH for a CPU with `vector_bits`-bit vectors."""
    return TILE_WORTH_BY_BITS.get(vector_bits, TILE_WORTH)


# A ragged call of at most RAGGED_SHORT new tokens and keys in all (a verify of a few tokens)
# runs row by row on the calling thread (`_short_ragged`), and a merge of at most MERGE_SERIAL
# rows too: a thread-pool launch and 16-row tiles cost more than such work.
RAGGED_SHORT = 12
MERGE_SERIAL = 8


@T.macro
def _reduce_stage(dst, src, step, first, second):
    """dst row i = the two-vector shuffles of src rows i and i + step, added (i < step): one
    stage of summing 16 vectors' lanes into one vector (lane j: the sum of vector j)."""
    for i in T.unroll(step):
        dst[i, T.ramp(0, 1, LANES)] = T.Shuffle(
            [src[i, T.ramp(0, 1, LANES)], src[i + step, T.ramp(0, 1, LANES)]], first
        ) + T.Shuffle([src[i, T.ramp(0, 1, LANES)], src[i + step, T.ramp(0, 1, LANES)]], second)


@T.macro
def _rotate_combine(hx, combine, rotation):
    hx[0, T.ramp(0, 1, LANES)] = combine(
        hx[0, T.ramp(0, 1, LANES)],
        T.Shuffle([hx[0, T.ramp(0, 1, LANES)], hx[0, T.ramp(0, 1, LANES)]], rotation),
    )


@T.macro
def _all_lanes(hx, combine):
    """hx row 0 = combine over its 16 lanes, in every lane: four rotate-and-combine stages
    (combine: T.max for a page's max, an addition for a sum)."""
    _rotate_combine(hx, combine, _ROTATE[8])
    _rotate_combine(hx, combine, _ROTATE[4])
    _rotate_combine(hx, combine, _ROTATE[2])
    _rotate_combine(hx, combine, _ROTATE[1])


def _in_range(j, first, end):
    """first <= j < end; without a first (None), j < end."""
    return j < end if first is None else T.And(first <= j, j < end)


def _whole_page(start, cnt):
    return cnt == KEYS if start is None else T.And(start <= 0, cnt == KEYS)


def _slot_from(cc, start):
    return True if start is None else start <= cc


def _page_macros(G: int, D: int):
    """The decode structure's per-page steps for the G query rows of one KV head, rows
    row0 + hk * G + g of the task's buffers (qv/acc: row * D + d; p/den: [row, lane]; m: [row])."""
    first, second = {}, {}
    for step in (8, 4, 2, 1):
        first[step], second[step] = _STAGES[step]

    @T.macro
    def scores(qv, acc, sc, ra, rb, hx, p, m, den, pages, page, hk, row0, start, cnt):
        """Scores and softmax update of keys start .. cnt-1 of `page` (start None: from 0) for
        the group of KV head hk: per key a 16-lane partial product over the dimensions, the 16
        vectors summed lane-wise by a shuffle tree (lane j: key j), the page's max by a
        rotation tree."""
        for g in T.unroll(G):
            for cc in T.unroll(KEYS):
                for j in T.vectorized(LANES):
                    sc[cc, j] = qv[(row0 + hk * G + g) * D + j] * pages[page, 0, hk, cc, j].astype(
                        "float32"
                    )
                for d0 in T.unroll(D // LANES - 1):
                    for j in T.vectorized(LANES):
                        sc[cc, j] = sc[cc, j] + qv[
                            (row0 + hk * G + g) * D + (d0 + 1) * LANES + j
                        ] * pages[page, 0, hk, cc, (d0 + 1) * LANES + j].astype("float32")
            _reduce_stage(ra, sc, 8, first[8], second[8])
            _reduce_stage(rb, ra, 4, first[4], second[4])
            _reduce_stage(ra, rb, 2, first[2], second[2])
            _reduce_stage(hx, ra, 1, first[1], second[1])
            # Slots past `cnt` (stale, or NaN) and before `start` (outside a window) are masked.
            for j in T.vectorized(LANES):
                p[row0 + hk * G + g, j] = T.Select(
                    _in_range(j, start, cnt), hx[0, j], T.float32(MASKED)
                )
                hx[0, j] = p[row0 + hk * G + g, j]
            _all_lanes(hx, T.max)
            hx[1, 0] = T.max(m[row0 + hk * G + g], hx[0, 0])  # the new running max
            hx[1, 1] = exp2_nonpositive(m[row0 + hk * G + g] - hx[1, 0])  # rescales earlier pages
            m[row0 + hk * G + g] = hx[1, 0]
            for j in T.vectorized(LANES):
                p[row0 + hk * G + g, j] = T.Select(
                    _in_range(j, start, cnt),
                    exp2_nonpositive(p[row0 + hk * G + g, j] - hx[1, 0]),
                    T.float32(0),
                )
                den[row0 + hk * G + g, j] = (
                    den[row0 + hk * G + g, j] * hx[1, 1] + p[row0 + hk * G + g, j]
                )
            for d in T.vectorized(D):
                acc[(row0 + hk * G + g) * D + d] = acc[(row0 + hk * G + g) * D + d] * hx[1, 1]

    @T.macro
    def values(acc, p, pages, page, hk, row0, start, cnt):
        """acc += p V over the page's keys start .. cnt-1 (start None: from 0), each V row
        loaded once for the group (a partial page stops at `cnt`: its unused slots may hold
        NaN, and 0 * NaN is NaN)."""
        if _whole_page(start, cnt):
            for cc in T.unroll(KEYS):
                for g in T.unroll(G):
                    for d in T.vectorized(D):
                        acc[(row0 + hk * G + g) * D + d] = acc[(row0 + hk * G + g) * D + d] + p[
                            row0 + hk * G + g, cc
                        ] * pages[page, 1, hk, cc, d].astype("float32")
        else:
            # (A guard, not a loop from `start`: such a loop read the unused slots of a split
            # sequence's last page, tests/compiled/test_kv_kernels.py::test_decode_window.)
            for cc in T.serial(cnt):
                if _slot_from(cc, start):
                    for g in T.unroll(G):
                        for d in T.vectorized(D):
                            acc[(row0 + hk * G + g) * D + d] = acc[(row0 + hk * G + g) * D + d] + p[
                                row0 + hk * G + g, cc
                            ] * pages[page, 1, hk, cc, d].astype("float32")

    return scores, values


def _row_prefetch(D: int, dtype: str):
    """A macro prefetching (into L2, as the matmul kernels do) the 16 K (kv = 0) or V (kv = 1)
    rows of KV head hk on a page, line by line: the decode-structure kernels fetch the next
    page this way while computing the current one (why: the module docstring, decode)."""
    per_line = 64 // (4 if dtype == "float32" else 2)  # elements per 64-byte line
    lines = max(1, D // per_line)

    @T.macro
    def prefetch(pages, page, kv, hk):
        for r in T.unroll(PAGE):
            for line in T.unroll(lines):
                prefetch_line(pages, page, kv, hk, r, line * per_line)

    return prefetch


def _line_prefetch(D: int):
    """A macro prefetching (where `first`) line i of the K and of the V rows of KV head hk on
    a float32 page (D lines each: 16 rows x D elements, 16 a line), for the row tiles to
    spread a page's prefetch over their score loop (`_row_tile`, `ahead`)."""

    @T.macro
    def line(pages, page, hk, i, first):
        if first:
            prefetch_line(pages, page, 0, hk, i * LANES // D, i * LANES % D)
            prefetch_line(pages, page, 1, hk, i * LANES // D, i * LANES % D)

    return line


def _chunk_count(batch, pages, chunk_pages):
    """How many chunks a split sequence of `pages` pages (to read) is cut into: alone in its
    batch, a power of two (module doc: Split), else one per `chunk_pages`."""
    fit = pages // LONE_CHUNK_PAGES
    alone = T.if_then_else(pages >= LONE_SPLIT_PAGES, 2, 1)
    count = 4
    while count <= SPLIT_TASKS:  # the largest that fits wins
        alone = T.if_then_else(fit >= count, count, alone)
        count *= 2
    return T.if_then_else(batch == 1, alone, T.max(1, T.ceildiv(pages, chunk_pages)))


def _chunk_bound(split, chunk_start, b, c, skip, num_pages):
    """The first page of chunk c of sequence b (c = its chunk count: the end): the sequence's
    pages after `skip`, cut into near-equal chunks (sizes differ by at most one page)."""
    count = chunk_start[b + 1] - chunk_start[b]
    whole = T.if_then_else(c == 0, skip, num_pages)
    return T.if_then_else(split, skip + c * (num_pages - skip) // count, whole)


@T.macro
def _check_no_sink(length_info, batch_size):
    for b in T.serial(batch_size):
        assert length_info[2, b] == 0, "mlcrun's windowed attention has no attention sink"


@T.macro
def _nothing(length_info, batch_size):
    T.evaluate(0)


class _LengthInfo:
    """TVM's `length_info` argument of the paged kernels: per sequence, the slots used in its
    last page ([B]) or, for a sliding_attention layer's kernels, [3, B]: that length, the
    window's offset (the sequence's first visible slot, counted over its pages) and an
    attention-sink length, which mlcrun never sets (asserted 0). The keys of sequence b are
    then slots offset .. n-1 of its pages: pages before offset // PAGE are skipped (`skip`)
    and the first one read is masked below the offset (`start`, None without a window)."""

    def __init__(self, window: int | None):
        if window is not None and window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.check_no_sink = _check_no_sink if window else _nothing

    def windowed(self, batch_size):
        """The sequences to skip pages of: all, or none without a window."""
        return batch_size if self.window else 0

    def shape(self, batch_size):
        return (3, batch_size) if self.window else (batch_size,)

    def end(self, page_indptr, info, b):
        """The slots of sequence b's keys over its pages (n: a window's included)."""
        pages = page_indptr[b + 1] - page_indptr[b]
        last = info[0, b] if self.window else info[b]
        return T.if_then_else(pages > 0, (pages - 1) * PAGE + last, 0)

    def offset(self, info, b):
        return info[1, b] if self.window else 0

    def skip(self, info, b):
        return info[1, b] // PAGE if self.window else 0

    def start(self, info, b, pg):
        return info[1, b] - pg * PAGE if self.window else None


def decode_attention(
    num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, window: int | None = None
):
    """One query token per sequence over its paged K/V (RoPE already applied, so rotary_mode
    must be 0). A task is a run of consecutive pages of one sequence for every head (a whole
    sequence unless the batch is small: then split, and merged). With `window` (a
    sliding_attention layer), the kernel replaces TVM's `..._sliding_window` one: the keys
    start at the window's offset into the sequence's pages (see `_LengthInfo`)."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    info = _LengthInfo(window)
    G = H_qo // H_kv
    # Split bounds: B < SPLIT_TASKS and chunk_pages >= pages / SPLIT_TASKS, so fewer than
    # B + SPLIT_TASKS < 2 * SPLIT_TASKS chunks.
    MAX_CHUNKS = 2 * SPLIT_TASKS
    scores, values = _page_macros(G, D)
    prefetch = _row_prefetch(D, dtype)

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (B, H_qo, D), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, PAGE, D), dtype)
        page_table_indptr = T.match_buffer(
            page_table_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_table_values = T.match_buffer(
            page_table_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        k_rope_pos_offset = T.match_buffer(  # noqa: F841 (part of the signature)
            k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_rope_pos_offset_elem_offset
        )
        q_rope_position = T.match_buffer(  # noqa: F841
            q_rope_position_handle, (B,), "int32", elem_offset=q_rope_position_elem_offset
        )
        output = T.match_buffer(output_handle, (B, H_qo, D), dtype)
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")
        length_info = T.match_buffer(
            var_length_info, info.shape(B), "int32", elem_offset=length_info_elem_offset
        )
        assert rotary_mode == 0, "mlcrun's decode attention expects RoPE already applied"
        info.check_no_sink(length_info, B)

        # Split chunks: chunk_start[b] = the first chunk of sequence b, chunk_seq[i] = the
        # sequence of chunk i; a split chunk's unnormalized output, running max and sum.
        chunk_start = T.alloc_buffer((SPLIT_TASKS + 1,), "int32")
        chunk_seq = T.alloc_buffer((MAX_CHUNKS,), "int32")
        part_acc = T.alloc_buffer((MAX_CHUNKS, H_qo, D), "float32")
        part_m = T.alloc_buffer((MAX_CHUNKS, H_qo), "float32")
        part_den = T.alloc_buffer((MAX_CHUNKS, H_qo), "float32")
        chunks = T.alloc_buffer((1,), "int32")
        chunks[0] = page_table_indptr[B] - page_table_indptr[0]  # the pages to read
        for b in T.serial(info.windowed(B)):
            chunks[0] = chunks[0] - info.skip(length_info, b)
        split: T.let[T.bool] = B < SPLIT_TASKS
        chunk_pages: T.let[T.int32] = T.max(MIN_SPLIT_PAGES, T.ceildiv(chunks[0], SPLIT_TASKS))
        chunks[0] = B
        if split:
            chunk_start[0] = 0
            for b in T.serial(B):
                chunk_start[b + 1] = chunk_start[b] + _chunk_count(
                    B,
                    page_table_indptr[b + 1] - page_table_indptr[b] - info.skip(length_info, b),
                    chunk_pages,
                )
                for c in T.serial(chunk_start[b + 1] - chunk_start[b]):
                    chunk_seq[chunk_start[b] + c] = b
            chunks[0] = chunk_start[B]

        for task in T.parallel(chunks[0]):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                qv = T.sblock_alloc_buffer((H_qo * D,), "float32")
                acc = T.sblock_alloc_buffer((H_qo * D,), "float32")
                sc = T.sblock_alloc_buffer((KEYS, LANES), "float32")
                ra = T.sblock_alloc_buffer((8, LANES), "float32")
                rb = T.sblock_alloc_buffer((4, LANES), "float32")
                hx = T.sblock_alloc_buffer((2, LANES), "float32")
                p = T.sblock_alloc_buffer((H_qo, LANES), "float32")
                den = T.sblock_alloc_buffer((H_qo, LANES), "float32")
                m = T.sblock_alloc_buffer((H_qo,), "float32")
                b: T.let[T.int32] = T.if_then_else(split, chunk_seq[task], task)
                c: T.let[T.int32] = T.if_then_else(split, task - chunk_start[b], 0)
                whole: T.let[T.bool] = T.if_then_else(
                    split, chunk_start[b + 1] - chunk_start[b] == 1, True
                )
                begin: T.let[T.int32] = page_table_indptr[b]
                num_pages: T.let[T.int32] = page_table_indptr[b + 1] - begin
                n: T.let[T.int32] = info.end(page_table_indptr, length_info, b)
                first_page: T.let[T.int32] = _chunk_bound(
                    split, chunk_start, b, c, info.skip(length_info, b), num_pages
                )
                end_page: T.let[T.int32] = _chunk_bound(
                    split, chunk_start, b, c + 1, info.skip(length_info, b), num_pages
                )
                for h in T.serial(H_qo):
                    for d in T.vectorized(D):
                        qv[h * D + d] = Q[b, h, d].astype("float32") * (sm_scale * LOG2E)
                        acc[h * D + d] = T.float32(0)
                    for j in T.vectorized(LANES):
                        den[h, j] = T.float32(0)
                    m[h] = T.float32(EMPTY)
                for pg in T.serial(first_page, end_page):
                    nxt: T.let[T.int32] = page_table_values[
                        begin + T.min(pg + PREFETCH_PAGES, num_pages - 1)
                    ]
                    for hk in T.serial(H_kv):
                        prefetch(pages, nxt, 0, hk)
                        scores(
                            qv,
                            acc,
                            sc,
                            ra,
                            rb,
                            hx,
                            p,
                            m,
                            den,
                            pages,
                            page_table_values[begin + pg],
                            hk,
                            0,
                            info.start(length_info, b, pg),
                            T.min(PAGE, n - pg * PAGE),
                        )
                    for hk in T.serial(H_kv):
                        prefetch(pages, nxt, 1, hk)
                        values(
                            acc,
                            p,
                            pages,
                            page_table_values[begin + pg],
                            hk,
                            0,
                            info.start(length_info, b, pg),
                            T.min(PAGE, n - pg * PAGE),
                        )
                for h in T.serial(H_qo):
                    hx[1, 0] = T.float32(0)
                    for j in T.serial(LANES):
                        hx[1, 0] = hx[1, 0] + den[h, j]
                    if whole:
                        for d in T.vectorized(D):
                            output[b, h, d] = T.if_then_else(
                                hx[1, 0] > 0, acc[h * D + d] / hx[1, 0], T.float32(0)
                            ).astype(output.dtype)
                        lse[b, h] = T.if_then_else(
                            hx[1, 0] > 0, m[h] + T.log2(hx[1, 0]), T.float32(EMPTY)
                        )
                    else:
                        for d in T.vectorized(D):
                            part_acc[task, h, d] = acc[h * D + d]
                        part_m[task, h] = m[h]
                        part_den[task, h] = hx[1, 0]

        if chunks[0] > B:
            # Merge the chunks of each split sequence, relative to their largest max: on the
            # calling thread (at most 2 * SPLIT_TASKS chunks), so no second fork and join.
            for task in T.serial(B * H_kv):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((D,), "float32")
                    w = T.sblock_alloc_buffer((3,), "float32")
                    b: T.let[T.int32] = task // H_kv
                    c0: T.let[T.int32] = chunk_start[b]
                    nc: T.let[T.int32] = chunk_start[b + 1] - c0
                    if nc > 1:
                        for g in T.serial(G):
                            h: T.let[T.int32] = task % H_kv * G + g
                            w[0] = T.float32(EMPTY)
                            for c in T.serial(nc):
                                w[0] = T.max(w[0], part_m[c0 + c, h])
                            w[1] = T.float32(0)
                            for d in T.vectorized(D):
                                acc[d] = T.float32(0)
                            for c in T.serial(nc):
                                w[2] = exp2_nonpositive(part_m[c0 + c, h] - w[0])
                                w[1] = w[1] + part_den[c0 + c, h] * w[2]
                                for d in T.vectorized(D):
                                    acc[d] = acc[d] + part_acc[c0 + c, h, d] * w[2]
                            for d in T.vectorized(D):
                                output[b, h, d] = T.if_then_else(
                                    w[1] > 0, acc[d] / w[1], T.float32(0)
                                ).astype(output.dtype)
                            lse[b, h] = T.if_then_else(
                                w[1] > 0, w[0] + T.log2(w[1]), T.float32(EMPTY)
                            )

    return batch_decode_paged_kv


# ------------------------------------------------------------------------------- row tiles


@T.macro
def _transpose_stage(dst, dst_row, dst_col, src, src_row, src_col, step, first, second):
    """dst rows = one transpose stage of src rows (16 vectors of 16 lanes each, row i at
    buf[row + i, col:col + 16])."""
    for p in T.unroll(8):
        dst[dst_row + (p // step) * 2 * step + p % step, T.ramp(dst_col, 1, 16)] = T.Shuffle(
            [
                src[src_row + (p // step) * 2 * step + p % step, T.ramp(src_col, 1, 16)],
                src[src_row + (p // step) * 2 * step + p % step + step, T.ramp(src_col, 1, 16)],
            ],
            first,
        )
        dst[dst_row + (p // step) * 2 * step + p % step + step, T.ramp(dst_col, 1, 16)] = T.Shuffle(
            [
                src[src_row + (p // step) * 2 * step + p % step, T.ramp(src_col, 1, 16)],
                src[src_row + (p // step) * 2 * step + p % step + step, T.ramp(src_col, 1, 16)],
            ],
            second,
        )


@T.macro
def _transpose16(dst, dst_row, dst_col, src, src_row, src_col, tmp_a, tmp_b):
    """dst[dst_row + j, dst_col + i] = src[src_row + i, src_col + j] for i, j < 16: four stages
    of 16 two-vector shuffles in registers (a scalar transpose is 256 loads and stores, and
    TVM scalarizes gathers and scatters)."""
    _transpose_stage(tmp_a, 0, 0, src, src_row, src_col, 8, _STAGES[8][0], _STAGES[8][1])
    _transpose_stage(tmp_b, 0, 0, tmp_a, 0, 0, 4, _STAGES[4][0], _STAGES[4][1])
    _transpose_stage(tmp_a, 0, 0, tmp_b, 0, 0, 2, _STAGES[2][0], _STAGES[2][1])
    _transpose_stage(dst, dst_row, dst_col, tmp_a, 0, 0, 1, _STAGES[1][0], _STAGES[1][1])


def _first_chunk(first_key):
    return 0 if first_key is None else first_key // KEYS


def _direct_chunk(widen: bool, c, kv_n, first_key):
    """Chunk c is read in place (a float32 chunk of keys that all exist), not copied into a
    zero-filled buffer (`_row_tile`)."""
    if widen:
        return False
    full = c * KEYS + KEYS <= kv_n
    return full if first_key is None else T.And(first_key <= c * KEYS, full)


def _row_tile(D: int, G: int, dtype: str, key_block: int = KEYS):
    """The tile body: 16 query rows of one sequence and KV head against its keys, chunk by
    chunk. The caller describes the keys with `full_index(which, c, cc, d)` (key c*KEYS+cc of
    a full chunk in its source buffer) and the rows' masks with `visible(j, lim, order)` (key j
    for a row whose per-row values are `lim` and `order`, see `tile`)."""
    widen = dtype != "float32"  # float16 chunks are widened once into the local buffers
    assert D % LANES == 0 and KEYS == LANES  # noqa: S101 (kv_kernels checks `supported`)
    assert KEYS % key_block == 0  # noqa: S101

    @T.macro
    def chunk(s, qt, acc, st, ri, kref, vref, index, c, visible, qa, sa, ahead=None):
        """Scores, softmax update and output update for keys c*KEYS .. c*KEYS+KEYS-1, read
        from kref/vref at index(which, cc, d), of the tile whose q and output rows start at
        row qa of qt and acc and whose state rows at row sa of st and ri. st rows: running
        max, new max, sum, rescale. ahead(d): a statement run at dimension d of the first
        score pass (a prefetch of the next page's line d), or None."""
        for cc in T.unroll(KEYS):
            for r in T.vectorized(LANES):
                s[cc, r] = T.float32(0)
        for cb in T.serial(KEYS // key_block):
            for d in T.serial(D):
                if ahead is not None and cb == 0:
                    ahead(d)
                for ci in T.unroll(key_block):
                    for r in T.vectorized(LANES):
                        s[cb * key_block + ci, r] = s[cb * key_block + ci, r] + qt[
                            qa + d, r
                        ] * kref[index(0, cb * key_block + ci, d)].astype("float32")
        for r in T.vectorized(LANES):
            st[sa + 1, r] = st[sa, r]
        for cc in T.unroll(KEYS):
            for r in T.vectorized(LANES):
                s[cc, r] = T.Select(
                    visible(c * KEYS + cc, ri[sa, r], ri[sa + 1, r]), s[cc, r], T.float32(MASKED)
                )
                st[sa + 1, r] = T.max(st[sa + 1, r], s[cc, r])
        for r in T.vectorized(LANES):
            st[sa + 3, r] = exp2_nonpositive(st[sa, r] - st[sa + 1, r])
            st[sa + 2, r] = st[sa + 2, r] * st[sa + 3, r]
            st[sa, r] = st[sa + 1, r]
        for cc in T.unroll(KEYS):
            for r in T.vectorized(LANES):
                s[cc, r] = T.Select(
                    s[cc, r] > T.float32(MASKED / 2),
                    exp2_nonpositive(s[cc, r] - st[sa, r]),
                    T.float32(0),
                )
                st[sa + 2, r] = st[sa + 2, r] + s[cc, r]
        # Four output dimensions at a time: four independent chains of multiply-adds.
        for d4 in T.serial(D // 4):
            for dd in T.unroll(4):
                for r in T.vectorized(LANES):
                    acc[qa + d4 * 4 + dd, r] = acc[qa + d4 * 4 + dd, r] * st[sa + 3, r]
            for cc in T.unroll(KEYS):
                for dd in T.unroll(4):
                    for r in T.vectorized(LANES):
                        acc[qa + d4 * 4 + dd, r] = acc[qa + d4 * 4 + dd, r] + s[cc, r] * vref[
                            index(1, cc, d4 * 4 + dd)
                        ].astype("float32")

    @T.macro
    def start(
        q, sm_scale, q_begin, q_n, t, hk, row_lim, row_order, qt, acc, st, ri, kc, s, vc, qa, sa
    ):
        """Set up tile t of KV head hk (rows t*16 .. t*16+15 of the sequence's q_n * G (token,
        head) rows; rows past the end repeat the last one) at row qa of qt/acc and sa of
        st/ri: per row its mask values (row_lim(tok), row_order(tok)), output row and head,
        q scaled to log2 units and transposed (one row per lane; kc, s and vc are scratch),
        an empty softmax state and a zero output."""
        for r in T.serial(LANES):
            ri[sa + 2, r] = T.min(t * LANES + r, q_n * G - 1) // G  # the token, in the sequence
            ri[sa + 3, r] = hk * G + T.min(t * LANES + r, q_n * G - 1) % G
            ri[sa, r] = row_lim(ri[sa + 2, r])
            ri[sa + 1, r] = row_order(ri[sa + 2, r])
            ri[sa + 2, r] = q_begin + ri[sa + 2, r]
            for d in T.vectorized(D):  # q rows, scaled to log2 units, transposed below
                kc[r, d] = q[ri[sa + 2, r], ri[sa + 3, r], d].astype("float32") * (sm_scale * LOG2E)
        for b in T.serial(D // LANES):
            _transpose16(qt, qa + b * LANES, 0, kc, 0, b * LANES, s, vc)
        for r in T.vectorized(LANES):
            st[sa, r] = T.float32(EMPTY)
            st[sa + 2, r] = T.float32(0)
        for d in T.serial(D):
            for r in T.vectorized(LANES):
                acc[qa + d, r] = T.float32(0)

    @T.macro
    def tile(
        q,
        output,
        lse,
        sm_scale,
        q_begin,
        q_n,
        t,
        hk,
        kv_n,
        n_keys,
        row_lim,
        row_order,
        visible,
        kref,
        vref,
        full_index,
        first_key,
    ):
        """Rows t*16 .. t*16+15 of the sequence's q_n * G (token, head) rows of KV head hk
        (rows past the end repeat the last one: same values, written twice). Keys first_key
        (None: 0) .. n_keys-1 of kv_n; row_lim(tok) and row_order(tok) give each row's mask
        values."""
        qt = T.sblock_alloc_buffer((D, LANES), "float32", scope="local")  # q, one row per lane
        acc = T.sblock_alloc_buffer((D, LANES), "float32", scope="local")
        s = T.sblock_alloc_buffer((KEYS, LANES), "float32", scope="local")
        kc = T.sblock_alloc_buffer((KEYS, D), "float32", scope="local")
        vc = T.sblock_alloc_buffer((KEYS, D), "float32", scope="local")
        st = T.sblock_alloc_buffer((4, LANES), "float32")  # softmax state, see chunk
        ri = T.sblock_alloc_buffer((4, LANES), "int32")  # per row: lim, order, row, head
        start(
            q, sm_scale, q_begin, q_n, t, hk, row_lim, row_order, qt, acc, st, ri, kc, s, vc, 0, 0
        )
        for c in T.serial(_first_chunk(first_key), (n_keys + KEYS - 1) // KEYS):
            if _direct_chunk(widen, c, kv_n, first_key):
                chunk(
                    s,
                    qt,
                    acc,
                    st,
                    ri,
                    kref,
                    vref,
                    lambda which, cc, d: full_index(which, c, cc, d),
                    c,
                    visible,
                    0,
                    0,
                )
            else:
                for cc in T.serial(KEYS):
                    if _in_range(c * KEYS + cc, first_key, kv_n):
                        for d in T.vectorized(D):
                            kc[cc, d] = kref[full_index(0, c, cc, d)].astype("float32")
                            vc[cc, d] = vref[full_index(1, c, cc, d)].astype("float32")
                    else:
                        for d in T.vectorized(D):
                            kc[cc, d] = T.float32(0)
                            vc[cc, d] = T.float32(0)
                chunk(s, qt, acc, st, ri, kc, vc, lambda which, cc, d: (cc, d), c, visible, 0, 0)
        for r in T.vectorized(LANES):
            st[3, r] = T.Select(st[2, r] > 0, T.float32(1) / st[2, r], T.float32(0))
        for d in T.serial(D):
            for r in T.vectorized(LANES):
                acc[d, r] = acc[d, r] * st[3, r]
        for b in T.serial(D // LANES):
            _transpose16(kc, 0, b * LANES, acc, b * LANES, 0, s, vc)
        for r in T.serial(LANES):
            lse[ri[2, r], ri[3, r]] = T.if_then_else(
                st[2, r] > 0, st[0, r] + T.log2(st[2, r]), T.float32(EMPTY)
            )
            for d in T.vectorized(D):
                output[ri[2, r], ri[3, r], d] = kc[r, d].astype(output.dtype)

    return tile, start, chunk


@T.macro
def _find_tile(where, q_indptr, batch_size, tile_index, G, min_tokens):
    """where[0], where[1] = the sequence and its tile number of global tile `tile_index`
    (tiles numbered sequence after sequence, ceil(rows / 16) each; none for a sequence of
    fewer than `min_tokens` new tokens); where[0] = -1 past the last one."""
    where[0] = -1
    where[2] = 0
    for i in T.serial(batch_size):
        if where[0] < 0 and q_indptr[i + 1] - q_indptr[i] >= min_tokens:
            if tile_index < where[2] + ((q_indptr[i + 1] - q_indptr[i]) * G + LANES - 1) // LANES:
                where[0] = i
                where[1] = tile_index - where[2]
            where[2] = where[2] + ((q_indptr[i + 1] - q_indptr[i]) * G + LANES - 1) // LANES


def _tile_count(rows_total, batch_size, G):
    """An upper bound of the tiles of all sequences (each sequence wastes less than one)."""
    return (rows_total * G + LANES - 1) // LANES + batch_size


def _causal_lim(causal, kv_n, q_n):
    """Keys a row of token `tok` sees: all kv_n, or (causal) up to its own position, the
    chunk's rows being the last of the sequence's keys."""
    return lambda tok: T.if_then_else(causal > 0, kv_n - q_n + tok + 1, kv_n)


def _lim_visible(j, lim, order):
    return j < lim


def _no_order(tok):
    return 0


def _window_visible(j, lim, order):
    """A window's mask: `order` is the row's first visible slot, `lim` the end."""
    return _in_range(j, order, lim)


def _row_first(first_slot):
    """The `row_order` of a tile: each row's first visible slot, or none (0)."""
    return _no_order if first_slot is None else first_slot


def _tile_first_key(first_slot, t, G):
    """The first key any row of tile t sees (its first token's window start), or None."""
    return None if first_slot is None else first_slot(t * LANES // G)


def _tree_visible(tree, tree_begin, tree_start, kv_n):
    """Key j is before the tree, or an ancestor of the row's node (or the node itself):
    first[j] <= first[row] < end[j] in the tree's DFS order."""

    def visible(j, lim, order):
        node = T.max(T.min(j, kv_n - 1) - tree_start, 0)
        return T.And(
            j < kv_n,
            T.Or(
                j < tree_start,
                T.And(tree[tree_begin + node, 0] <= order, order < tree[tree_begin + node, 1]),
            ),
        )

    return visible


def _short_ragged(H_qo: int, G: int, D: int):
    """Every row of a ragged call with few tokens, one after another on the calling thread:
    per (token, head) row its visible keys' scores (a 16-lane product over the head dimension,
    summed by a rotation tree), their softmax and the weighted sum of their values. A verify
    of a few tokens sees a few keys here, which the 16-row tiles would pad to a whole chunk
    (and copy, as a chunk past the end of the keys) for each of 16 rows."""

    @T.macro
    def rows(q, k, v, output, lse, q_indptr, kv_indptr, batch_size, causal, sm_scale):
        qv = T.sblock_alloc_buffer((D,), "float32")
        acc = T.sblock_alloc_buffer((D,), "float32")
        sc = T.sblock_alloc_buffer((RAGGED_SHORT,), "float32")
        hx = T.sblock_alloc_buffer((1, LANES), "float32")
        st = T.sblock_alloc_buffer((2,), "float32")  # running max, then the sum
        for b in T.serial(batch_size):
            q_n: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
            kv_n: T.let[T.int32] = kv_indptr[b + 1] - kv_indptr[b]
            key: T.let[T.int32] = kv_indptr[b]
            for tok in T.serial(q_n):
                lim: T.let[T.int32] = T.max(T.min(_causal_lim(causal, kv_n, q_n)(tok), kv_n), 0)
                row: T.let[T.int32] = q_indptr[b] + tok
                for h in T.serial(H_qo):
                    for d in T.vectorized(D):
                        qv[d] = q[row, h, d].astype("float32") * (sm_scale * LOG2E)
                    st[0] = T.float32(EMPTY)
                    for j in T.serial(lim):
                        for x in T.vectorized(LANES):
                            hx[0, x] = qv[x] * k[key + j, h // G, x].astype("float32")
                        for d0 in T.unroll(D // LANES - 1):
                            for x in T.vectorized(LANES):
                                hx[0, x] = hx[0, x] + qv[(d0 + 1) * LANES + x] * k[
                                    key + j, h // G, (d0 + 1) * LANES + x
                                ].astype("float32")
                        _all_lanes(hx, lambda x, y: x + y)
                        sc[j] = hx[0, 0]
                        st[0] = T.max(st[0], hx[0, 0])
                    st[1] = T.float32(0)
                    for d in T.vectorized(D):
                        acc[d] = T.float32(0)
                    for j in T.serial(lim):
                        sc[j] = exp2_nonpositive(sc[j] - st[0])
                        st[1] = st[1] + sc[j]
                        for d in T.vectorized(D):
                            acc[d] = acc[d] + sc[j] * v[key + j, h // G, d].astype("float32")
                    for d in T.vectorized(D):
                        output[row, h, d] = T.if_then_else(
                            st[1] > 0, acc[d] / st[1], T.float32(0)
                        ).astype(output.dtype)
                    lse[row, h] = T.if_then_else(st[1] > 0, st[0] + T.log2(st[1]), T.float32(EMPTY))

    return rows


def prefill_ragged_attention(
    num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, key_block: int = KEYS
):
    """The new tokens of each sequence attend to each other (causal or not) from the chunk's
    contiguous K/V; tiles of 16 rows, or row by row where the call has few tokens and keys
    (RAGGED_SHORT). `key_block`: see TILE_KEY_BLOCKS."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    G = H_qo // H_kv
    tile = _row_tile(D, G, dtype, key_block)[0]
    short_rows = _short_ragged(H_qo, G, D)

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_kv_indptr: T.handle,
        var_q_rope_position: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset
        )
        k = T.match_buffer(var_k, (kv_len, H_kv, D), dtype)
        v = T.match_buffer(var_v, (kv_len, H_kv, D), dtype)
        kv_indptr = T.match_buffer(
            var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset
        )
        q_rope_position = T.match_buffer(  # noqa: F841 (part of the signature)
            var_q_rope_position, (qo_len,), "int32", elem_offset=q_rope_position_elem_offset
        )
        k_rope_pos_offset = T.match_buffer(  # noqa: F841
            var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_pos_offset_elem_offset
        )
        output = T.match_buffer(var_output, (qo_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (qo_len, H_qo), "float32")
        assert rotary_mode == 0, "mlcrun's prefill attention expects RoPE already applied"

        short: T.let[T.bool] = T.And(qo_len <= RAGGED_SHORT, kv_len <= RAGGED_SHORT)
        if short:
            with T.sblock("short"):
                T.reads()
                T.writes()
                short_rows(q, k, v, output, lse, q_indptr, kv_indptr, batch_size, causal, sm_scale)
        else:
            for task in T.parallel(_tile_count(qo_len, batch_size, G) * H_kv):
                with T.sblock("attn"):
                    T.reads()
                    T.writes()
                    where = T.sblock_alloc_buffer((3,), "int32")
                    _find_tile(
                        where,
                        q_indptr,
                        batch_size,
                        _balanced(task // H_kv, _tile_count(qo_len, batch_size, G)),
                        G,
                        0,
                    )
                    if where[0] >= 0:
                        b: T.let[T.int32] = where[0]
                        t: T.let[T.int32] = where[1]
                        hk: T.let[T.int32] = task % H_kv
                        q_n: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                        kv_n: T.let[T.int32] = kv_indptr[b + 1] - kv_indptr[b]
                        kv_begin: T.let[T.int32] = kv_indptr[b]
                        tile(
                            q,
                            output,
                            lse,
                            sm_scale,
                            q_indptr[b],
                            q_n,
                            t,
                            hk,
                            kv_n,
                            _causal_lim(causal, kv_n, q_n)(
                                (T.min(t * LANES + LANES, q_n * G) - 1) // G
                            ),
                            _causal_lim(causal, kv_n, q_n),
                            _no_order,
                            _lim_visible,
                            k,
                            v,
                            lambda which, c, cc, d: (kv_begin + c * KEYS + cc, hk, d),
                            None,
                        )

    return batch_prefill_ragged_kv


def _window_rows(causal, n, offset, window):
    """Per new token, the first slot it sees of a sliding_attention layer's cached keys (slots
    offset .. n-1): TVM's windowed mask for a causal chunk lets token `tok` of the chunk see
    the last window - tok - 1 of them (with its own key and the chunk's earlier ones, which
    the ragged kernel adds: `window` keys in all), a non-causal one all of them."""
    return lambda tok: T.if_then_else(
        causal > 0, T.max(n - T.max(window - tok - 1, 0), offset), offset
    )


def _page_start(first_slot, tok, pg):
    return None if first_slot is None else first_slot(tok) - pg * PAGE


def prefill_paged_attention(
    num_kv_heads: int,
    num_qo_heads: int,
    head_dim: int,
    dtype: str,
    short_rows: int | None = None,
    window: int | None = None,
    tile_worth: int | None = None,
    key_block: int = KEYS,
):
    """A chunk of new tokens per sequence attends to the sequence's cached (paged) K/V (RoPE
    already applied). A sequence of few new tokens (at most short_rows // G: a verify step)
    takes the decode structure with all its rows (runs of pages for every KV head, split and
    merged when the batch is small); longer chunks take tiles of 16 rows. Both kinds of task
    share one parallel loop, the short ones first. With `window` (a sliding_attention
    layer), it replaces TVM's `..._sliding_window` kernel: each row sees the cached keys
    `_window_rows` gives it, and pages before the first row's window are not read.
    `key_block`: see TILE_KEY_BLOCKS."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    info = _LengthInfo(window)
    G = H_qo // H_kv
    tile, tile_start, tile_chunk = _row_tile(D, G, dtype, key_block)
    scores, values = _page_macros(G, D)
    prefetch = _row_prefetch(D, dtype)
    prefetch_line_kv = _line_prefetch(D)
    if short_rows is None:
        short_rows = SHORT_ROWS[dtype]
    if tile_worth is None:
        tile_worth = TILE_WORTH
    QMAX = max(1, short_rows // G)  # new tokens of a short sequence, at most
    TMAX = (QMAX * G + LANES - 1) // LANES  # row tiles per KV head of a short sequence
    MAX_CHUNKS = 2 * SPLIT_TASKS  # as in decode
    widen = dtype != "float32"

    def first_slots(causal, page_indptr, length_info, b):
        """None, or (a window) per new token of sequence b the first cached slot it sees."""
        if not window:
            return None
        n = info.end(page_indptr, length_info, b)
        return _window_rows(causal, n, info.offset(length_info, b), window)

    def skip(causal, page_indptr, length_info, b):
        """Pages of sequence b before any of its rows' windows (none without a window)."""
        if not window:
            return 0
        return first_slots(causal, page_indptr, length_info, b)(0) // PAGE

    row_visible = _window_visible if window else _lim_visible

    def row_end(causal, n, q_n):
        """Per new token, the end of the cached slots it sees (a window ends at the last)."""
        return (lambda tok: n) if window else _causal_lim(causal, n, q_n)

    @T.macro
    def page_pass(
        qv, acc, sc, ra, rb, hx, p, m, den, src, page, pg, n, q_n, causal, pool, nxt, first_slot
    ):
        """Page pg (slot `page` of src) for every row: the scores of all KV heads, then the
        values, prefetching page `nxt` of `pool` (the next one) alongside. The token loop is
        unrolled (constant row offsets; a runtime one cost 40%). first_slot(tok): a window's
        first visible slot per token (None: 0)."""
        for hk in T.serial(H_kv):
            prefetch(pool, nxt, 0, hk)
            for tok in T.unroll(QMAX):
                if tok < q_n:
                    scores(
                        qv,
                        acc,
                        sc,
                        ra,
                        rb,
                        hx,
                        p,
                        m,
                        den,
                        src,
                        page,
                        hk,
                        tok * H_qo,
                        _page_start(first_slot, tok, pg),
                        T.min(PAGE, row_end(causal, n, q_n)(tok) - pg * PAGE),
                    )
        for hk in T.serial(H_kv):
            prefetch(pool, nxt, 1, hk)
            for tok in T.unroll(QMAX):
                if tok < q_n:
                    values(
                        acc,
                        p,
                        src,
                        page,
                        hk,
                        tok * H_qo,
                        _page_start(first_slot, tok, pg),
                        T.min(PAGE, n - pg * PAGE),
                    )

    @T.macro
    def tile_pass(tq, tacc, tst, tri, ts, tk, tv, src, page, pg, n, tiles, pool, nxt, first_key):
        """Page pg (slot `page` of src) for every row, in row tiles: per KV head its K/V rows
        (a page with slots the rows must not read, past the end or before a window, copied
        into the zero-filled tk/tv first, as is every float16 page, widened), then the page
        step of each of its `tiles` tiles; the next page `nxt` of `pool` prefetched alongside
        (within the first tile's score loop where the page is read in place)."""
        for hk in T.serial(H_kv):
            if _direct_chunk(widen, pg, n, first_key):
                for t in T.serial(tiles):
                    tile_chunk(
                        ts,
                        tq,
                        tacc,
                        tst,
                        tri,
                        src,
                        src,
                        lambda which, cc, d: (page, which, hk, cc, d),
                        pg,
                        row_visible,
                        (hk * TMAX + t) * D,
                        (hk * TMAX + t) * 4,
                        lambda d: prefetch_line_kv(pool, nxt, hk, d, t == 0),
                    )
            else:
                prefetch(pool, nxt, 0, hk)
                prefetch(pool, nxt, 1, hk)
                for cc in T.serial(KEYS):
                    if _in_range(pg * KEYS + cc, first_key, n):
                        for d in T.vectorized(D):
                            tk[cc, d] = src[page, 0, hk, cc, d].astype("float32")
                            tv[cc, d] = src[page, 1, hk, cc, d].astype("float32")
                    else:
                        for d in T.vectorized(D):
                            tk[cc, d] = T.float32(0)
                            tv[cc, d] = T.float32(0)
                for t in T.serial(tiles):
                    tile_chunk(
                        ts,
                        tq,
                        tacc,
                        tst,
                        tri,
                        tk,
                        tv,
                        lambda which, cc, d: (cc, d),
                        pg,
                        row_visible,
                        (hk * TMAX + t) * D,
                        (hk * TMAX + t) * 4,
                    )

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_values: T.handle,
        var_length_info: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset
        )
        pages = T.match_buffer(var_pages, (max_num_pages, 2, H_kv, PAGE, D), dtype)
        page_indptr = T.match_buffer(
            var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_values = T.match_buffer(
            var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        k_rope_pos_offset = T.match_buffer(  # noqa: F841 (part of the signature)
            var_k_rope_pos_offset,
            (batch_size,),
            "int32",
            elem_offset=k_rope_pos_offset_elem_offset,
        )
        q_rope_position = T.match_buffer(  # noqa: F841
            var_q_rope_position, (total_len,), "int32", elem_offset=q_rope_position_elem_offset
        )
        output = T.match_buffer(var_output, (total_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (total_len, H_qo), "float32")
        length_info = T.match_buffer(
            var_length_info, info.shape(batch_size), "int32", elem_offset=length_info_elem_offset
        )
        assert rotary_mode == 0, "mlcrun's prefill attention expects RoPE already applied"
        info.check_no_sink(length_info, batch_size)

        # Short sequences: tasks 0 .. counts[0]-1, one per sequence (a long one's does
        # nothing) or, in a batch under SPLIT_TASKS sequences, one per chunk of pages of a
        # short sequence (chunk_start/chunk_seq as in decode). Long ones: counts[1] tiles
        # times H_kv tasks after them.
        chunk_start = T.alloc_buffer((SPLIT_TASKS + 1,), "int32")
        chunk_seq = T.alloc_buffer((MAX_CHUNKS,), "int32")
        part_acc = T.alloc_buffer((MAX_CHUNKS, QMAX * H_qo, D), "float32")
        part_m = T.alloc_buffer((MAX_CHUNKS, QMAX * H_qo), "float32")
        part_den = T.alloc_buffer((MAX_CHUNKS, QMAX * H_qo), "float32")
        counts = T.alloc_buffer((3,), "int32")
        counts[2] = page_indptr[batch_size] - page_indptr[0]  # the pages to read
        for b in T.serial(info.windowed(batch_size)):
            counts[2] = counts[2] - skip(causal, page_indptr, length_info, b)
        split: T.let[T.bool] = batch_size < SPLIT_TASKS
        chunk_pages: T.let[T.int32] = T.max(MIN_SPLIT_PAGES, T.ceildiv(counts[2], SPLIT_TASKS))
        counts[0] = batch_size
        counts[1] = 0
        for b in T.serial(batch_size):
            if q_indptr[b + 1] - q_indptr[b] > QMAX:
                counts[1] = counts[1] + ((q_indptr[b + 1] - q_indptr[b]) * G + LANES - 1) // LANES
        if split:
            chunk_start[0] = 0
            for b in T.serial(batch_size):
                chunk_start[b + 1] = chunk_start[b]
                if q_indptr[b + 1] - q_indptr[b] <= QMAX:
                    chunk_start[b + 1] = chunk_start[b] + _chunk_count(
                        batch_size,
                        page_indptr[b + 1]
                        - page_indptr[b]
                        - skip(causal, page_indptr, length_info, b),
                        chunk_pages,
                    )
                for c in T.serial(chunk_start[b + 1] - chunk_start[b]):
                    chunk_seq[chunk_start[b] + c] = b
            counts[0] = chunk_start[batch_size]

        for task in T.parallel(counts[0] + counts[1] * H_kv):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                if task < counts[0]:
                    b: T.let[T.int32] = T.if_then_else(split, chunk_seq[task], task)
                    q_n: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                    if q_n <= QMAX:
                        qv = T.sblock_alloc_buffer((QMAX * H_qo * D,), "float32")
                        acc = T.sblock_alloc_buffer((QMAX * H_qo * D,), "float32")
                        sc = T.sblock_alloc_buffer((KEYS, LANES), "float32")
                        ra = T.sblock_alloc_buffer((8, LANES), "float32")
                        rb = T.sblock_alloc_buffer((4, LANES), "float32")
                        hx = T.sblock_alloc_buffer((2, LANES), "float32")
                        p = T.sblock_alloc_buffer((QMAX * H_qo, LANES), "float32")
                        den = T.sblock_alloc_buffer((QMAX * H_qo, LANES), "float32")
                        m = T.sblock_alloc_buffer((QMAX * H_qo,), "float32")
                        wide = T.sblock_alloc_buffer((1, 2, H_kv, PAGE, D), "float32")
                        c: T.let[T.int32] = T.if_then_else(split, task - chunk_start[b], 0)
                        whole: T.let[T.bool] = T.if_then_else(
                            split, chunk_start[b + 1] - chunk_start[b] == 1, True
                        )
                        q_begin: T.let[T.int32] = q_indptr[b]
                        begin: T.let[T.int32] = page_indptr[b]
                        num_pages: T.let[T.int32] = page_indptr[b + 1] - begin
                        n: T.let[T.int32] = info.end(page_indptr, length_info, b)
                        first_page: T.let[T.int32] = _chunk_bound(
                            split,
                            chunk_start,
                            b,
                            c,
                            skip(causal, page_indptr, length_info, b),
                            num_pages,
                        )
                        end_page: T.let[T.int32] = _chunk_bound(
                            split,
                            chunk_start,
                            b,
                            c + 1,
                            skip(causal, page_indptr, length_info, b),
                            num_pages,
                        )
                        if q_n * G >= tile_worth * T.ceildiv(q_n * G, LANES):
                            # Row tiles per KV head, their state turned into rows at the end;
                            # a tile's 16 x 16 score block is the rows' `sc` (idle here).
                            tq = T.sblock_alloc_buffer((H_kv * TMAX * D, LANES), "float32")
                            tacc = T.sblock_alloc_buffer((H_kv * TMAX * D, LANES), "float32")
                            tst = T.sblock_alloc_buffer((H_kv * TMAX * 4, LANES), "float32")
                            tri = T.sblock_alloc_buffer((H_kv * TMAX * 4, LANES), "int32")
                            tk = T.sblock_alloc_buffer((KEYS, D), "float32")
                            tv = T.sblock_alloc_buffer((KEYS, D), "float32")
                            tiles: T.let[T.int32] = T.ceildiv(q_n * G, LANES)
                            for hk in T.serial(H_kv):
                                for t in T.serial(tiles):
                                    tile_start(
                                        q,
                                        sm_scale,
                                        q_begin,
                                        q_n,
                                        t,
                                        hk,
                                        row_end(causal, n, q_n),
                                        _row_first(
                                            first_slots(causal, page_indptr, length_info, b)
                                        ),
                                        tq,
                                        tacc,
                                        tst,
                                        tri,
                                        tk,
                                        sc,
                                        tv,
                                        (hk * TMAX + t) * D,
                                        (hk * TMAX + t) * 4,
                                    )
                            for pg in T.serial(first_page, end_page):
                                tile_pass(
                                    tq,
                                    tacc,
                                    tst,
                                    tri,
                                    sc,
                                    tk,
                                    tv,
                                    pages,
                                    page_values[begin + pg],
                                    pg,
                                    n,
                                    tiles,
                                    pages,
                                    page_values[begin + T.min(pg + PREFETCH_PAGES, num_pages - 1)],
                                    _tile_first_key(
                                        first_slots(causal, page_indptr, length_info, b), 0, G
                                    ),
                                )
                            for hk in T.serial(H_kv):
                                for t in T.serial(tiles):
                                    for b16 in T.serial(D // LANES):
                                        _transpose16(
                                            tk,
                                            0,
                                            b16 * LANES,
                                            tacc,
                                            (hk * TMAX + t) * D + b16 * LANES,
                                            0,
                                            sc,
                                            tv,
                                        )
                                    for r in T.serial(T.min(LANES, q_n * G - t * LANES)):
                                        row: T.let[T.int32] = (
                                            (t * LANES + r) // G * H_qo
                                            + hk * G
                                            + (t * LANES + r) % G
                                        )
                                        for d in T.vectorized(D):
                                            acc[row * D + d] = tk[r, d]
                                        for j in T.vectorized(LANES):
                                            den[row, j] = T.Select(
                                                j == 0,
                                                tst[(hk * TMAX + t) * 4 + 2, r],
                                                T.float32(0),
                                            )
                                        m[row] = tst[(hk * TMAX + t) * 4, r]
                        else:
                            for r in T.serial(q_n * H_qo):
                                for d in T.vectorized(D):
                                    qv[r * D + d] = q[q_begin + r // H_qo, r % H_qo, d].astype(
                                        "float32"
                                    ) * (sm_scale * LOG2E)
                                    acc[r * D + d] = T.float32(0)
                                for j in T.vectorized(LANES):
                                    den[r, j] = T.float32(0)
                                m[r] = T.float32(EMPTY)
                            for pg in T.serial(first_page, end_page):
                                nxt: T.let[T.int32] = page_values[
                                    begin + T.min(pg + PREFETCH_PAGES, num_pages - 1)
                                ]
                                if widen:
                                    # float16: the page widened once, not once per row
                                    for w in T.serial(2):
                                        for hk in T.serial(H_kv):
                                            for cc in T.serial(PAGE):
                                                for d in T.vectorized(D):
                                                    wide[0, w, hk, cc, d] = pages[
                                                        page_values[begin + pg], w, hk, cc, d
                                                    ].astype("float32")
                                page_pass(
                                    qv,
                                    acc,
                                    sc,
                                    ra,
                                    rb,
                                    hx,
                                    p,
                                    m,
                                    den,
                                    wide if widen else pages,  # (widen: a Python bool)
                                    0 if widen else page_values[begin + pg],
                                    pg,
                                    n,
                                    q_n,
                                    causal,
                                    pages,
                                    nxt,
                                    first_slots(causal, page_indptr, length_info, b),
                                )
                        for r in T.serial(q_n * H_qo):
                            hx[1, 0] = T.float32(0)
                            for j in T.serial(LANES):
                                hx[1, 0] = hx[1, 0] + den[r, j]
                            if whole:
                                for d in T.vectorized(D):
                                    output[q_begin + r // H_qo, r % H_qo, d] = T.if_then_else(
                                        hx[1, 0] > 0, acc[r * D + d] / hx[1, 0], T.float32(0)
                                    ).astype(output.dtype)
                                lse[q_begin + r // H_qo, r % H_qo] = T.if_then_else(
                                    hx[1, 0] > 0, m[r] + T.log2(hx[1, 0]), T.float32(EMPTY)
                                )
                            else:
                                for d in T.vectorized(D):
                                    part_acc[task, r, d] = acc[r * D + d]
                                part_m[task, r] = m[r]
                                part_den[task, r] = hx[1, 0]
                else:
                    where = T.sblock_alloc_buffer((3,), "int32")
                    _find_tile(
                        where,
                        q_indptr,
                        batch_size,
                        _balanced((task - counts[0]) // H_kv, counts[1]),
                        G,
                        QMAX + 1,
                    )
                    if where[0] >= 0:
                        b: T.let[T.int32] = where[0]
                        t: T.let[T.int32] = where[1]
                        hk: T.let[T.int32] = (task - counts[0]) % H_kv
                        q_n: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                        page_begin: T.let[T.int32] = page_indptr[b]
                        kv_n: T.let[T.int32] = info.end(page_indptr, length_info, b)
                        tile(
                            q,
                            output,
                            lse,
                            sm_scale,
                            q_indptr[b],
                            q_n,
                            t,
                            hk,
                            kv_n,
                            row_end(causal, kv_n, q_n)(
                                (T.min(t * LANES + LANES, q_n * G) - 1) // G
                            ),
                            row_end(causal, kv_n, q_n),
                            _row_first(first_slots(causal, page_indptr, length_info, b)),
                            row_visible,
                            pages,
                            pages,
                            lambda which, c, cc, d: (page_values[page_begin + c], which, hk, cc, d),
                            _tile_first_key(first_slots(causal, page_indptr, length_info, b), t, G),
                        )

        if split and counts[0] > 0:
            # Merge the chunks of each split sequence on the calling thread, as decode does.
            for b in T.serial(batch_size):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    macc = T.sblock_alloc_buffer((D,), "float32")
                    w = T.sblock_alloc_buffer((3,), "float32")
                    c0: T.let[T.int32] = chunk_start[b]
                    nc: T.let[T.int32] = chunk_start[b + 1] - c0
                    if nc > 1:
                        for r in T.serial((q_indptr[b + 1] - q_indptr[b]) * H_qo):
                            w[0] = T.float32(EMPTY)
                            for c in T.serial(nc):
                                w[0] = T.max(w[0], part_m[c0 + c, r])
                            w[1] = T.float32(0)
                            for d in T.vectorized(D):
                                macc[d] = T.float32(0)
                            for c in T.serial(nc):
                                w[2] = exp2_nonpositive(part_m[c0 + c, r] - w[0])
                                w[1] = w[1] + part_den[c0 + c, r] * w[2]
                                for d in T.vectorized(D):
                                    macc[d] = macc[d] + part_acc[c0 + c, r, d] * w[2]
                            for d in T.vectorized(D):
                                output[q_indptr[b] + r // H_qo, r % H_qo, d] = T.if_then_else(
                                    w[1] > 0, macc[d] / w[1], T.float32(0)
                                ).astype(output.dtype)
                            lse[q_indptr[b] + r // H_qo, r % H_qo] = T.if_then_else(
                                w[1] > 0, w[0] + T.log2(w[1]), T.float32(EMPTY)
                            )

    return batch_prefill_paged_kv_cpu


def tree_ragged_attention(
    num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, key_block: int = KEYS
):
    """The nodes of each sequence's token tree attend to their ancestors among the new tokens
    (TVM's `batch_tree_attn`, same signature; rotary_mode must be 0)."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    G = H_qo // H_kv
    tile = _row_tile(D, G, dtype, key_block)[0]

    @T.prim_func(s_tir=True)
    def batch_tree_attn(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_kv_indptr: T.handle,
        var_q_rope_position: T.handle,
        var_mn_indptr: T.handle,
        var_mask: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        mn_indptr_elem_offset = T.int32()
        mask_elem_offset = T.int32()
        tree_size = T.int32()
        batch_size_plus_1 = T.int32()
        q = T.match_buffer(var_q, (qo_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size_plus_1,), "int32", elem_offset=q_indptr_elem_offset
        )
        k = T.match_buffer(var_k, (kv_len, H_kv, D), dtype)
        v = T.match_buffer(var_v, (kv_len, H_kv, D), dtype)
        kv_indptr = T.match_buffer(
            var_kv_indptr, (batch_size_plus_1,), "int32", elem_offset=kv_indptr_elem_offset
        )
        q_rope_position = T.match_buffer(  # noqa: F841 (part of the signature)
            var_q_rope_position, (qo_len,), "int32", elem_offset=q_rope_position_elem_offset
        )
        mn_indptr = T.match_buffer(
            var_mn_indptr, (batch_size_plus_1,), "int32", elem_offset=mn_indptr_elem_offset
        )
        mask = T.match_buffer(var_mask, (tree_size, 2), "int32", elem_offset=mask_elem_offset)
        output = T.match_buffer(var_output, (qo_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (qo_len, H_qo), "float32")
        assert rotary_mode == 0, "mlcrun's tree attention expects RoPE already applied"

        for task in T.parallel(_tile_count(qo_len, batch_size_plus_1 - 1, G) * H_kv):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                where = T.sblock_alloc_buffer((3,), "int32")
                _find_tile(
                    where,
                    q_indptr,
                    batch_size_plus_1 - 1,
                    _balanced(task // H_kv, _tile_count(qo_len, batch_size_plus_1 - 1, G)),
                    G,
                    0,
                )
                if where[0] >= 0:
                    b: T.let[T.int32] = where[0]
                    t: T.let[T.int32] = where[1]
                    hk: T.let[T.int32] = task % H_kv
                    q_n: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                    kv_n: T.let[T.int32] = kv_indptr[b + 1] - kv_indptr[b]
                    kv_begin: T.let[T.int32] = kv_indptr[b]
                    tree_begin: T.let[T.int32] = mn_indptr[b]
                    tree_n: T.let[T.int32] = mn_indptr[b + 1] - mn_indptr[b]
                    tile(
                        q,
                        output,
                        lse,
                        sm_scale,
                        q_indptr[b],
                        q_n,
                        t,
                        hk,
                        kv_n,
                        kv_n,
                        lambda tok: kv_n,
                        lambda tok: mask[tree_begin + tok + tree_n - q_n, 0],
                        _tree_visible(mask, tree_begin, kv_n - tree_n, kv_n),
                        k,
                        v,
                        lambda which, c, cc, d: (kv_begin + c * KEYS + cc, hk, d),
                        None,
                    )

    return batch_tree_attn


def tree_paged_attention(
    num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, key_block: int = KEYS
):
    """The nodes of each sequence's token tree attend to the sequence's cached K/V, the tree
    itself being its last keys (TVM's `tree_attn_paged_kv_cpu`, same signature; used when the
    tree's K/V were appended before attention)."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    G = H_qo // H_kv
    tile = _row_tile(D, G, dtype, key_block)[0]

    @T.prim_func(s_tir=True)
    def tree_attn_paged_kv_cpu(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_values: T.handle,
        var_length_info: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
        tree_order_indptr_handle: T.handle,
        tree_order_handle: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        tree_order_elem_offset = T.int32()
        tree_order_indptr_elem_offset = T.int32()
        total_tree_order_len = T.int32()
        q = T.match_buffer(var_q, (total_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset
        )
        pages = T.match_buffer(var_pages, (max_num_pages, 2, H_kv, PAGE, D), dtype)
        page_indptr = T.match_buffer(
            var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_values = T.match_buffer(
            var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        k_rope_pos_offset = T.match_buffer(  # noqa: F841 (part of the signature)
            var_k_rope_pos_offset,
            (batch_size,),
            "int32",
            elem_offset=k_rope_pos_offset_elem_offset,
        )
        q_rope_position = T.match_buffer(  # noqa: F841
            var_q_rope_position, (total_len,), "int32", elem_offset=q_rope_position_elem_offset
        )
        output = T.match_buffer(var_output, (total_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (total_len, H_qo), "float32")
        last_page_len = T.match_buffer(
            var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset
        )
        tree_order_indptr = T.match_buffer(
            tree_order_indptr_handle,
            (batch_size + 1,),
            "int32",
            elem_offset=tree_order_indptr_elem_offset,
        )
        tree_order = T.match_buffer(
            tree_order_handle,
            (total_tree_order_len, 2),
            "int32",
            elem_offset=tree_order_elem_offset,
        )
        assert rotary_mode == 0, "mlcrun's tree attention expects RoPE already applied"

        for task in T.parallel(_tile_count(total_len, batch_size, G) * H_kv):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                where = T.sblock_alloc_buffer((3,), "int32")
                _find_tile(
                    where,
                    q_indptr,
                    batch_size,
                    _balanced(task // H_kv, _tile_count(total_len, batch_size, G)),
                    G,
                    0,
                )
                if where[0] >= 0:
                    b: T.let[T.int32] = where[0]
                    t: T.let[T.int32] = where[1]
                    hk: T.let[T.int32] = task % H_kv
                    q_n: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                    page_begin: T.let[T.int32] = page_indptr[b]
                    kv_n: T.let[T.int32] = T.if_then_else(
                        page_indptr[b + 1] > page_begin,
                        (page_indptr[b + 1] - page_begin - 1) * PAGE + last_page_len[b],
                        0,
                    )
                    tree_begin: T.let[T.int32] = tree_order_indptr[b]
                    tree_n: T.let[T.int32] = tree_order_indptr[b + 1] - tree_order_indptr[b]
                    tile(
                        q,
                        output,
                        lse,
                        sm_scale,
                        q_indptr[b],
                        q_n,
                        t,
                        hk,
                        kv_n,
                        kv_n,
                        lambda tok: kv_n,
                        lambda tok: tree_order[tree_begin + tok + tree_n - q_n, 0],
                        _tree_visible(tree_order, tree_begin, kv_n - tree_n, kv_n),
                        pages,
                        pages,
                        lambda which, c, cc, d: (page_values[page_begin + c], which, hk, cc, d),
                        None,
                    )

    return tree_attn_paged_kv_cpu


# ------------------------------------------------------------------------------- merge


def merge_state(num_qo_heads: int, head_dim: int, dtype: str):
    """Merge two partial attention results in place (TVM's `merge_state_inplace_cpu`, same
    signature): rows in parallel (up to MERGE_SERIAL rows on the calling thread), the head
    dimension vectorized, float32 math."""
    H, D = num_qo_heads, head_dim

    @T.macro
    def merge_row(V, S, V_other, S_other, n):
        w = T.sblock_alloc_buffer((2,), "float32")
        for h in T.serial(H):
            # weights of the two parts, relative to the larger lse (exact for -5e4)
            w[0] = T.exp2(S[n, h] - T.max(S[n, h], S_other[n, h]))
            w[1] = T.exp2(S_other[n, h] - T.max(S[n, h], S_other[n, h]))
            # A part of weight 0 is left out, not multiplied by 0: a part in which a row saw
            # no key (TVM's windowed kernels, lse -5e4 below the other) may hold inf or NaN,
            # and 0 * NaN is NaN.
            for d in T.vectorized(D):
                V[n, h, d] = (
                    (
                        T.Select(w[0] > 0, V[n, h, d].astype("float32") * w[0], 0.0)
                        + T.Select(w[1] > 0, V_other[n, h, d].astype("float32") * w[1], 0.0)
                    )
                    / (w[0] + w[1])
                ).astype(dtype)
            S[n, h] = T.log2(w[0] + w[1]) + T.max(S[n, h], S_other[n, h])

    @T.prim_func(s_tir=True)
    def merge_state_inplace_cpu(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        N = T.int32()
        V = T.match_buffer(v, (N, H, D), dtype)
        S = T.match_buffer(s, (N, H), "float32")
        V_other = T.match_buffer(v_other, (N, H, D), dtype)
        S_other = T.match_buffer(s_other, (N, H), "float32")
        if N <= MERGE_SERIAL:
            for n in T.serial(N):
                with T.sblock("merge_row"):
                    T.reads()
                    T.writes()
                    merge_row(V, S, V_other, S_other, n)
        else:
            for n in T.parallel(N):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    merge_row(V, S, V_other, S_other, n)

    return merge_state_inplace_cpu
