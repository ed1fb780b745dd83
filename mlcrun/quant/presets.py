"""Quantization presets: what `--quantization NAME` means for weight storage.

A preset is data only; quant/modules.py (the module rewrite) and quant/transform.py (the
weight transform) read it, keyed by the same param names (DESIGN 3.5). Every preset computes
in float32: weights are dequantized on the fly inside the matmul kernels (see
compiler/schedules/matmul.py).

Formats (K: a Linear's input features / the embedding dim, groups of 32 along K):

* q0f32: float32 weights, unchanged.
* q0f16: float16 storage of every 2-D weight; norms and biases stay float32.
* q0bf16: bfloat16 storage of every 2-D weight (uint16 bits: the top half of the float32,
  rounded to nearest even), norms and biases float32. Holds bf16 checkpoints (safetensors
  BF16, GGUF BF16) bit for bit; `auto` picks it for GGUF files whose layers are BF16.
* q4f32_1 / q4f16_1: 4-bit unsigned codes, 8 per uint32 (code j of word i is element
  8*i + j, bits 4j..4j+3), and a scale and a min per group of 32 in fp32 / fp16:
  w = q * scale + min. This asymmetric form holds GGUF Q4_0 (scale = d, min = -8 * d) and
  Q4_1 (scale = d, min = m) exactly in both variants, and MLC-LLM's symmetric q4
  (min = -7 * scale) exactly in q4f32_1 (-7 * scale needs more mantissa than fp16 has). The
  min/max quantizer (numpy_ref) lands on those exact values only for groups that use the
  full code range 0..15; repacking such blocks directly would keep every group exact.
* q4f16_0: the symmetric 4-bit form, GGUF Q4_0 exactly: the same words of 4-bit codes and one
  fp16 scale per group of 32, no min: w = (q - 8) * scale (4.5 bits per weight against
  q4f16_1's 5). The quantizer is llama.cpp's quantize_row_q4_0 (scale = the group's signed
  value of largest magnitude / -8, q = min(15, trunc(w / scale + 8.5))), so a float
  checkpoint gets the blocks llama.cpp would write. `auto` picks it for GGUF Q4_0 layers.
* q8f32 / q8f16: int8 codes with one fp32 / fp16 scale per group of 32: w = q * scale
  (symmetric). q8f16 is GGUF Q8_0 (and Q5_0, codes q - 16) bit for bit, at 8.5 bits per weight
  against q8f32's 9; `auto` picks it for those blocks. q8f32 keeps a float checkpoint's scale
  unrounded.

Activations (`mlcrun compile --activations`, quant/modules.py): `exact` keeps them in float32
(the matmul dequantizes the weights: results exact in fp32), `int8` quantizes them per row and
group of 32 to int8 (scale amax / 127, as llama.cpp's Q8_0/Q8_1) and multiplies the codes in
int32 with VNNI or AVX2 (compiler/schedules/int8.py). Under `int8` the q4/q8 params are stored
in the int8 kernels' layout (numpy_ref: panels of 16 rows, scales transposed, q8 codes offset to
uint8): same values, other order. `bf16` is the q0bf16 counterpart: activations rounded to
bfloat16 once per row (nearest even, denormals flushed) and multiplied with AVX512-BF16's
vdpbf16ps, products summed in float32 (compiler/schedules/bf16.py); the weights are stored in
panels of 16 rows x 2 K-elements (numpy_ref.tile_rows(., 2)). `auto` (compiler/options.py) is
int8 for q4/q8 where the CPU has AVX2 or VNNI, bf16 for q0bf16 where it has AVX512-BF16, else
exact.

Every preset but q0f32 stores the embedding table and the lm_head (tied or not) in its format
too: in a 135M model with a 49k vocabulary they are a fifth of the weights read per token.

A mixed name `A+B` stores the linear layers in A and the embedding table and lm_head in B, as
llama.cpp's files often do (Q4_1 layers with a Q8_0 token_embd: `q4f16_1+q8f16`). `auto`
(compiler/params.py) picks such a pair to keep a GGUF's blocks exact: a Q4_0 file with a Q8_0
token_embd compiles to `q4f16_0+q8f16`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import MlcrunError

GROUP_SIZE = 32


@dataclass(frozen=True)
class QuantPreset:
    name: str
    kind: str  # "none" | "f16" | "bf16" | "q4" | "q8"
    scale_dtype: str | None  # storage dtype of q4/q8 scales (and q4 mins)
    description: str
    group_size: int = GROUP_SIZE
    embedding: QuantPreset | None = None  # the embedding table's and lm_head's, when different
    symmetric: bool = False  # q4 only: no min, codes offset by 8 (w = (q - 8) * scale)

    @property
    def for_embedding(self) -> QuantPreset:
        """The preset of the embedding table and the lm_head."""
        return self.embedding or self

    @property
    def quantizes_embedding(self) -> bool:
        """The embedding table (and so a tied lm_head) and an untied lm_head use the same
        format as every other 2-D weight: true for every preset but q0f32."""
        return self.kind != "none"

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight element, scales and mins included."""
        if self.kind == "none":
            return 32.0
        if self.kind in ("f16", "bf16"):
            return 16.0
        scale_bits = 32 if self.scale_dtype == "float32" else 16
        if self.kind == "q4":
            return 4 + (1 if self.symmetric else 2) * scale_bits / self.group_size
        return 8 + scale_bits / self.group_size


