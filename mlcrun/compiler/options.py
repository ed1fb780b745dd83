"""What a compile is asked to produce."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MlcrunError
from ..quant import PRESETS, get_preset

# "auto": the preset that holds the checkpoint's stored weights exactly (compiler/params.py)
QUANTIZATIONS = ("auto", *PRESETS)
DEVICES = ("cpu", "cuda")
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
        if self.kv_dtype not in KV_DTYPES:
            raise MlcrunError(
                f"--kv-dtype {self.kv_dtype!r} is not available; choose from: "
                f"{', '.join(KV_DTYPES)}"
            )
        for name in ("prefill_chunk", "max_batch", "page_size"):
            if getattr(self, name) <= 0:
                raise MlcrunError(f"--{name.replace('_', '-')} must be positive")
        if self.context_window is not None and self.context_window <= 0:
            raise MlcrunError("--context-window must be positive")
        if self.page_size not in (8, 16, 32, 64):
            raise MlcrunError("--page-size must be one of 8, 16, 32, 64")
        if self.device == "cpu" and self.page_size != 16:
            # TVM 0.27's CPU KV-cache kernels (transpose_append, ...) are built for 16.
            raise MlcrunError("--page-size must be 16 for --device cpu")


DEFAULT_CONTEXT_CAP = 8192
