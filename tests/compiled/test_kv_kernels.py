"""mlcrun's KV-cache attention kernels (compiler/kv_attention.py) against numpy, on odd shapes.

Each kernel is compiled on its own for the host CPU and called as the paged KV cache calls it:
ragged sequences of odd lengths, partly filled and scattered pages whose unused slots (and
unused pages) hold NaN, GQA groups of 1, 2, 3 and 8, head dims 16, 32 and 64, float32 and
float16 storage. The reference is float64 numpy: softmax(q k^T * sm_scale) v and the
log2-sum-exp of the scaled scores, as TVM's kernels define them.
"""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from mlcrun.compiler import kv_attention as A  # noqa: E402
from mlcrun.compiler.target import cpu_target  # noqa: E402

RNG = np.random.default_rng(0)
SHAPES = [(4, 2, 16), (6, 2, 32), (8, 1, 16), (3, 3, 32), (9, 3, 64)]  # (H_qo, H_kv, D)
DTYPES = ["float32", "float16"]
TOL = {"float32": 2e-5, "float16": 2e-3}  # float16: the output row is rounded to float16

_built: dict = {}


def _build(factory, shape, dtype, **kwargs):
    key = (factory.__name__, shape, dtype, *sorted(kwargs.items()))
    if key not in _built:
        h_qo, h_kv, d = shape
        func = factory(h_kv, h_qo, d, dtype, **kwargs).with_attr("global_symbol", "main")
        _built[key] = tvm.compile(tvm.IRModule({"main": func}), target=cpu_target())["main"]
    return _built[key]


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a))