PRESETS: dict[str, QuantPreset] = {
    p.name: p
    for p in (
        QuantPreset("q0f32", "none", None, "float32 weights (no quantization)"),
        QuantPreset("q0f16", "f16", None, "float16 weights, float32 compute"),
        QuantPreset("q0bf16", "bf16", None, "bfloat16 weights, float32 compute"),
        QuantPreset(
            "q4f16_0",
            "q4",
            "float16",
            "4-bit, group 32, float16 scale per group, symmetric (GGUF Q4_0)",
            symmetric=True,
        ),
        QuantPreset("q4f32_1", "q4", "float32", "4-bit, group 32, float32 scale + min per group"),
        QuantPreset("q4f16_1", "q4", "float16", "4-bit, group 32, float16 scale + min per group"),
        QuantPreset("q8f32", "q8", "float32", "8-bit, group 32, float32 scale per group"),
        QuantPreset(
            "q8f16", "q8", "float16", "8-bit, group 32, float16 scale per group (GGUF Q8_0)"
        ),
    )
}


# How quantized matmuls multiply: int8 activation codes with VNNI or AVX2 (q4/q8), bfloat16
# activations with AVX512-BF16 (q0bf16), or exact float32 activations.
ACTIVATIONS = ("int8", "bf16", "exact")


def _check_activations(activations: str) -> None:
    if activations not in ACTIVATIONS:
        choices = ", ".join(ACTIVATIONS)
        raise MlcrunError(f"activations must be one of {choices}, not {activations!r}")


def uses_int8(preset: QuantPreset, activations: str) -> bool:
    """Does `preset` store its weights for (and multiply them with) int8 activations?"""
    _check_activations(activations)
    return activations == "int8" and preset.kind in ("q4", "q8") and preset.group_size == GROUP_SIZE


def get_preset(name: str) -> QuantPreset:
    """A preset by name, or the mixed preset `A+B` (linears in A, embedding/lm_head in B)."""
    main, plus, emb = name.partition("+")
    if main not in PRESETS or (plus and (emb not in PRESETS or emb == main)):
        raise MlcrunError(
            f"unknown quantization {name!r}; choose from: {', '.join(PRESETS)} "
            "(or A+B: linear layers in A, embedding and lm_head in B)"
        )
    if not plus:
        return PRESETS[main]
    base, table = PRESETS[main], PRESETS[emb]
    description = f"{base.description}; embedding and lm_head: {table.description}"
    return replace(base, name=name, description=description, embedding=table)


def uses_bf16(preset: QuantPreset, activations: str) -> bool:
    """Does `preset` store its weights in panels for (and multiply them with) bf16 activations?"""
    _check_activations(activations)
    return activations == "bf16" and preset.kind == "bf16"
