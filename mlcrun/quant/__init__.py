"""Quantization presets: a module rewrite plus a weight transform keyed by the same param names.

Never imports mlcrun.models: the rewrite works on any tvm `nn.Module` made of nn.Linear and
nn.Embedding layers (DESIGN 3.5).
"""

from .presets import (
    ACTIVATIONS,
    GROUP_SIZE,
    PRESETS,
    QuantPreset,
    get_preset,
    uses_bf16,
    uses_int8,
)

__all__ = [
    "ACTIVATIONS",
    "GROUP_SIZE",
    "PRESETS",
    "QuantPreset",
    "get_preset",
    "uses_bf16",
    "uses_int8",
]
