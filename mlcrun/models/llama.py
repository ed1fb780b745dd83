"""Llama 2 / Llama 3 (incl. `llama3` RoPE scaling): the plain decoder."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, base_kwargs


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    kwargs = base_kwargs(hf)
    kwargs["attention_bias"] = bool(hf.get("attention_bias", False))
    return ModelConfig(**kwargs)
