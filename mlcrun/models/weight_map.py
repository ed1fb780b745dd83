"""HF tensor names -> our params for the shared decoder (common.py)."""

from __future__ import annotations

import numpy as np

from ..weights.mapping import ParamRule, WeightMap, concat_rows, identity
from .config import ModelConfig


def plus_one(w: np.ndarray) -> np.ndarray:
    """Gemma's RMSNorm scales by (1 + w), computed in float32: folded into the weight."""
    return np.asarray(w, dtype=np.float32) + np.float32(1.0)


def decoder_weight_map(cfg: ModelConfig) -> WeightMap:
    h, hd = cfg.hidden_size, cfg.head_dim
    if cfg.norm_offset not in (0.0, 1.0):
        raise ValueError(f"norm_offset {cfg.norm_offset} is not 0 or 1")
    norm = plus_one if cfg.norm_offset else identity

    def norm_rule(ours: str, source: str, size: int) -> ParamRule:
        return ParamRule(ours, (source,), ((size,),), norm)

    q_rows, kv_rows = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    rules = [
        ParamRule(
            "model.embed_tokens.weight", ("model.embed_tokens.weight",), ((cfg.vocab_size, h),)
        )
    ]
    for i in range(cfg.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"model.layers.{i}."
        attn = hf + "self_attn."
        rules += [
            norm_rule(ours + "input_layernorm.weight", hf + "input_layernorm.weight", h),
            ParamRule(
                ours + "self_attn.qkv_proj.weight",
                (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                ((q_rows, h), (kv_rows, h), (kv_rows, h)),
                concat_rows,
            ),
            ParamRule(ours + "self_attn.o_proj.weight", (attn + "o_proj.weight",), ((h, q_rows),)),
            norm_rule(
                ours + "post_attention_layernorm.weight", hf + "post_attention_layernorm.weight", h
            ),
            ParamRule(
                ours + "mlp.gate_up_proj.weight",
                (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                ((cfg.intermediate_size, h), (cfg.intermediate_size, h)),
                concat_rows,
            ),
            ParamRule(
                ours + "mlp.down_proj.weight",
                (hf + "mlp.down_proj.weight",),
                ((h, cfg.intermediate_size),),
            ),
        ]
        if cfg.attention_bias:
            rules.append(
                ParamRule(
                    ours + "self_attn.qkv_proj.bias",
                    (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                    ((q_rows,), (kv_rows,), (kv_rows,)),
                    concat_rows,
                )
            )
        if cfg.qk_norm:
            rules += [
                norm_rule(ours + "self_attn.q_norm.weight", attn + "q_norm.weight", hd),
                norm_rule(ours + "self_attn.k_norm.weight", attn + "k_norm.weight", hd),
            ]
        if cfg.sandwich_norms:
            rules += [
                norm_rule(ours + f"{n}.weight", hf + f"{n}.weight", h)
                for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
            ]
    rules.append(norm_rule("model.norm.weight", "model.norm.weight", h))
    unused = ["*.rotary_emb.inv_freq"]
    if cfg.tie_word_embeddings:
        unused.append("lm_head.weight")  # some tied checkpoints still store a copy
    else:
        rules.append(ParamRule("lm_head.weight", ("lm_head.weight",), ((cfg.vocab_size, h),)))
    return WeightMap(tuple(rules), tuple(unused))
