"""What a compile is asked to produce."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MlcrunError
from ..quant import ACTIVATIONS, PRESETS, get_preset, uses_bf16, uses_int8

# "auto": the preset that holds the checkpoint's stored weights exactly (compiler/params.py)
QUANTIZATIONS = ("auto", *PRESETS)
DEVICES = ("cpu", "cuda")
# How quantized matmuls treat activations (quant/presets.py): "auto" is int8 for q4/q8 where
# the target has an int8 dot product (VNNI, or AVX2's vpmaddubsw), bf16 for q0bf16 where it has
# AVX512-BF16, exact (float32) elsewhere and on CUDA.
ACTIVATION_CHOICES = ("auto", *ACTIVATIONS)
# The paged KV cache's dtype: float16 halves its memory and what decode attention reads
# (attention computes in float32 either way; compiler/kv_attention.py).
KV_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class CompileOptions:
    quantization: str = "auto"
    device: str = "cpu"
    context_window: int | None = None  # None: the model's max_position_embeddings, capped
    prefill_chunk: int = 512
    max_batch: int = 16
    page_size: int = 16
    activations: str = "auto"
    kv_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.quantization != "auto":
            try:
                get_preset(self.quantization)  # a preset, or a mixed A+B
            except MlcrunError:
                raise MlcrunError(
                    f"--quantization {self.quantization!r} is not available; choose from: "
                    f"{', '.join(QUANTIZATIONS)} (or A+B: layers in A, embedding/lm_head in B)"
                ) from None
        if self.device not in DEVICES:
            raise MlcrunError(f"--device {self.device!r} is not supported; choose cpu or cuda")
        if self.activations not in ACTIVATION_CHOICES:
            raise MlcrunError(
                f"--activations {self.activations!r} is not available; choose from: "
                f"{', '.join(ACTIVATION_CHOICES)}"
            )
        if self.activations == "int8" and self.device != "cpu":
            raise MlcrunError("--activations int8 is for --device cpu; use exact or auto")
        if self.activations == "bf16" and self.device != "cpu":
            raise MlcrunError(
                "--activations bf16 is for --device cpu (AVX512-BF16); use exact or auto"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise MlcrunError(
                f"--kv-dtype {self.kv_dtype!r} is not available; choose from: "
                f"{', '.join(KV_DTYPES)}"
            )
        for name in ("prefill_chunk", "max_batch", "page_size"):
            if getattr(self, name) <= 0:
                raise MlcrunError(f"--{name.replace('_', '-')} must be positive")
        if self.prefill_chunk < self.max_batch:
            raise MlcrunError(
                f"--prefill-chunk {self.prefill_chunk} is under --max-batch {self.max_batch}: "
                "a decode step of every sequence is one forward, which holds at most a "
                "prefill chunk of tokens"
            )
        if self.context_window is not None and self.context_window <= 0:
            raise MlcrunError("--context-window must be positive")
        if self.page_size not in (8, 16, 32, 64):
            raise MlcrunError("--page-size must be one of 8, 16, 32, 64")
        if self.device == "cpu" and self.page_size != 16:
            # TVM 0.27's CPU KV-cache kernels (transpose_append, ...) are built for 16.
            raise MlcrunError("--page-size must be 16 for --device cpu")


DEFAULT_CONTEXT_CAP = 8192


def resolve_activations(requested: str, target, quantization: str) -> str:
    """What the artifact records and its quantized layers run: `auto` -> "int8" when the
    preset has q4/q8 layers and `target` (a tvm Target) an int8 dot product (AVX2 or VNNI),
    else "bf16" when it has q0bf16 layers and the target AVX512-BF16, else "exact". "int8" /
    "bf16" on a target without the instructions is refused (the kernels would run the slow
    reference code); on a preset without such layers (q0f32, q0f16, q0bf16 for int8, q4/q8
    for bf16) either resolves to "exact": nothing in it would change."""
    from .target import bf16_dot_bits, int8_dot  # noqa: PLC0415 - imports TVM

    preset = get_preset(quantization)
    has_int8 = uses_int8(preset, "int8") or uses_int8(preset.for_embedding, "int8")
    has_bf16 = uses_bf16(preset, "bf16") or uses_bf16(preset.for_embedding, "bf16")
    if requested == "auto":
        if has_int8 and int8_dot(target):
            return "int8"
        return "bf16" if has_bf16 and bf16_dot_bits(target) else "exact"
    if requested == "int8" and has_int8 and not int8_dot(target):
        raise MlcrunError(
            "--activations int8 needs a CPU with AVX2 (or VNNI); this target has neither "
            "(use --activations exact)"
        )
    if requested == "bf16" and has_bf16 and not bf16_dot_bits(target):
        raise MlcrunError(
            "--activations bf16 needs a CPU with AVX512-BF16 (use --activations exact)"
        )
    if (requested == "int8" and not has_int8) or (requested == "bf16" and not has_bf16):
        return "exact"
    return requested
