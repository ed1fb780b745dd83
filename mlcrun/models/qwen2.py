"""Qwen2 / Qwen2.5: bias on the q/k/v projections; a window only if `use_sliding_window`."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, base_kwargs


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return ModelConfig(
        **base_kwargs(hf), attention_bias=True, sliding_window=int(window) if window else None
    )
