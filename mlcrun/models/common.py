"""The decoder-only transformer shared by the Llama-like families, over the paged KV cache.

Attention runs through TVM's `TIRPagedKVCache`: q/k/v are produced by one fused projection,
RoPE is applied inside the cache (RopeMode.NORMAL, HF's rotate-half layout), and the cache owns
paging, forking and tree attention. Everything a family does differently is a flag on
`ModelConfig` (qkv bias, q/k norm, head_dim, sliding window, RoPE scaling).
"""

from __future__ import annotations

import numpy as np
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from .config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_dtype: str = "float32"):
        self.kv_dtype = kv_dtype  # the KV cache's dtype: q/k/v go in and come out in it
        self.num_q = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        qkv_rows = (self.num_q + 2 * self.num_kv) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_rows, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_q * self.head_dim, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(cfg.head_dim, -1, cfg.rms_norm_eps, bias=False)
            self.k_norm = nn.RMSNorm(cfg.head_dim, -1, cfg.rms_norm_eps, bias=False)
        self.sm_scale = float(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5

    def forward(self, x: Tensor, kv: PagedKVCache, layer_id: int, rope=None) -> Tensor:
        """`rope`: (cos, sin) [b, s, 1, head_dim] when the model applies RoPE itself."""
        b, s, _ = x.shape
        # [b, s, num_q + 2 * num_kv, head_dim]
        qkv = op.reshape(self.qkv_proj(x), (b, s, self.num_q + 2 * self.num_kv, self.head_dim))
        if self.qk_norm or rope is not None:
            q, k, v = op.split(qkv, [self.num_q, self.num_q + self.num_kv], axis=2)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = _rotate(q, *rope), _rotate(k, *rope)
            qkv = op.concat([q, k, v], dim=2)
        if qkv.dtype != self.kv_dtype:  # TVM's cache takes and returns rows of its own dtype
            qkv = qkv.astype(self.kv_dtype)
        out = kv.attention_with_fused_qkv(layer_id, qkv, self.num_q, sm_scale=self.sm_scale)
        if out.dtype != x.dtype:
            out = out.astype(x.dtype)
        return self.o_proj(op.reshape(out, (b, s, self.num_q * self.head_dim)))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotate-half RoPE: x * cos + [-x2, x1] * sin."""
    x1, x2 = op.split(x, 2, axis=-1)
    return x * cos + op.concat([op.negative(x2), x1], dim=-1) * sin


def rope_tables(positions: Tensor, theta: float, dim: int, scaling: dict | None, b, s):
    """(cos, sin) [b, s, 1, dim] of each query token's position, as transformers computes
    them: inverse frequencies 1 / theta ** (2i / dim) in float32 (divided by the factor of
    "linear" scaling), times the position, cos/sin of [f, f]."""
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    if scaling and scaling.get("rope_type") == "linear":
        inv = (inv / np.float32(scaling["factor"])).astype(np.float32)
    inv_t = nn.wrap_nested(rx.const(inv.reshape(1, -1)), name="inv_freq")
    freqs = op.reshape(positions.astype("float32"), (b * s, 1)) * inv_t  # [b*s, dim/2]
    emb = op.reshape(op.concat([freqs, freqs], dim=-1), (b, s, 1, dim))
    cos = nn.wrap_nested(rx.op.cos(emb._expr), name="rope_cos")
    sin = nn.wrap_nested(rx.op.sin(emb._expr), name="rope_sin")
    return cos, sin


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_activation == "gelu_tanh"

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        gate = op.gelu(gate, approximate="tanh") if self.gelu else op.silu(gate)
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks; with `sandwich_norms` (Gemma 3) the attention's and the MLP's
    outputs are normed too: x + post_attention_layernorm(attn(input_layernorm(x))), then
    h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))."""

    def __init__(self, cfg: ModelConfig, kv_dtype: str = "float32"):
        def norm():
            return nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)

        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, kv_dtype)
        self.post_attention_layernorm = norm()
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, kv: PagedKVCache, layer_id: int, rope=None) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), kv, layer_id, rope)
        if not self.sandwich:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_dtype: str = "float32"):
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, kv_dtype) for _ in range(cfg.num_hidden_layers)]
        )
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)

    def forward(self, x: Tensor, kv: PagedKVCache) -> Tensor:
        cfg, ropes = self.cfg, {}
        if cfg.rope_in_graph:  # one (cos, sin) table per RoPE base, shared by its layers
            b, s = x.shape[0], x.shape[1]
            positions = kv.get_query_positions(b * s)
            bases = {
                "full_attention": (cfg.rope_theta, cfg.rope_scaling),
                "sliding_attention": (cfg.local_rope_theta or cfg.rope_theta, None),
            }
            for kind in dict.fromkeys(cfg.layer_types):
                theta, scaling = bases[kind]
                ropes[kind] = rope_tables(positions, theta, cfg.head_dim, scaling, b, s)
        for layer_id, layer in enumerate(self.layers):
            rope = ropes[cfg.layer_types[layer_id]] if ropes else None
            x = layer(x, kv, layer_id, rope)
        return self.norm(x)


