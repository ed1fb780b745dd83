"""CPU replacements for the paged KV cache's hot TIR kernels (same signatures, same math).

TVM's `TIRPagedKVCache` ships scalar, single-threaded CPU kernels; in a decode step they took
a fifth (16 cached tokens) to two thirds (512) of the time, and most of a long prefill
(`mlcrun bench --mode kernel --profile`). Ours, swapped in by name for `llvm` targets:

* `fused_rope` (q/k/v split + RoPE): TVM computed cos/sin (and a pow) per *element*, i.e. once
  per head for the same angle. Ours computes each (token, frequency) pair's cos/sin once with
  TVM's own frequency functions (every rope_scaling variant we accept) and applies it to all
  q and k heads; tokens run in parallel. Same expressions, same rounding.
* `batch_decode_paged_kv_cpu`, `batch_prefill_paged_kv_cpu` (query rows over a sequence's
  paged K/V) and `batch_prefill_ragged_kv` (a chunk's rows over its own K/V, causal): one
  shared body (`_attend`): (row, query head) pairs in parallel, the head dimension vectorized,
  the online softmax updated once per chunk of 32 keys instead of after every key, and masked
  keys skipped instead of scored. Causal rows are interleaved short/long so both threads get
  the same work.

Models with a sliding window keep TVM's attention kernels: their cache applies RoPE inside
attention ("inline" mode, rotary_mode 1), which ours refuse (a runtime assert), not emulate.
Parity with transformers: tests/compiled/test_parity.py (including chunked prefill).
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.relax.frontend.nn.llm.position_embedding import switch_rope_freq_func
from tvm.script import tirx as T

ROPE_NAME = "fused_rope"  # TIRPagedKVCache's split_rotary kernel
DECODE_NAME = "batch_decode_paged_kv_cpu"
PREFILL_RAGGED_NAME = "batch_prefill_ragged_kv"
PREFILL_PAGED_NAME = "batch_prefill_paged_kv_cpu"
CHUNK = 32  # KV rows scored together in the decode kernel's online softmax
LOG2E = math.log2(math.e)
LANES = 16  # the attention kernels need head_dim % LANES == 0 (else TVM's are kept)


def _cos_sin(rope_scaling: dict, position, scale, i, rotary_dim: int, theta: float):
    """cos and sin of pair `i`'s angle at `position` (float32), as TVM's kernel has them.
    Fresh expressions on every call: a Let variable may be bound only once in a function."""
    out = []
    for pick in (0, 1):
        pos = position.astype("float32") * scale
        exprs = switch_rope_freq_func(rope_scaling)(pos, i, rotary_dim, theta, "float32")
        expr = exprs[pick]
        for var, value in exprs[2].items():
            expr = tirx.Let(var, value, expr)
        out.append(expr)
    return out[0], out[1]


def split_rotary(
    theta: float,
    scale: float,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    dtype: str,
    rope_scaling: dict,
    rotary_dim: int,
):
    """fused qkv [n, q+2kv heads, D] -> q, k (rotated when apply_rope), v."""
    fused_heads = num_q_heads + 2 * num_kv_heads
    rot_heads = num_q_heads + num_kv_heads
    half = rotary_dim // 2
    scale = tirx.const(scale, "float32")

    @T.prim_func(s_tir=True)
    def fused_rope(
        var_qkv: T.handle,
        var_position_map: T.handle,
        var_q: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        apply_rope: T.int64,
    ):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True, "tirx.is_scheduled": True})
        seq_len = T.int32()
        position_map_elem_offset = T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, fused_heads, head_dim), dtype)
        q = T.match_buffer(var_q, (seq_len, num_q_heads, head_dim), dtype)
        k = T.match_buffer(var_k, (seq_len, num_kv_heads, head_dim), dtype)
        v = T.match_buffer(var_v, (seq_len, num_kv_heads, head_dim), dtype)
        position_map = T.match_buffer(
            var_position_map, (seq_len,), "int32", elem_offset=position_map_elem_offset
        )
        for s in T.parallel(seq_len):
            with T.sblock("rope"):
                T.reads()
                T.writes()
                cos_buf = T.sblock_alloc_buffer((half,), "float32")
                sin_buf = T.sblock_alloc_buffer((half,), "float32")
                out = T.sblock_alloc_buffer((rot_heads, head_dim), "float32")
                for i in T.serial(half):
                    cos_buf[i] = _cos_sin(
                        rope_scaling, position_map[s], scale, i, rotary_dim, theta
                    )[0]
                    sin_buf[i] = _cos_sin(
                        rope_scaling, position_map[s], scale, i, rotary_dim, theta
                    )[1]
                for h in T.serial(rot_heads):
                    for d in T.vectorized(head_dim):
                        out[h, d] = T.if_then_else(
                            apply_rope > 0 and d < rotary_dim,
                            T.if_then_else(
                                d < half,
                                cos_buf[d % half] * qkv[s, h, d].astype("float32")
                                + sin_buf[d % half]
                                * -qkv[s, h, (d + half) % head_dim].astype("float32"),
                                cos_buf[d % half] * qkv[s, h, d].astype("float32")
                                + sin_buf[d % half]
                                * qkv[s, h, (d + head_dim - half) % head_dim].astype("float32"),
                            ),
                            qkv[s, h, d].astype("float32"),
                        )
                for h in T.serial(num_q_heads):
                    for d in T.vectorized(head_dim):
                        q[s, h, d] = out[h, d].astype(dtype)
                for h in T.serial(num_kv_heads):
                    for d in T.vectorized(head_dim):
                        k[s, h, d] = out[num_q_heads + h, d].astype(dtype)
                        v[s, h, d] = qkv[s, rot_heads + h, d]

    return fused_rope


def _kv_paged(kb, vb, page_values, page_size, begin, which, j, h_kv, d):
    """Row j of a sequence's K (which=0) or V (1) in the paged cache (kb is vb: the pages)."""
    return kb[page_values[begin + j // page_size], which, h_kv, j % page_size, d]


def _kv_ragged(kb, vb, page_values, page_size, begin, which, j, h_kv, d):
    """Row j of a sequence's K or V in the contiguous [tokens, heads, D] buffers of a chunk."""
    return T.if_then_else(which == 0, kb[begin + j, h_kv, d], vb[begin + j, h_kv, d])


# 2^f on [0, 1): Taylor coefficients of e^(f ln 2) to degree 7 (relative error < 2e-7, about
# 3 float32 ulps), evaluated by Horner's rule.
_EXP2_COEFFS = [math.log(2) ** k / math.factorial(k) for k in range(8)]


def _exp2_nonpositive(x):
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


def _attend(D: int, kv_at):
    """The shared body: query row `row` of head `h` over `n` K/V rows read by `kv_at`,
    softmax in log2 units with a running max, chunks of CHUNK rows; writes the output row and
    its log2-sum-exp as TVM's kernels do (-5e4 for an empty row)."""
    lanes = LANES  # partial sums of a dot product, summed at the end

    @T.macro
    def attend(q, sm_scale, kb, vb, page_values, page_size, begin, n, h_kv, output, lse, row, h):
        qv = T.sblock_alloc_buffer((D,), "float32")
        acc = T.sblock_alloc_buffer((D,), "float32")
        for d in T.vectorized(D):
            qv[d] = q[row, h, d].astype("float32") * (sm_scale * LOG2E)
        part = T.sblock_alloc_buffer((lanes,), "float32")
        score = T.sblock_alloc_buffer((CHUNK,), "float32")
        # running max, running sum, new max, rescale factor
        state = T.sblock_alloc_buffer((4,), "float32")
        for d in T.vectorized(D):
            acc[d] = T.float32(0)
        state[0] = T.float32(-5e4)
        state[1] = T.float32(0)
        for c in T.serial((n + CHUNK - 1) // CHUNK):
            state[2] = state[0]
            for r in T.serial(T.min(CHUNK, n - c * CHUNK)):
                for j in T.vectorized(lanes):
                    part[j] = T.float32(0)
                for d0 in T.serial(D // lanes):
                    for j in T.vectorized(lanes):
                        part[j] = part[j] + qv[d0 * lanes + j] * kv_at(
                            kb,
                            vb,
                            page_values,
                            page_size,
                            begin,
                            0,
                            c * CHUNK + r,
                            h_kv,
                            d0 * lanes + j,
                        ).astype("float32")
                # Horizontal sum as a tree (a serial sum is a chain of 16 dependent adds).
                for j in T.vectorized(8):
                    part[j] = part[j] + part[j + 8]
                for j in T.vectorized(4):
                    part[j] = part[j] + part[j + 4]
                for j in T.vectorized(2):
                    part[j] = part[j] + part[j + 2]
                score[r] = part[0] + part[1]
                state[2] = T.max(state[2], score[r])
            # Rescale what the earlier chunks summed to the new running max, once per chunk.
            state[3] = T.exp2(state[0] - state[2])
            for d in T.vectorized(D):
                acc[d] = acc[d] * state[3]
            state[1] = state[1] * state[3]
            state[0] = state[2]
            # exp2 of the whole chunk in vector lanes (a libm call per key otherwise); lanes past
            # the chunk's rows hold stale scores, are clamped, and never read.
            for r in T.vectorized(CHUNK):
                score[r] = _exp2_nonpositive(score[r] - state[0])
            for r in T.serial(T.min(CHUNK, n - c * CHUNK)):
                state[1] = state[1] + score[r]
                for d in T.vectorized(D):
                    acc[d] = acc[d] + score[r] * kv_at(
                        kb, vb, page_values, page_size, begin, 1, c * CHUNK + r, h_kv, d
                    ).astype("float32")
        for d in T.vectorized(D):
            output[row, h, d] = T.if_then_else(n > 0, acc[d] / state[1], T.float32(0)).astype(
                output.dtype
            )
        lse[row, h] = T.if_then_else(n > 0, state[0] + T.log2(state[1]), T.float32(-5e4))

    return attend


def _paged_len(indptr, last_page_len, page_size, b):
    """Tokens in sequence b's pages: full pages plus the used part of the last one."""
    return T.if_then_else(
        indptr[b] != indptr[b + 1],
        (indptr[b + 1] - indptr[b] - 1) * page_size + last_page_len[b],
        0,
    )


def _causal_len(causal, kv_n, q_indptr, b, row):
    """Keys query `row` of sequence b sees: all kv_n, or (causal) up to its own position, the
    chunk's rows being the last of the sequence's keys."""
    q_n = q_indptr[b + 1] - q_indptr[b]
    return T.if_then_else(causal > 0, kv_n - q_n + (row - q_indptr[b]) + 1, kv_n)


@T.macro
def _find_sequence(seq, q_indptr, batch_size, row):
    """seq[0] = the sequence whose query rows include `row`."""
    seq[0] = 0
    for i in T.serial(batch_size):
        if q_indptr[i + 1] <= row:
            seq[0] = i + 1


def _balanced(p, count):
    """Task p of `count` -> a row, pairing short causal rows with long ones (0, n-1, 1, ...),
    so the thread pool's contiguous ranges of tasks carry similar work."""
    return T.if_then_else(p % 2 == 0, p // 2, count - 1 - p // 2)


def decode_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str):
    """One query token per sequence over its paged K/V (no sliding window; RoPE already
    applied, so rotary_mode must be 0). (sequence, query head) pairs run in parallel."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    group = num_qo_heads // num_kv_heads
    attend = _attend(D, _kv_paged)

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
        page_size = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (B, H_qo, D), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, page_size, D), dtype)
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
        last_page_len = T.match_buffer(
            var_length_info, (B,), "int32", elem_offset=length_info_elem_offset
        )
        assert rotary_mode == 0, "mlcrun's decode attention expects RoPE already applied"

        for bh in T.parallel(B * H_qo):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                b = bh // H_qo
                h = bh % H_qo
                attend(
                    Q,
                    sm_scale,
                    pages,
                    pages,
                    page_table_values,
                    page_size,
                    page_table_indptr[b],
                    _paged_len(page_table_indptr, last_page_len, page_size, b),
                    h // group,
                    output,
                    lse,
                    b,
                    h,
                )

    return batch_decode_paged_kv


def prefill_ragged_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str):
    """The new tokens of each sequence attend to each other (causal or not) from contiguous
    K/V; (token, query head) pairs run in parallel, short and long causal rows interleaved."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    group = num_qo_heads // num_kv_heads
    attend = _attend(D, _kv_ragged)

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

        for task in T.parallel(qo_len * H_qo):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                seq = T.sblock_alloc_buffer((1,), "int32")
                row = _balanced(task // H_qo, qo_len)
                h = task % H_qo
                _find_sequence(seq, q_indptr, batch_size, row)
                b = seq[0]
                attend(
                    q,
                    sm_scale,
                    k,
                    v,
                    q_indptr,
                    0,
                    kv_indptr[b],
                    _causal_len(causal, kv_indptr[b + 1] - kv_indptr[b], q_indptr, b, row),
                    h // group,
                    output,
                    lse,
                    row,
                    h,
                )

    return batch_prefill_ragged_kv


def prefill_paged_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str):
    """A chunk of new tokens per sequence attends to the sequence's cached (paged) K/V
    (no sliding window; RoPE already applied). (token, query head) pairs run in parallel."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    group = num_qo_heads // num_kv_heads
    attend = _attend(D, _kv_paged)

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
        page_size = T.int32()
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
        pages = T.match_buffer(var_pages, (max_num_pages, 2, H_kv, page_size, D), dtype)
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
        assert rotary_mode == 0, "mlcrun's prefill attention expects RoPE already applied"

        for task in T.parallel(total_len * H_qo):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                seq = T.sblock_alloc_buffer((1,), "int32")
                row = _balanced(task // H_qo, total_len)
                h = task % H_qo
                _find_sequence(seq, q_indptr, batch_size, row)
                b = seq[0]
                attend(
                    q,
                    sm_scale,
                    pages,
                    pages,
                    page_values,
                    page_size,
                    page_indptr[b],
                    _causal_len(
                        causal,
                        _paged_len(page_indptr, last_page_len, page_size, b),
                        q_indptr,
                        b,
                        row,
                    ),
                    h // group,
                    output,
                    lse,
                    row,
                    h,
                )

    return batch_prefill_paged_kv_cpu


def replace_kv_kernels(mod: tvm.IRModule, cfg) -> tvm.IRModule:
    """Swap our kernels in for TVM's, by the names TIRPagedKVCache gives them (llvm only)."""
    kernels = {
        ROPE_NAME: split_rotary(
            cfg.rope_theta,
            1.0,  # models/common.py creates the cache with rope_scale=1
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            "float32",
            cfg.rope_scaling or {},
            cfg.head_dim,
        ),
        DECODE_NAME: decode_attention(
            cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim, "float32"
        ),
        PREFILL_RAGGED_NAME: prefill_ragged_attention(
            cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim, "float32"
        ),
        PREFILL_PAGED_NAME: prefill_paged_attention(
            cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim, "float32"
        ),
    }
    if cfg.sliding_window or cfg.head_dim % LANES:
        # A window makes the cache apply RoPE inside attention (TVM's "inline" mode,
        # rotary_mode 1), which ours do not do; odd head dims do not split into 16 lanes.
        # Keep TVM's attention kernels for such models.
        for name in (DECODE_NAME, PREFILL_RAGGED_NAME, PREFILL_PAGED_NAME):
            del kernels[name]
    found = {gv.name_hint: gv for gv in mod.get_global_vars()}
    missing = [name for name in kernels if name not in found]
    if missing:  # a TVM upgrade renamed them: fail loudly rather than run the slow ones
        raise RuntimeError(f"KV-cache kernel {missing[0]!r} not found in the exported module")
    for name, func in kernels.items():
        mod[found[name]] = func.with_attr("global_symbol", name)
    return mod
