"""Tiny random-init Hugging Face checkpoints, built by transformers inside the test session."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class, model class, extra config)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3-rope-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
            rope_theta=500000.0,
        ),
    ),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    # Gemma 3: 3 layers (sliding, full, sliding), a window of 20 keys (over two KV pages of
    # 16), head_dim apart from
    # hidden / heads, a score scale apart from head_dim, and the two RoPE bases
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=20,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            tie_word_embeddings=True,
            pad_token_id=0,
        ),
    ),
}


def build_checkpoint(name: str, folder: Path, seed: int = 0, **overrides) -> Path:
    config_cls, model_cls, extra = ARCHS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def load_reference(folder: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    return model.eval()


def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE over a tiny vocab, enough for text prompts to round-trip."""
    tok = Tokenizer(
        models.BPE(
            vocab={**{f"<{s}>": i for i, s in enumerate(["unk", "s", "/s"])}, **_byte_vocab(3)},
            merges=[],
            unk_token="<unk>",
        )
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


def _byte_vocab(offset: int) -> dict[str, int]:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return {ch: offset + i for i, ch in enumerate(sorted(alphabet))}
