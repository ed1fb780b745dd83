"""Qwen3: RMSNorm on every q and k head before RoPE, explicit head_dim, optional qkv bias."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, base_kwargs


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return ModelConfig(
        **base_kwargs(hf),
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        sliding_window=int(window) if window else None,
    )
