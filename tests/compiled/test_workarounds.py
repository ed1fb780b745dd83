"""TVM-0.27-TREE-ATTN-SWAP (see mlcrun/compiler/workarounds.py)."""

import tvm

from mlcrun.compiler import workarounds
from mlcrun.compiler.export import export_model
from mlcrun.models.common import DecoderLM
from mlcrun.models.config import ModelConfig

CFG = ModelConfig(
    arch="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def _kv_create_call(mod):
    found = []

    @tvm.relax.expr_functor.visitor
    class Finder(tvm.relax.PyExprVisitor):
        def visit_call_(self, call):
            if workarounds._is_kv_create(call):
                found.append(call)
            super().visit_call_(call)

    Finder().visit_expr(mod["create_paged_kv_cache"])
    assert len(found) == 1
    return found[0]


def test_upstream_still_passes_tree_kernels_swapped():
    """Fails once apache-tvm fixes the order: then delete the workaround."""
    target = tvm.target.Target({"kind": "llvm"})
    with target:
        model = DecoderLM(CFG)
        mod, _ = model.export_tvm(spec=model.get_default_spec())
    ragged, paged = workarounds.tree_attn_slots(_kv_create_call(mod))
    assert ragged < paged, "upstream fixed the tree-attention order; remove the workaround"


def test_export_puts_paged_tree_kernel_first():
    mod, _ = export_model(CFG, tvm.target.Target({"kind": "llvm"}))
    ragged, paged = workarounds.tree_attn_slots(_kv_create_call(mod))
    assert paged < ragged