class DecoderLM(nn.Module):
    """The exported model: its methods are the library's ABI (see compiler/abi.py).
    `kv_dtype` is the paged KV cache's dtype (float32, or float16 to halve its memory)."""

    def __init__(self, cfg: ModelConfig, kv_dtype: str = "float32"):
        self.cfg = cfg
        self.kv_dtype = kv_dtype
        self.model = DecoderModel(cfg, kv_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def _logits(self, hidden: Tensor) -> Tensor:
        if self.cfg.tie_word_embeddings:
            emb = self.model.embed_tokens
            if hasattr(emb, "lm_head_forward"):  # a quantized table (quant/modules.py)
                logits = emb.lm_head_forward(hidden)
            else:
                logits = op.matmul(hidden, op.permute_dims(emb.weight))
        else:
            logits = self.lm_head(hidden)
        return logits.astype("float32") if logits.dtype != "float32" else logits

    def embed(self, input_ids: Tensor) -> Tensor:
        # [num_tokens] -> [num_tokens, hidden]
        emb = self.model.embed_tokens
        if hasattr(emb, "lookup"):  # a quantized table: rows dequantized on the fly
            rows = emb.lookup(input_ids)
        else:
            rows = take(emb.weight, input_ids, axis=0)
        if self.cfg.embed_scale is not None:  # Gemma: sqrt(hidden), rounded to float32
            scale = nn.wrap_nested(rx.const(np.float32(self.cfg.embed_scale)), name="embed_scale")
            rows = rows * scale
        return rows

    def batch_prefill(self, input_embeds: Tensor, logit_positions: Tensor, kv: PagedKVCache):
        # input_embeds [1, total_tokens, hidden]; logit_positions [batch]: one row per sequence
        hidden = self.model(input_embeds, kv)
        hidden = take(hidden, logit_positions, axis=1)  # [1, batch, hidden]
        return self._logits(hidden), kv

    def batch_decode(self, input_embeds: Tensor, kv: PagedKVCache):
        # input_embeds [batch, 1, hidden] -> logits [batch, 1, vocab]
        return self._logits(self.model(input_embeds, kv)), kv

    def batch_verify(self, input_embeds: Tensor, kv: PagedKVCache):
        # input_embeds [1, total_tokens, hidden] -> logits for every token [1, total_tokens, vocab]
        return self._logits(self.model(input_embeds, kv)), kv

    def create_paged_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> PagedKVCache:
        cfg = self.cfg
        extra = {}
        if cfg.layer_types:  # Gemma 3: windowed layers in the cache, RoPE in the model
            kinds = {"full_attention": "mha", "sliding_attention": "mha_sliding"}
            attn_kind = [kinds[t] for t in cfg.layer_types]
            extra["layer_sliding_window_size"] = cfg.local_window or cfg.max_position_embeddings
        else:
            # A sliding window is switched on per sequence at run time
            # (enable_sliding_window_for_seq); see runtime/model.py for its exact semantics.
            attn_kind = "mha"
        return TIRPagedKVCache(
            attn_kind=attn_kind,
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, cfg.num_hidden_layers]),
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            qk_head_dim=cfg.head_dim,
            v_head_dim=cfg.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NONE if cfg.rope_in_graph else RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling or {},
            rope_ext_factors=rx.prim_value(0),
            rotary_dim=cfg.head_dim,
            enable_disaggregation=False,
            dtype=self.kv_dtype,
            target=tvm_target(),
            **extra,
        )

    activation_dtype = "float32"

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        hidden, dtype = self.cfg.hidden_size, self.activation_dtype
        packed = {"param_mode": "packed", "effect_mode": "none"}
        kv = nn.spec.Object(object_type=PagedKVCache)
        spec = {
            "embed": {"input_ids": nn.spec.Tensor(["num_tokens"], "int32"), "$": packed},
            "batch_prefill": {
                "input_embeds": nn.spec.Tensor([1, "num_tokens", hidden], dtype),
                "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                "kv": kv,
                "$": packed,
            },
            "batch_decode": {
                "input_embeds": nn.spec.Tensor(["batch_size", 1, hidden], dtype),
                "kv": kv,
                "$": packed,
            },
            "batch_verify": {
                "input_embeds": nn.spec.Tensor([1, "num_tokens", hidden], dtype),
                "kv": kv,
                "$": packed,
            },
            "create_paged_kv_cache": {
                "max_batch_size": int,
                "max_total_seq_len": int,
                "prefill_chunk_size": int,
                "page_size": int,
                "support_sliding_window": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }
        return nn.spec.ModuleSpec.from_raw(spec, self)


def take(x: Tensor, indices: Tensor, axis: int) -> Tensor:
    """Gather with clipped indices: the runtime validates ids, and TVM's default "fast" mode
    prints a warning at every compile."""
    return nn.wrap_nested(rx.op.take(x._expr, indices._expr, axis=axis, mode="clip"), name="take")


def tvm_target():
    import tvm

    return tvm.target.Target.current()
