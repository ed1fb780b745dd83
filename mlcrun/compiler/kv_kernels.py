"""CPU replacements for the paged KV cache's hot TIR kernels (same signatures, same math).

TVM's `TIRPagedKVCache` ships scalar, single-threaded CPU kernels; in a decode step they took
a fifth (16 cached tokens) to two thirds (512) of the time, and most of a long prefill
(`mlcrun bench --mode kernel --profile`). Ours are swapped in by name for `llvm` targets
(`replace_kv_kernels`, called by compiler/export.py): the exported module keeps TVM's
functions under their names and our PrimFuncs take their place, so the cache's C++ calls ours.

* `fused_rope` (q/k/v split + RoPE), here: TVM computed cos/sin (and a pow) per *element*,
  i.e. once per head for the same angle. Ours computes each (token, frequency) pair's cos/sin
  once with TVM's own frequency functions (every rope_scaling variant we accept) and applies
  it to all q and k heads; tokens run in parallel (one token on the calling thread: a
  thread-pool launch costs more). Same expressions, same rounding.
* Attention (compiler/kv_attention.py): decode (`batch_decode_paged_kv_cpu`), prefill over the
  chunk itself and over cached pages (`batch_prefill_ragged_kv`, `batch_prefill_paged_kv_cpu`),
  token-tree verification (`batch_tree_attn`, `tree_attn_paged_kv_cpu`) and the merge of two
  partial results (`merge_state_inplace_cpu`): parallel, vectorized, float32 math over float32
  or float16 pages.

The cache's dtype (`kv_dtype`, a compile option) is the dtype of its pages and of the q/k/v and
output rows it exchanges with the model (TVM checks that they match); all our kernels load it
and compute in float32.

Gemma 3's sliding_attention layers get ours too: the cache calls separate `_sliding_window`
decode and paged-prefill kernels for them (a [3, B] length_info with each sequence's window
offset, and a causal chunk's rows masked to their window), and TVM's scalar ones start a
row's running max uninitialized when its first key is masked (NaN logits over float16 pages).
Models with a Mistral-style sliding window keep TVM's attention kernels: their cache applies
RoPE inside attention ("inline" mode, rotary_mode 1), which ours refuse (a runtime assert),
not emulate. Head dims that are not a multiple of 16 keep them too. Parity with transformers:
tests/compiled/test_parity.py; each kernel against numpy: tests/compiled/test_kv_kernels.py.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.relax.frontend.nn.llm.position_embedding import switch_rope_freq_func
from tvm.script import tirx as T

from . import kv_attention

ROPE_NAME = "fused_rope"  # TIRPagedKVCache's split_rotary kernel
DECODE_NAME = "batch_decode_paged_kv_cpu"
PREFILL_RAGGED_NAME = "batch_prefill_ragged_kv"
PREFILL_PAGED_NAME = "batch_prefill_paged_kv_cpu"
TREE_RAGGED_NAME = "batch_tree_attn"  # workarounds.RAGGED_TREE
TREE_PAGED_NAME = "tree_attn_paged_kv_cpu"  # workarounds.PAGED_TREE
MERGE_NAME = "merge_state_inplace_cpu"
WINDOW_SUFFIX = "_sliding_window"  # the kernels of sliding_attention layers (Gemma 3)
WINDOWED = {
    DECODE_NAME + WINDOW_SUFFIX: kv_attention.decode_attention,
    PREFILL_PAGED_NAME + WINDOW_SUFFIX: kv_attention.prefill_paged_attention,
}
ATTENTION = {
    DECODE_NAME: kv_attention.decode_attention,
    PREFILL_RAGGED_NAME: kv_attention.prefill_ragged_attention,
    PREFILL_PAGED_NAME: kv_attention.prefill_paged_attention,
    TREE_RAGGED_NAME: kv_attention.tree_ragged_attention,
    TREE_PAGED_NAME: kv_attention.tree_paged_attention,
}
KV_DTYPES = ("float32", "float16")
PARALLEL_TOKENS = 2  # fused_rope runs tokens in parallel from this many on


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

    @T.macro
    def token(qkv, position_map, q, k, v, apply_rope, s):
        """RoPE of token s: cos and sin of its angles once, applied to every q and k head."""
        with T.sblock("rope"):
            T.reads()
            T.writes()
            cos_buf = T.sblock_alloc_buffer((half,), "float32")
            sin_buf = T.sblock_alloc_buffer((half,), "float32")
            out = T.sblock_alloc_buffer((rot_heads, head_dim), "float32")
            for i in T.serial(half):
                cos_buf[i] = _cos_sin(rope_scaling, position_map[s], scale, i, rotary_dim, theta)[0]
                sin_buf[i] = _cos_sin(rope_scaling, position_map[s], scale, i, rotary_dim, theta)[1]
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
        # One token (a decode step at batch 1) on the calling thread: a thread-pool launch
        # costs more than its work (schedules/small.py). From 2 tokens on, their cos/sin
        # (a few microseconds a token) pay for it.
        if seq_len >= PARALLEL_TOKENS:
            for s in T.parallel(seq_len):
                token(qkv, position_map, q, k, v, apply_rope, s)
        else:
            for s in T.serial(seq_len):
                token(qkv, position_map, q, k, v, apply_rope, s)

    return fused_rope


def replace_kv_kernels(
    mod: tvm.IRModule, cfg, kv_dtype: str = "float32", vector_bits: int = 512
) -> tvm.IRModule:
    """Swap our kernels in for TVM's, by the names TIRPagedKVCache gives them (llvm only).
    `kv_dtype` must be the dtype the cache was created with (models/common.py); `vector_bits`
    is the target's vector width (the row tiles' keys per pass, kv_attention.TILE_KEY_BLOCKS,
    and from how many rows a few tokens' paged attention takes them, TILE_WORTH_BY_BITS)."""
    tiles = {"key_block": kv_attention.tile_key_block(vector_bits)}
    paged = {**tiles, "tile_worth": kv_attention.tile_worth(vector_bits)}
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unsupported KV-cache dtype {kv_dtype!r}")
    kernels = {
        ROPE_NAME: split_rotary(
            cfg.rope_theta,
            1.0,  # models/common.py creates the cache with rope_scale=1
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            kv_dtype,
            cfg.rope_scaling or {},
            cfg.head_dim,
        ),
        MERGE_NAME: kv_attention.merge_state(cfg.num_attention_heads, cfg.head_dim, kv_dtype),
    }
    if not cfg.sliding_window and kv_attention.supported(cfg.head_dim):
        # A window makes the cache apply RoPE inside attention (TVM's "inline" mode,
        # rotary_mode 1), which ours do not do; odd head dims do not split into 16 lanes.
        # Such models keep TVM's attention kernels.
        for name, factory in ATTENTION.items():
            kernels[name] = factory(
                cfg.num_key_value_heads,
                cfg.num_attention_heads,
                cfg.head_dim,
                kv_dtype,
                **{DECODE_NAME: {}, PREFILL_PAGED_NAME: paged}.get(name, tiles),
            )
        if cfg.local_window:  # the window models/common.py gives the cache
            for name, factory in WINDOWED.items():
                kernels[name] = factory(
                    cfg.num_key_value_heads,
                    cfg.num_attention_heads,
                    cfg.head_dim,
                    kv_dtype,
                    window=cfg.local_window,
                    **(paged if name != DECODE_NAME + WINDOW_SUFFIX else {}),
                )
    found = {gv.name_hint: gv for gv in mod.get_global_vars()}
    missing = [name for name in kernels if name not in found]
    if missing:  # a TVM upgrade renamed them: fail loudly rather than run the slow ones
        raise RuntimeError(f"KV-cache kernel {missing[0]!r} not found in the exported module")
    for name, func in kernels.items():
        mod[found[name]] = func.with_attr("global_symbol", name)
    return mod
