"""GGUF files (llama.cpp) as a compile source, seen through Hugging Face names and shapes.

`GGUFSource` reads tensors lazily from the memory-mapped file and presents them as the HF
checkpoint they were converted from (`model.layers.0.self_attn.q_proj.weight`, [out, in]), so
the HF weight maps work unchanged. `gguf_hf_config` rebuilds config.json from the metadata;
`materialize_gguf` writes that plus the tokenizer files into a folder the compile can use as
its checkpoint folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from ..errors import MlcrunError
from ..quant.gguf_blocks import BLOCK_TYPES
from .gguf_tokenizer import eos_token_ids, write_tokenizer

# general.architecture -> HF `architectures[0]`
ARCHITECTURES = {
    "gemma3": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
READABLE_TYPES = ("F32", "F16", "BF16", *BLOCK_TYPES)

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms around attention and the MLP (llama's ffn_norm is its post_attention_layernorm)
_GEMMA3_BLOCK = {
    **_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling factors; folded into the config


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF name of a GGUF tensor; names we do not know are kept as they are."""
    match = _BLOCK_NAME.fullmatch(gguf_name)
    block = _GEMMA3_BLOCK if arch == "gemma3" else _BLOCK
    if match and match[2] in block:
        return f"model.layers.{match[1]}.{block[match[2]]}.{match[3]}"
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL:
        return f"{_TOP_LEVEL[stem]}.{suffix}"
    return gguf_name


class GGUFSource:
    """All tensors of a GGUF file by HF name and HF shape, dequantized to float32 on read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        reader, meta = open_gguf(self.path)
        arch = architecture(meta, self.path)
        n_head = int(meta.get(f"{arch}.attention.head_count", 0))
        n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
        # HF name -> (tensor, heads to un-permute its rows by, or 0)
        self._tensors: dict[str, tuple[Any, int]] = {}
        for tensor in reader.tensors:
            if tensor.name == _ROPE_FREQS:
                continue
            if tensor.tensor_type.name not in READABLE_TYPES:
                raise MlcrunError(
                    f"{self.path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                    f"which mlcrun cannot read (supported: {', '.join(READABLE_TYPES)})"
                )
            name = hf_tensor_name(tensor.name, arch)
            heads = 0
            # llama.cpp's LlamaModel.permute reorders q/k rows (per head: interleaved RoPE
            # pairs); qwen2 is converted without it.
            if arch == "llama" and ".self_attn.q_proj." in name:
                heads = n_head
            elif arch == "llama" and ".self_attn.k_proj." in name:
                heads = n_kv
            if heads and self._shape(tensor)[0] % (2 * heads):
                raise MlcrunError(
                    f"{self.path}: tensor {tensor.name!r} rows do not split into heads"
                )
            self._tensors[name] = (tensor, heads)
        # llama.cpp stores Gemma's RMSNorm weights as 1 + w; HF checkpoints hold w
        self._minus_one = arch == "gemma3"

    @staticmethod
    def _shape(tensor: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF stores ne order

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape(self._tensors[name][0])

    def dtype(self, name: str) -> str:
        """The GGML type name of a tensor (F32, Q4_0, ...)."""
        return self._tensors[name][0].tensor_type.name

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32, in HF layout (q/k rows un-permuted for llama)."""
        tensor, heads = self._tensors[name]
        array = dequantize(tensor.data, tensor.tensor_type)
        array = np.asarray(array, dtype=np.float32).reshape(self.shape(name))
        if self._minus_one and name.endswith("norm.weight"):
            array = array - np.float32(1.0)
        return _unpermute(array, heads) if heads else array

    def raw(self, name: str) -> tuple[str, np.ndarray]:
        """(GGML type name, stored data) in HF row order: for quantized types a uint8 array
        [rows, bytes per row] of the type's blocks, else the typed values; llama q/k rows are
        un-permuted (blocks never span rows, so this stays exact)."""
        tensor, heads = self._tensors[name]
        data = np.asarray(tensor.data)
        return tensor.tensor_type.name, (_unpermute(data, heads) if heads else data)


