"""The decoder-only transformer config shared by every supported architecture family.

Each family file turns its Hugging Face `config.json` dict into this one frozen dataclass; the
module in `common.py` is built from it alone. No I/O happens here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import MlcrunError

_ROPE_KINDS = ("default", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    source_dtype: str = "float32"
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each q and k head before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral-style window over the last N keys
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3 (each off for the other families)
    hidden_activation: str = "silu"  # the MLP gate's: "silu" or "gelu_tanh"
    sandwich_norms: bool = False  # RMSNorm after attention and after the MLP too
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): 1 for Gemma's (1 + w)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 (else head_dim's)
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
    local_window: int | None = None  # keys a sliding_attention layer sees, the query included
    local_rope_theta: float | None = None  # RoPE base of the sliding_attention layers

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise MlcrunError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise MlcrunError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise MlcrunError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", "default")
            if kind not in _ROPE_KINDS and not (self.layer_types and kind == "linear"):
                raise MlcrunError(
                    f"config.json: rope_scaling type {kind!r} is not supported "
                    f"(supported: {', '.join(_ROPE_KINDS)})"
                )
        if self.hidden_activation not in ("silu", "gelu_tanh"):
            raise MlcrunError(
                f"config.json: hidden activation {self.hidden_activation!r} is not supported "
                "(supported: silu, gelu_pytorch_tanh)"
            )
        if self.layer_types:
            kinds = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if kinds or len(self.layer_types) != self.num_hidden_layers:
                raise MlcrunError(
                    "config.json: layer_types must give full_attention or sliding_attention "
                    f"for each of the {self.num_hidden_layers} layers"
                )
            if "sliding_attention" in self.layer_types and not (self.local_window or 0) > 0:
                raise MlcrunError("config.json: sliding_attention layers need a sliding_window")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise MlcrunError(
                f"config.json: sliding_window must be positive, got {self.sliding_window}"
            )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["eos_token_ids"] = list(self.eos_token_ids)
        data["layer_types"] = list(self.layer_types)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["eos_token_ids"] = tuple(kwargs.get("eos_token_ids", ()))
        kwargs["layer_types"] = tuple(kwargs.get("layer_types", ()))
        return cls(**kwargs)

    @property
    def rope_in_graph(self) -> bool:
        """RoPE applied by the model (one base per layer kind), not by the KV cache."""
        return bool(self.layer_types)


def require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise MlcrunError(f"config.json: missing required key {key!r}")
    return hf[key]


def rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Read RoPE theta and scaling from old (`rope_theta`, `rope_scaling`) or new
    (`rope_parameters`) config keys. Returns (theta, scaling or None for plain RoPE)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = dict(params)
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = dict(hf["rope_scaling"]) if hf.get("rope_scaling") else {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    scaling.pop("rope_theta", None)
    scaling.pop("type", None)
    scaling["rope_type"] = kind
    return float(theta), scaling


def source_dtype(hf: dict[str, Any]) -> str:
    dtype = hf.get("dtype", hf.get("torch_dtype")) or "float32"
    return str(dtype).replace("torch.", "")


def token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def base_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """The keys every Llama-like family spells the same way."""
    heads = int(require(hf, "num_attention_heads"))
    hidden = int(require(hf, "hidden_size"))
    theta, scaling = rope_settings(hf)
    head_dim = hf.get("head_dim") or hidden // heads
    return dict(
        arch=hf["architectures"][0],
        vocab_size=int(require(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(require(hf, "intermediate_size")),
        num_hidden_layers=int(require(hf, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        source_dtype=source_dtype(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=token_ids(hf.get("eos_token_id")),
    )
