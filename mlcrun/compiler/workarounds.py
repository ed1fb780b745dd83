"""Fixes for known apache-tvm 0.27 bugs, each in one clearly marked place.

TVM-0.27-TREE-ATTN-SWAP: for `llvm` targets, `TIRPagedKVCache` passes the ragged tree-attention
kernel (`batch_tree_attn`) in the slot the runtime uses for the paged one
(`tree_attn_paged_kv_cpu`) and vice versa, so the first tree verify fails with "Expected 16
arguments ... tree_attn_paged_kv_cpu". The GPU branch passes them paged-first, which is what the
runtime expects. We swap them back in the exported IRModule. `tests/compiled/test_workarounds.py`
fails when upstream fixes the order, so this file can then be deleted.
"""

from __future__ import annotations

import tvm
from tvm import relax

_KV_CREATE = "vm.builtin.paged_attention_kv_cache_create"
RAGGED_TREE = "batch_tree_attn"
PAGED_TREE = "tree_attn_paged_kv_cpu"


def _kernel_name(arg: relax.Expr) -> str | None:
    """The GlobalVar name inside a ("tirx", kernel) tuple argument, if that is what `arg` is."""
    if isinstance(arg, relax.Tuple) and len(arg.fields) == 2:
        kernel = arg.fields[1]
        if isinstance(kernel, tvm.ir.GlobalVar):
            return kernel.name_hint
    return None


def tree_attn_slots(call: relax.Call) -> tuple[int, int] | None:
    """Positions of (ragged, paged) tree-attention kernels in a kv-cache create call."""
    names = [_kernel_name(a) for a in call.args]
    if RAGGED_TREE in names and PAGED_TREE in names:
        return names.index(RAGGED_TREE), names.index(PAGED_TREE)
    return None


def _is_kv_create(call: relax.Call) -> bool:
    return (
        bool(call.args)
        and isinstance(call.args[0], relax.ExternFunc)
        and call.args[0].global_symbol == _KV_CREATE
    )


@relax.expr_functor.mutator
class _SwapTreeAttn(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = super().visit_call_(call)
        if not _is_kv_create(call):
            return call
        slots = tree_attn_slots(call)
        if slots is None or slots[0] > slots[1]:
            return call  # absent, or already in the runtime's order (paged first)
        ragged, paged = slots
        args = list(call.args)
        args[ragged], args[paged] = args[paged], args[ragged]
        return relax.Call(call.op, args, call.attrs, call.ty_args)


def fix_tree_attn_order(mod: tvm.IRModule) -> tvm.IRModule:
    """Apply TVM-0.27-TREE-ATTN-SWAP to every relax function of `mod`."""
    mutator = _SwapTreeAttn(mod)
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()
