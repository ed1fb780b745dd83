"""The explicit registry of supported architectures, keyed by HF `architectures[0]`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import MlcrunError
from ..weights.mapping import WeightMap
from . import gemma3, llama, mistral, qwen2, qwen3
from .config import ModelConfig
from .weight_map import decoder_weight_map


@dataclass(frozen=True)
class ArchSpec:
    name: str
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    weight_map: Callable[[ModelConfig], WeightMap]


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("Gemma3ForCausalLM", gemma3.config_from_hf, decoder_weight_map),
        ArchSpec("LlamaForCausalLM", llama.config_from_hf, decoder_weight_map),
        ArchSpec("MistralForCausalLM", mistral.config_from_hf, decoder_weight_map),
        ArchSpec("Qwen2ForCausalLM", qwen2.config_from_hf, decoder_weight_map),
        ArchSpec("Qwen3ForCausalLM", qwen3.config_from_hf, decoder_weight_map),
    )
}


def lookup(hf_config: dict[str, Any]) -> ArchSpec:
    archs = hf_config.get("architectures") or []
    if not archs:
        raise MlcrunError("config.json has no 'architectures' entry; cannot tell the model type")
    if archs[0] not in ARCHITECTURES:
        raise MlcrunError(
            f"unsupported architecture {archs[0]!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[archs[0]]


def model_config(hf_config: dict[str, Any]) -> ModelConfig:
    try:
        return lookup(hf_config).config_from_hf(hf_config)
    except (TypeError, ValueError, KeyError) as err:
        raise MlcrunError(f"config.json: invalid value ({err})") from None