def _unpermute(array: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `w.reshape(n, 2, d // n // 2, ...).swapaxes(1, 2)` on rows."""
    rows = array.shape[0]
    split = array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(array.shape))


def open_gguf(path: Path) -> tuple[GGUFReader, dict[str, Any]]:
    """The reader and its metadata as plain Python values; any damage -> MlcrunError."""
    path = Path(path)
    if not path.is_file():
        raise MlcrunError(f"{path}: no such GGUF file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise MlcrunError(f"{path}: cannot read the GGUF file ({err.strerror})") from None
    if magic != b"GGUF":
        raise MlcrunError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = GGUFReader(path)
        meta = {key: _value(field) for key, field in reader.fields.items()}
    except Exception as err:  # the reader fails with ValueError, KeyError, IndexError, ...
        detail = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        raise MlcrunError(f"{path}: corrupt or truncated GGUF file ({detail})") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise MlcrunError(
                f"{path}: truncated GGUF file (tensor {tensor.name!r} ends at byte {end}, "
                f"file has {size})"
            )
    return reader, meta


def _value(field: Any) -> Any:
    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.ARRAY:
        if not field.data or not field.types[1:]:
            return []
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return field.contents()
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", "replace")
    return field.contents()


def architecture(meta: dict[str, Any], path: Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise MlcrunError(
            f"{path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return arch


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def _hf_config(reader: GGUFReader, meta: dict[str, Any], path: Path) -> dict[str, Any]:
    try:
        return _read_hf_config(reader, meta, path)
    except (TypeError, ValueError, ZeroDivisionError) as err:
        if isinstance(err, MlcrunError):
            raise
        raise MlcrunError(f"{path}: invalid GGUF model metadata ({err})") from None


def _read_hf_config(reader: GGUFReader, meta: dict[str, Any], path: Path) -> dict[str, Any]:
    arch = architecture(meta, path)

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise MlcrunError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    tensors = {t.name: t for t in reader.tensors}
    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise MlcrunError(
            f"{path}: RoPE on {rope_dims} of {head_dim} head dims is not supported by mlcrun"
        )
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", []))
    theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "rms_norm_eps": _f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": _source_dtype({t.tensor_type.name for t in reader.tensors}),
    }
    if f"{arch}.attention.key_length" in meta:
        config["head_dim"] = head_dim
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    elif arch == "qwen2":
        config["use_sliding_window"] = False
    else:
        config.update(_gemma3_config(meta, arch, heads, hidden, head_dim))
    if isinstance(meta.get("tokenizer.ggml.bos_token_id"), int):
        config["bos_token_id"] = meta["tokenizer.ggml.bos_token_id"]
    eos = eos_token_ids(meta)
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    scaling = _rope_scaling(meta, arch, tensors.get(_ROPE_FREQS), theta, head_dim, path)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _gemma3_config(meta, arch: str, heads: int, hidden: int, head_dim: int) -> dict[str, Any]:
    """What llama.cpp's converter leaves out of a Gemma 3 file, with llama.cpp's defaults:
    the sliding layers' RoPE base (10000), every sixth layer full, and the score scale
    (1/sqrt(head_dim); 1/sqrt(hidden / heads) for the 27B model)."""
    layers = int(meta[f"{arch}.block_count"])
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:  # per layer: true = sliding
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        every = int(pattern) if isinstance(pattern, int) and pattern > 0 else 6
        types = [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
        ]
    is_27b = layers == 62 and hidden == 5376
    config: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "rope_local_base_freq": _f32(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": hidden // heads if is_27b else head_dim,
    }
    if f"{arch}.attention.sliding_window" in meta:
        config["sliding_window"] = int(meta[f"{arch}.attention.sliding_window"])
    if f"{arch}.final_logit_softcapping" in meta:
        config["final_logit_softcapping"] = _f32(meta[f"{arch}.final_logit_softcapping"])
    return config


def _source_dtype(types: set[str]) -> str:
    if types <= {"F32"}:
        return "float32"
    return "bfloat16" if "BF16" in types else "float16"


def _rope_scaling(meta, arch, freqs, theta, head_dim, path) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if freqs is not None:
        if freqs.tensor_type.name != "F32":
            raise MlcrunError(f"{path}: {_ROPE_FREQS} must be F32")
        return _llama3_scaling(np.asarray(freqs.data, np.float64).ravel(), theta, head_dim, path)
    if kind == "none":
        return None
    # Not supported by the compiler; ModelConfig refuses it naming the type.
    scaling = {"rope_type": kind, "factor": _f32(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
    if f"{arch}.rope.scaling.original_context_length" in meta:
        orig = int(meta[f"{arch}.rope.scaling.original_context_length"])
        scaling["original_max_position_embeddings"] = orig
    return scaling


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, path) -> dict | None:
    """llama.cpp keeps Llama 3 RoPE scaling only as per-dimension factors (rope_freqs.weight,
    one per rotated pair); find HF llama3 parameters that reproduce them."""
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    if factors.shape != wavelen.shape:
        raise MlcrunError(
            f"{path}: {_ROPE_FREQS} has {factors.size} values, expected {wavelen.size}"
        )
    if np.allclose(factors, 1.0):
        return None
    factor = _f32(factors.max())
    for low, high, orig in _llama3_candidates(factors, wavelen, factor):
        if np.allclose(_llama3_factors(wavelen, factor, low, high, orig), factors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise MlcrunError(f"{path}: {_ROPE_FREQS} does not match llama3 RoPE scaling")


def _llama3_factors(wavelen: np.ndarray, factor: float, low: float, high: float, orig: int):
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _llama3_candidates(factors: np.ndarray, wavelen: np.ndarray, factor: float):
    # Only (orig, low, high) up to the two numbers orig/(high-low) and low/(high-low) matter;
    # take low = 1 (every Llama 3.x) and fit the rest from the smooth band, where
    # s = (1/f_i - 1/factor) / (1 - 1/factor) = orig / (high - 1) / wavelen - 1 / (high - 1).
    band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if band.sum() >= 2:
        s = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[band], s, 1)
        if intercept < 0:
            high = 1 - 1 / intercept
            yield 1.0, round(float(high), 4), int(round(slope * (high - 1)))
    for power in range(4, 22):  # no band to fit: the usual high = 4 and a power-of-2 context
        yield 1.0, 4.0, 2**power


def gguf_hf_config(path: str | Path) -> dict[str, Any]:
    """An HF-style config.json dict for the model in a GGUF file."""
    reader, meta = open_gguf(Path(path))
    return _hf_config(reader, meta, Path(path))


def write_tokenizer_files(path: str | Path, out_dir: str | Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json for the GGUF's vocab."""
    _, meta = open_gguf(Path(path))
    write_tokenizer(meta, Path(path), Path(out_dir))


def materialize_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """Write config.json and the tokenizer files of a GGUF file into `out_dir` (a checkpoint
    folder without weights: pair it with `GGUFSource(path)`)."""
    path, out = Path(path), Path(out_dir)
    reader, meta = open_gguf(path)
    config = _hf_config(reader, meta, path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(meta, path, out)
    return out
