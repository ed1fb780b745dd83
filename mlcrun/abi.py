"""The one place that names the functions a compiled library exports (its ABI).

Both the compiler (export) and the runtime (look-up) use these names. Bump ABI_VERSION on any
change of a name, signature or calling convention; the runtime refuses other versions.
"""

ABI_VERSION = 1

EMBED = "embed"  # (input_ids[n] int32, params) -> [n, hidden]
BATCH_PREFILL = "batch_prefill"  # ([1, n, hidden], logit_pos[b] int32, kv, params) -> [1, b, vocab]
BATCH_DECODE = "batch_decode"  # ([b, 1, hidden], kv, params) -> [b, 1, vocab]
BATCH_VERIFY = "batch_verify"  # ([1, n, hidden], kv, params) -> [1, n, vocab]
CREATE_KV_CACHE = "create_paged_kv_cache"  # (max_batch, max_total_len, chunk, page, sliding)
METADATA = "_metadata"  # () -> JSON string describing the library

MODEL_FUNCTIONS = (EMBED, BATCH_PREFILL, BATCH_DECODE, BATCH_VERIFY, CREATE_KV_CACHE, METADATA)

# BATCH_VERIFY takes at most this many tree nodes per sequence (TVM 0.27's paged KV cache:
# kTreeAttnMaxTreeSize).
MAX_TREE_NODES = 256

# TVM runtime builtins that operate on the KV cache object.
KV_ADD_SEQUENCE = "vm.builtin.kv_state_add_sequence"
KV_REMOVE_SEQUENCE = "vm.builtin.kv_state_remove_sequence"
KV_FORK_SEQUENCE = "vm.builtin.kv_state_fork_sequence"
KV_POPN = "vm.builtin.kv_state_popn"
KV_BEGIN_FORWARD = "vm.builtin.kv_state_begin_forward"
KV_END_FORWARD = "vm.builtin.kv_state_end_forward"
KV_CLEAR = "vm.builtin.kv_state_clear"
KV_COMMIT_TREE = "vm.builtin.attention_kv_cache_commit_accepted_token_tree_nodes"
KV_AVAILABLE_PAGES = "vm.builtin.attention_kv_cache_get_num_available_pages"
KV_TOTAL_LENGTH = "vm.builtin.attention_kv_cache_get_total_sequence_length"
KV_SEQUENCE_LENGTH = "vm.builtin.attention_kv_cache_get_sequence_length"
KV_ENABLE_SLIDING_WINDOW = "vm.builtin.attention_kv_cache_enable_sliding_window_for_seq"


def local_chunk(window: int | None) -> int | None:
    """The most tokens of one sequence a forward may append when the model has sliding
    (local) layers: TVM's cache windows the cached keys of such a layer but not the chunk's
    own (plain causal attention), and a chunk as long as the window leaves the windowed part
    empty (NaN): window - 1 tokens keep every row exact (tests/compiled/test_gemma3.py)."""
    return max(window - 1, 1) if window else None
