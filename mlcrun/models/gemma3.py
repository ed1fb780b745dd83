"""Gemma 3 (text): Llama's decoder with (1 + w) RMSNorms before and after attention and the
MLP, RMSNorm on q and k heads, a tanh-GELU gate, embeddings scaled by sqrt(hidden), scores
scaled by query_pre_attn_scalar, and sliding-window (local) layers between full ones, each kind
with its own RoPE base. Tied embeddings."""

from __future__ import annotations

import math
from typing import Any

from ..errors import MlcrunError
from .config import ModelConfig, base_kwargs, require

GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig defaults
PATTERN = 6  # the legacy sliding_window_pattern: every sixth layer is full


def _rope(hf: dict[str, Any]) -> tuple[float, float, dict[str, Any] | None]:
    """(global theta, local theta, the full layers' scaling or None), from the new per-kind
    `rope_parameters` or the old `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if not params and hf.get("rope_scaling"):
        full.update(hf["rope_scaling"])
    theta = float(full.pop("rope_theta", hf.get("rope_theta", GLOBAL_THETA)))
    local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", LOCAL_THETA)))
    if local.get("rope_type", "default") != "default":
        raise MlcrunError("config.json: RoPE scaling of Gemma 3's sliding layers is not supported")
    kind = full.pop("rope_type", full.pop("type", "default"))
    if kind == "default":
        return theta, local_theta, None
    if kind != "linear":
        raise MlcrunError(f"config.json: Gemma 3 RoPE scaling {kind!r} is not supported")
    return theta, local_theta, {"rope_type": "linear", "factor": float(full["factor"])}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf = hf.get("text_config") or hf
    if hf.get("final_logit_softcapping") or hf.get("use_bidirectional_attention"):
        raise MlcrunError(
            "config.json: Gemma logit softcapping and bidirectional attention are not supported"
        )
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise MlcrunError(f"config.json: Gemma 3 activation {act!r} is not supported")
    layers = int(require(hf, "num_hidden_layers"))
    types = hf.get("layer_types") or [
        "sliding_attention"
        if (i + 1) % int(hf.get("sliding_window_pattern", PATTERN))
        else "full_attention"
        for i in range(layers)
    ]
    theta, local_theta, scaling = _rope(hf)
    kwargs = base_kwargs({**hf, "rope_theta": theta, "rope_scaling": None, "rope_parameters": None})
    kwargs["rope_scaling"] = scaling
    kwargs["arch"] = "Gemma3ForCausalLM"
    kwargs["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    window = hf.get("sliding_window")
    return ModelConfig(
        **kwargs,
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        hidden_activation="gelu_tanh",
        sandwich_norms=True,
        norm_offset=1.0,
        embed_scale=float(math.sqrt(kwargs["hidden_size"])),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or kwargs["head_dim"]),
        layer_types=tuple(types),
        local_window=int(window) if window else None,
        local_rope_theta=local_theta,
    )