def _ref(q, k, v, visible, scale):
    """q [n, H, D], k/v [m, Hkv, D], visible [n, m] -> out [n, H, D], lse [n, H] (float64)."""
    n, h_qo, _ = q.shape
    group = h_qo // k.shape[1]
    out = np.zeros(q.shape)
    lse = np.full((n, h_qo), -5e4)
    for h in range(h_qo):
        scores = q[:, h].astype(np.float64) @ k[:, h // group].astype(np.float64).T * scale
        scores = np.where(visible, scores, -np.inf)
        for i in range(n):
            if not visible[i].any():
                continue
            top = scores[i].max()
            p = np.exp(scores[i] - top)
            out[i, h] = p @ v[:, h // group].astype(np.float64) / p.sum()
            lse[i, h] = (top + np.log(p.sum())) / np.log(2)
    return out, lse


def _pages(kv_lens, h_kv, d, dtype):
    """Each sequence's K/V [len, Hkv, D] and a page pool holding them on shuffled pages, with
    NaN in every slot no sequence uses."""
    counts = [(n + A.PAGE - 1) // A.PAGE for n in kv_lens]
    total = sum(counts) + 3
    pool = np.full((total, 2, h_kv, A.PAGE, d), np.nan, dtype)
    order = RNG.permutation(total)[: sum(counts)].astype(np.int32)
    keys, values, indptr, last = [], [], [0], []
    for n, count in zip(kv_lens, counts, strict=True):
        k = RNG.standard_normal((n, h_kv, d)).astype(dtype)
        v = RNG.standard_normal((n, h_kv, d)).astype(dtype)
        for j in range(n):
            page = order[indptr[-1] + j // A.PAGE]
            pool[page, 0, :, j % A.PAGE] = k[j]
            pool[page, 1, :, j % A.PAGE] = v[j]
        keys.append(k)
        values.append(v)
        indptr.append(indptr[-1] + count)
        last.append(n - (count - 1) * A.PAGE if count else 0)
    return pool, order, np.array(indptr, np.int32), np.array(last, np.int32), keys, values


def _dfs_order(parents):
    """TVM's tree mask: per node [first, end) of its DFS interval (roots in order)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    order = np.zeros((len(parents), 2), np.int32)
    count = 0

    def visit(node):
        nonlocal count
        order[node, 0] = count
        count += 1
        end = count
        for child in children.get(node, []):
            end = max(end, visit(child))
        order[node, 1] = end
        return end

    for root in children.get(-1, []):
        visit(root)
    return order


def _ancestors(parents):
    """[n, n]: node i sees node j (j is i or an ancestor of i)."""
    n = len(parents)
    seen = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            seen[i, j] = True
            j = parents[j]
    return seen


def _check(out, lse, want, dtype, rows=None):
    out, lse = out.numpy().astype(np.float64), lse.numpy()
    rows = slice(None) if rows is None else rows
    assert np.isfinite(out[rows]).all()
    np.testing.assert_allclose(out[rows], want[0][rows], atol=TOL[dtype], rtol=0)
    np.testing.assert_allclose(lse[rows], want[1][rows], atol=TOL[dtype] * 10, rtol=0)


def _length_info(last, offsets):
    """TVM's length_info: last-page lengths, or (a window's offsets given) [3, B] with the
    offsets and attention-sink lengths of 0."""
    if offsets is None:
        return last
    return np.stack([last, np.array(offsets, np.int32), np.zeros_like(last)])


def _check_decode(shape, dtype, kv_lens, offsets=None):
    """Decode attention (one query row per sequence) over sequences of kv_lens keys; with
    offsets, the windowed kernel over keys offsets[b] .. kv_lens[b]-1."""
    h_qo, h_kv, d = shape
    pool, values, indptr, last, keys, vals = _pages(kv_lens, h_kv, d, dtype)
    q = RNG.standard_normal((len(kv_lens), h_qo, d)).astype(dtype)
    out = _t(np.zeros(q.shape, dtype))
    lse = _t(np.zeros(q.shape[:2], np.float32))
    zeros = _t(np.zeros(len(kv_lens), np.int32))
    scale = d**-0.5
    window = {} if offsets is None else {"window": 24}  # unused by decode: offsets say it all
    f = _build(A.decode_attention, shape, dtype, **window)
    info = _t(_length_info(last, offsets))
    f(_t(q), _t(pool), _t(indptr), _t(values), info, zeros, zeros, out, lse, 0, 1.0, 1e4, scale)
    want_out, want_lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for b, n in enumerate(kv_lens):
        visible = np.arange(n)[None, :] >= (0 if offsets is None else offsets[b])
        want_out[b : b + 1], want_lse[b : b + 1] = _ref(
            q[b : b + 1], keys[b], vals[b], visible, scale
        )
    _check(out, lse, (want_out, want_lse), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode(shape, dtype):
    # one page exactly, a partial page, an empty sequence
    _check_decode(shape, dtype, [1, 16, 37, 0, 100])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("factory", [A.decode_attention, A.prefill_paged_attention])
def test_page_prefetch(factory, dtype):
    # the decode-structure kernels prefetch, per page and KV head, every 64-byte line of the
    # next page's 16 K and 16 V rows (in the loop over KV heads); numerics: the tests above
    # (the last page prefetches itself). The paged prefill has two page steps, by rows and
    # by row tiles, and each prefetches; the row tiles' float32 pages read in place spread it
    # over their score loop instead (one K and one V line per dimension: two calls in a loop).
    h_qo, h_kv, d = 9, 3, 64
    func = factory(h_kv, h_qo, d, dtype).with_attr("global_symbol", "main")
    llvm_ir = tvm.compile(tvm.IRModule({"main": func}), target=cpu_target()).mod.inspect_source(
        "ll"
    )
    lines = 2 * A.PAGE * d * np.dtype(dtype).itemsize // 64
    passes = 2 if factory is A.prefill_paged_attention else 1
    spread = 2 if factory is A.prefill_paged_attention and dtype == "float32" else 0
    assert llvm_ir.count("call void @llvm.prefetch") == passes * lines + spread


# Batches below A.SPLIT_TASKS sequences split a sequence of more than A.MIN_SPLIT_PAGES pages
# into chunks (merged after); a batch of many sequences takes each whole.
DECODE_LENS = {
    "one key": [1],
    "partial page": [15],
    "page and one": [17],
    "split, partial last page": [511],
    "split, uneven chunks": [2049],
    "mixed": [2049, 3, 0, 300, 64, 65],
    "many": [700, *range(1, 2 * A.SPLIT_TASKS, 2)],
}


@pytest.mark.parametrize("lens", DECODE_LENS.values(), ids=DECODE_LENS.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 2, 64), (9, 3, 64), (14, 2, 64)], ids=["G1", "G3", "G7"])
def test_decode_split(shape, dtype, lens):
    _check_decode(shape, dtype, lens)


# Tokens per sequence of a ragged call: 16-row tiles, and few tokens in all (at most
# RAGGED_SHORT: row by row on the calling thread), up to exactly that many.
RAGGED_LENS = {"tiles": [5, 1, 33, 16, 18], "short": [3, 1, 5], "short-limit": [A.RAGGED_SHORT]}


@pytest.mark.parametrize("lens", RAGGED_LENS.values(), ids=RAGGED_LENS.keys())
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_ragged(shape, dtype, causal, lens):
    h_qo, h_kv, d = shape
    n = sum(lens)
    q = RNG.standard_normal((n, h_qo, d)).astype(dtype)
    k = RNG.standard_normal((n, h_kv, d)).astype(dtype)
    v = RNG.standard_normal((n, h_kv, d)).astype(dtype)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    out = _t(np.zeros(q.shape, dtype))
    lse = _t(np.zeros(q.shape[:2], np.float32))
    scale = d**-0.5
    f = _build(A.prefill_ragged_attention, shape, dtype)
    f(
        _t(q),
        _t(indptr),
        _t(k),
        _t(v),
        _t(indptr),
        _t(np.zeros(n, np.int32)),
        _t(np.zeros(len(lens), np.int32)),
        out,
        lse,
        causal,
        0,
        1.0,
        1e4,
        scale,
    )
    want_out, want_lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for b, m in enumerate(lens):
        rows = slice(indptr[b], indptr[b + 1])
        visible = np.tril(np.ones((m, m), bool)) if causal else np.ones((m, m), bool)
        want_out[rows], want_lse[rows] = _ref(q[rows], k[rows], v[rows], visible, scale)
    _check(out, lse, (want_out, want_lse), dtype)


def _check_prefill_paged(shape, dtype, causal, kv_lens, q_lens, window=None, offsets=None):
    """Paged prefill: q_lens new rows per sequence over its kv_lens cached keys (causal: the
    rows are the sequence's last keys). With a window: the windowed kernel over keys
    offsets[b] .. kv_lens[b]-1, where (causal) row i of a chunk sees the last window - i - 1
    of them (TVM's mask for a sliding_attention layer's cached keys)."""
    h_qo, h_kv, d = shape
    pool, values, indptr, last, keys, vals = _pages(kv_lens, h_kv, d, dtype)
    n = sum(q_lens)
    q = RNG.standard_normal((n, h_qo, d)).astype(dtype)
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    out = _t(np.zeros(q.shape, dtype))
    lse = _t(np.zeros(q.shape[:2], np.float32))
    scale = d**-0.5
    f = _build(A.prefill_paged_attention, shape, dtype, **({"window": window} if window else {}))
    zeros = _t(np.zeros(len(kv_lens), np.int32))
    f(
        _t(q),
        _t(q_indptr),
        _t(pool),
        _t(indptr),
        _t(values),
        _t(_length_info(last, offsets if window else None)),
        zeros,
        _t(np.zeros(n, np.int32)),
        out,
        lse,
        causal,
        0,
        1.0,
        1e4,
        scale,
    )
    want_out, want_lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for b, (m, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        rows = slice(q_indptr[b], q_indptr[b + 1])
        visible = np.ones((m, kv), bool)
        if window:
            slot = np.arange(kv)[None, :]
            visible = np.broadcast_to(slot >= offsets[b], (m, kv))
            if causal:
                past = np.maximum(window - np.arange(m) - 1, 0)[:, None]
                visible = visible & (slot - offsets[b] >= kv - offsets[b] - past)
        elif causal:
            visible = np.arange(kv)[None, :] <= (kv - m + np.arange(m))[:, None]
        want_out[rows], want_lse[rows] = _ref(q[rows], keys[b], vals[b], visible, scale)
    _check(out, lse, (want_out, want_lse), dtype)


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_paged(shape, dtype, causal):
    _check_prefill_paged(shape, dtype, causal, [40, 7, 0, 16, 70], [5, 7, 0, 3, 20])


# A sequence of at most A.SHORT_ROWS[dtype] // G new tokens takes the decode structure (split into
# page chunks in a batch under A.SPLIT_TASKS sequences), a longer one 16-row tiles.
PAGED_LENS = {
    "empty cache": ([0], [4]),
    "one key": ([1], [2]),
    "partial page": ([15], [8]),
    "page and one": ([17], [9]),
    "split": ([511], [4]),
    "split, long chunk": ([511], [17]),
    "mixed": ([511, 3, 0, 300, 64, 65, 200], [1, 17, 2, 8, 9, 4, 40]),
    "many": ([700, *range(1, 2 * A.SPLIT_TASKS, 2)], [2] * (A.SPLIT_TASKS + 1)),
}


@pytest.mark.parametrize("q_len", [1, 2, 4, 8, 9, 12, 17, 23])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 2, 64), (9, 3, 64), (14, 2, 64)], ids=["G1", "G3", "G7"])
def test_prefill_paged_short(shape, dtype, causal, q_len):
    _check_prefill_paged(shape, dtype, causal, [256, 33], [q_len, q_len])


@pytest.mark.parametrize("lens", PAGED_LENS.values(), ids=PAGED_LENS.keys())
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 2, 64), (9, 3, 64), (14, 2, 64)], ids=["G1", "G3", "G7"])
def test_prefill_paged_lens(shape, dtype, causal, lens):
    kv_lens, q_lens = lens
    if causal:  # the rows are the last keys: at least as many keys as rows
        kv_lens = [max(kv, q) for kv, q in zip(kv_lens, q_lens, strict=True)]
    _check_prefill_paged(shape, dtype, causal, kv_lens, q_lens)


# A sliding_attention layer's kernels: keys from a window offset into the sequence's pages (on
# a page boundary, inside a page, at the end: no key), small batches split into page chunks.
WINDOW_DECODE = {
    "inside a page": ([37], [5]),
    "page boundary": ([100], [32]),
    "no key": ([20], [20]),
    "split": ([2049], [1500]),
    "mixed": ([2049, 3, 0, 300, 64, 65], [2049 - 512, 0, 0, 299, 60, 1]),
    "many": ([700, *range(1, 2 * A.SPLIT_TASKS, 2)], [189] + [0] * A.SPLIT_TASKS),
}


@pytest.mark.parametrize("lens", WINDOW_DECODE.values(), ids=WINDOW_DECODE.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 2, 16), (9, 3, 64), (4, 1, 32)], ids=["G2", "G3", "G4"])
def test_decode_window(shape, dtype, lens):
    _check_decode(shape, dtype, *lens)


# (window, kv_lens, q_lens, offsets): short rows (decode structure, split) and tiles; windows
# shorter and longer than the cache, offsets as the cache sets them and odd ones.
WINDOW_PAGED = {
    "short rows": (20, [256, 33, 5], [2, 4, 1], [256 - 19, 33 - 19, 0]),
    "verify": (24, [511, 40], [5, 5], [0, 17]),
    "tiles": (20, [256, 33, 0], [17, 9, 3], [256 - 19, 14, 0]),
    "long window": (512, [700, 300], [40, 2], [700 - 511, 0]),
    "split": (300, [2049], [3], [2049 - 299]),
    "many": (
        40,
        [700, *range(1, 2 * A.SPLIT_TASKS, 2)],
        [2] * (A.SPLIT_TASKS + 1),
        [600] + [0] * A.SPLIT_TASKS,
    ),
}


@pytest.mark.parametrize("case", WINDOW_PAGED.values(), ids=WINDOW_PAGED.keys())
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 2, 16), (9, 3, 64), (4, 1, 32)], ids=["G2", "G3", "G4"])
def test_prefill_paged_window(shape, dtype, causal, case):
    window, kv_lens, q_lens, offsets = case
    _check_prefill_paged(shape, dtype, causal, kv_lens, q_lens, window, offsets)


def test_window_kernels_refuse_an_attention_sink():
    """mlcrun never gives a sequence an attention sink; a kernel asked for one stops."""
    shape, dtype = (4, 2, 16), "float32"
    pool, values, indptr, last, _, _ = _pages([40], 2, 16, dtype)
    info = np.stack([last, np.array([8], np.int32), np.array([4], np.int32)])
    q = RNG.standard_normal((1, 4, 16)).astype(dtype)
    zeros = _t(np.zeros(1, np.int32))
    f = _build(A.decode_attention, shape, dtype, window=24)
    out, lse = _t(np.zeros(q.shape, dtype)), _t(np.zeros((1, 4), np.float32))
    with pytest.raises(Exception, match="attention sink"):
        f(
            _t(q),
            _t(pool),
            _t(indptr),
            _t(values),
            _t(info),
            zeros,
            zeros,
            out,
            lse,
            0,
            1.0,
            1e4,
            1.0,
        )


TREES = [
    [-1, 0, 0, 1, 1, 2, -1, 6],  # two roots, branching
    [-1],
    [-1, 0, 1, 2, 3],  # a chain
    [-1] + [0] * 20,  # 20 alternatives after the root: more than one tile
    [-1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],  # two long branches
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_tree_ragged(shape, dtype):
    h_qo, h_kv, d = shape
    lens = [len(p) for p in TREES]
    n = sum(lens)
    q = RNG.standard_normal((n, h_qo, d)).astype(dtype)
    k = RNG.standard_normal((n, h_kv, d)).astype(dtype)
    v = RNG.standard_normal((n, h_kv, d)).astype(dtype)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    mask = np.concatenate([_dfs_order(p) for p in TREES])
    out = _t(np.zeros(q.shape, dtype))
    lse = _t(np.zeros(q.shape[:2], np.float32))
    scale = d**-0.5
    f = _build(A.tree_ragged_attention, shape, dtype)
    f(
        _t(q),
        _t(indptr),
        _t(k),
        _t(v),
        _t(indptr),
        _t(np.zeros(n, np.int32)),
        _t(indptr),
        _t(mask),
        out,
        lse,
        0,
        1.0,
        1e4,
        scale,
    )
    want_out, want_lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for b, parents in enumerate(TREES):
        rows = slice(indptr[b], indptr[b + 1])
        want_out[rows], want_lse[rows] = _ref(q[rows], k[rows], v[rows], _ancestors(parents), scale)
    _check(out, lse, (want_out, want_lse), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_tree_paged(shape, dtype):
    h_qo, h_kv, d = shape
    history = [9, 0, 32, 3, 40]
    kv_lens = [h + len(p) for h, p in zip(history, TREES, strict=True)]
    pool, values, indptr, last, keys, vals = _pages(kv_lens, h_kv, d, dtype)
    lens = [len(p) for p in TREES]
    n = sum(lens)
    q = RNG.standard_normal((n, h_qo, d)).astype(dtype)
    q_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    mask = np.concatenate([_dfs_order(p) for p in TREES])
    out = _t(np.zeros(q.shape, dtype))
    lse = _t(np.zeros(q.shape[:2], np.float32))
    scale = d**-0.5
    f = _build(A.tree_paged_attention, shape, dtype)
    zeros = _t(np.zeros(len(lens), np.int32))
    f(
        _t(q),
        _t(q_indptr),
        _t(pool),
        _t(indptr),
        _t(values),
        _t(last),
        zeros,
        _t(np.zeros(n, np.int32)),
        out,
        lse,
        0,
        1.0,
        1e4,
        scale,
        _t(q_indptr),
        _t(mask),
    )
    want_out, want_lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for b, parents in enumerate(TREES):
        rows = slice(q_indptr[b], q_indptr[b + 1])
        m = len(parents)
        visible = np.concatenate([np.ones((m, history[b]), bool), _ancestors(parents)], axis=1)
        want_out[rows], want_lse[rows] = _ref(q[rows], keys[b], vals[b], visible, scale)
    _check(out, lse, (want_out, want_lse), dtype)


@pytest.mark.parametrize("bits", [b for b, keys in A.TILE_KEY_BLOCKS.items() if keys != A.KEYS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_tiles_in_key_blocks(monkeypatch, dtype, bits):
    """The row tiles as a CPU with `bits`-bit vectors gets them (AVX2: fewer keys per score
    pass, TILE_KEY_BLOCKS, and the tile pass from fewer rows, TILE_WORTH_BY_BITS), built for
    any CPU: paged prefill (long tiles, and the tile pass of a short sequence's 9 and 15
    rows), ragged prefill in tiles, and both tree kernels."""
    key_block, worth = A.tile_key_block(bits), A.tile_worth(bits)
    assert worth <= 9  # the 3 new tokens of (9, 3, 64) below take the tile pass
    for name in (
        "prefill_paged_attention",
        "prefill_ragged_attention",
        "tree_ragged_attention",
        "tree_paged_attention",
    ):
        factory = getattr(A, name)
        extra = {"tile_worth": worth} if name == "prefill_paged_attention" else {}

        def blocked(*args, factory=factory, extra=extra, **kwargs):
            return factory(*args, key_block=key_block, **extra, **kwargs)

        blocked.__name__ = f"{name}_{bits}"  # its own entry in _build's cache
        monkeypatch.setattr(A, name, blocked)
    for shape in [(9, 3, 64), (6, 2, 32)]:
        for causal in (0, 1):
            _check_prefill_paged(shape, dtype, causal, [40, 7, 0, 16, 70], [5, 7, 0, 3, 20])
            test_prefill_ragged(shape, dtype, causal, RAGGED_LENS["tiles"])
        test_tree_ragged(shape, dtype)
        test_tree_paged(shape, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [37, A.MERGE_SERIAL], ids=["parallel", "serial"])
def test_merge_state(dtype, n):
    h, d = 6, 32
    v = RNG.standard_normal((n, h, d)).astype(dtype)
    other = RNG.standard_normal((n, h, d)).astype(dtype)
    s = RNG.uniform(-4, 4, (n, h)).astype(np.float32)
    s_other = RNG.uniform(-4, 4, (n, h)).astype(np.float32)
    s[0], s_other[1] = -5e4, -5e4  # an empty part weighs nothing
    w, w_other = np.exp2(s.astype(np.float64)), np.exp2(s_other.astype(np.float64))
    want = (v * w[..., None] + other * w_other[..., None]) / (w + w_other)[..., None]
    want_s = np.log2(w + w_other)
    want_s[0], want_s[1] = s_other[0], s[1]
    f = tvm.compile(
        tvm.IRModule({"main": A.merge_state(h, d, dtype).with_attr("global_symbol", "main")}),
        target=cpu_target(),
    )["main"]
    tv, ts = _t(v), _t(s)
    f(tv, ts, _t(other), _t(s_other))
    np.testing.assert_allclose(tv.numpy().astype(np.float64), want, atol=TOL[dtype], rtol=0)
    np.testing.assert_allclose(ts.numpy(), want_s, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tokens", [1, 5])  # 1: the serial loop, 5: the parallel one
def test_rope_matches_numpy(tokens: int) -> None:
    """fused_rope (kv_kernels.split_rotary): q/k/v split and rotate-half RoPE, float32."""
    from mlcrun.compiler.kv_kernels import PARALLEL_TOKENS, split_rotary

    assert (tokens >= PARALLEL_TOKENS) == (tokens > 1)
    h_q, h_kv, d, theta = 4, 2, 64, 10000.0
    func = split_rotary(theta, 1.0, d, h_q, h_kv, "float32", {}, d)
    key = ("rope", h_q, h_kv, d)
    if key not in _built:
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        _built[key] = tvm.compile(mod, target=cpu_target())["main"]
    qkv = RNG.standard_normal((tokens, h_q + 2 * h_kv, d)).astype("float32")
    positions = RNG.integers(0, 1000, tokens).astype("int32")  # float32 angles: ulp 6e-5
    q, k, v = (np.zeros((tokens, h, d), "float32") for h in (h_q, h_kv, h_kv))
    out = [_t(a) for a in (q, k, v)]
    _built[key](_t(qkv), _t(positions), *out, 1)

    half = d // 2
    angle = positions[:, None].astype(np.float64) * theta ** (-np.arange(half) * 2.0 / d)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x = qkv[:, : h_q + h_kv].astype(np.float64)
    lo, hi = x[..., :half], x[..., half:]
    rotated = np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)
    np.testing.assert_allclose(out[0].numpy(), rotated[:, :h_q], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out[1].numpy(), rotated[:, h_q:], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out[2].numpy(), qkv[:, h_q + h_kv :])
