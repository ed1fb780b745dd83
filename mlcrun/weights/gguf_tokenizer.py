"""GGUF `tokenizer.ggml.*` metadata -> HF `tokenizers` files that give the same token ids.

Two vocab kinds, as in llama.cpp's llama-vocab.cpp:
- `gpt2`: byte-level BPE over the stored merges; the split regex before the byte mapping is
  chosen by `tokenizer.ggml.pre` (each entry below is the HF tokenizer.json equivalent of
  llama.cpp's regex list for that name);
- `llama`: SentencePiece pieces with scores and <0xNN> byte fallback, rebuilt as a BPE whose
  merges are ranked by the score of the merged piece (what llama.cpp's SPM tokenizer does and
  what transformers' SentencePieceExtractor builds). A space is prepended to every text
  fragment, also after special tokens, as llama.cpp (and sentencepiece) do.
Control/unknown tokens become special added tokens, user-defined ones plain added tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from ..errors import MlcrunError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = dict(regex=None, digits=False, ignore_merges=False, nfc=False)
# tokenizer.ggml.pre -> split regex (None: GPT-2's, built into ByteLevel), digits split off
# one by one first, BPE ignore_merges (whole-word vocab hits win, llama3), NFC (Qwen2's HF
# tokenizer normalizes; llama.cpp does not, which only differs on non-NFC input)
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "llama-bpe": dict(_GPT2, regex=_LLAMA3, ignore_merges=True),
    "llama3": dict(_GPT2, regex=_LLAMA3, ignore_merges=True),
    "llama-v3": dict(_GPT2, regex=_LLAMA3, ignore_merges=True),
    "qwen2": dict(_GPT2, regex=_QWEN2, nfc=True),
    "deepseek-r1-qwen": dict(_GPT2, regex=_QWEN2, nfc=True),
    "smollm": dict(_GPT2, digits=True),
    "starcoder": dict(_GPT2, digits=True),
    "refact": dict(_GPT2, digits=True),
}
_SAMPLING = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k"}


# End-of-turn pieces llama.cpp recognizes by text when a file names no eot id (llama-vocab.cpp)
_EOT_PIECES = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>")

# Gemma 3's chat template (text only), for Gemma 3 files that carry none: llama.cpp's
# converter often leaves tokenizer.chat_template out, and llama.cpp then uses its built-in one.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """eos plus end-of-turn / end-of-message ids: each ends generation in llama.cpp. A file
    that names no eot id gets the id of a known end-of-turn control piece (Gemma's
    <end_of_turn>), as llama.cpp finds it."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int) and value >= 0 and value not in ids:
            ids.append(value)
    if "tokenizer.ggml.eot_token_id" not in meta:
        tokens = meta.get("tokenizer.ggml.tokens") or []
        types = meta.get("tokenizer.ggml.token_type") or []
        for i, piece in enumerate(tokens):
            if piece in _EOT_PIECES and i < len(types) and types[i] == CONTROL and i not in ids:
                ids.append(i)
    return ids


def build_tokenizer(meta: dict[str, Any], path: Path) -> tuple[Tokenizer, dict[str, Any]]:
    """The backend tokenizer and the tokenizer_config.json dict for the GGUF's vocab."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise MlcrunError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise MlcrunError(f"{path}: tokenizer.ggml.token_type and tokens differ in length")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a duplicate piece keeps its first id (as HF does)
    try:
        if kind == "gpt2":
            backend, add_bos = _byte_level_bpe(meta, vocab, path)
        elif kind == "llama":
            backend, add_bos = _sentencepiece(meta, tokens, types, vocab, path), True
        else:
            raise MlcrunError(
                f"{path}: tokenizer model {kind!r} is not supported (supported: gpt2, llama)"
            )
    except Exception as err:  # the Rust side raises plain Exception on a bad vocab/merges
        if isinstance(err, MlcrunError):
            raise
        raise MlcrunError(
            f"{path}: invalid tokenizer data ({' '.join(str(err).split())})"
        ) from None
    added = [
        AddedToken(tokens[i], special=t != USER_DEFINED, normalized=False)
        for i, t in enumerate(types)
        if t in (UNKNOWN, CONTROL, USER_DEFINED) and tokens[i] and vocab[tokens[i]] == i
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])

    def named(key: str, special_only: bool = False) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not isinstance(i, int) or not 0 <= i < len(tokens):
            return None
        return tokens[i] if not special_only or types[i] in (UNKNOWN, CONTROL) else None

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = named("bos"), named("eos")
    backend.post_processor = _template(backend, bos if add_bos else None, eos if add_eos else None)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": named("unknown", special_only=True),
        "pad_token": named("padding", special_only=True),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if not isinstance(template, str) and meta.get("general.architecture") == "gemma3":
        template = GEMMA3_CHAT_TEMPLATE
    if isinstance(template, str):
        config["chat_template"] = template
    return backend, config


def _byte_level_bpe(meta: dict[str, Any], vocab: dict[str, int], path: Path):
    name = meta.get("tokenizer.ggml.pre", "default")
    if name not in PRE_TOKENIZERS:
        raise MlcrunError(
            f"{path}: tokenizer pre-tokenizer {name!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    spec = PRE_TOKENIZERS[name]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    if any(len(m) != 2 for m in merges):
        raise MlcrunError(f"{path}: tokenizer.ggml.merges holds an entry without a space")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=spec["ignore_merges"]))
    if spec["nfc"]:
        backend.normalizer = normalizers.NFC()
    steps: list[Any] = [pre.Digits(individual_digits=True)] if spec["digits"] else []
    if spec["regex"] is None:
        steps.append(pre.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre.Split(Regex(spec["regex"]), behavior="isolated"))
        steps.append(pre.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend, spec["ignore_merges"]  # llama.cpp adds BOS by default for llama3 vocabs


def _sentencepiece(meta, tokens: list[str], types: list[int], vocab: dict[str, int], path):
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise MlcrunError(f"{path}: a SentencePiece vocab needs tokenizer.ggml.scores per token")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    if not isinstance(unk, int) or not 0 <= unk < len(tokens):
        unk = next((i for i, t in enumerate(types) if t == UNKNOWN), None)
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_score_merges(tokens, scores, vocab),
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    space = "\u2581"
    steps: list[Any] = [normalizers.Replace(" ", space)]
    strip: list[Any] = []
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(space))
        strip = [decoders.Strip(" ", 1, 0)]
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return backend


def _score_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]):
    """Every split of a piece into two pieces, best merged-piece score first; the splits of
    one piece ordered by their parts' ids (transformers' SentencePieceExtractor)."""
    ranked: list[tuple[float, str, str]] = []
    for i, piece in enumerate(tokens):
        if vocab[piece] != i:
            continue
        local = [
            (piece[:k], piece[k:])
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked += [(-float(scores[i]), left, right) for left, right in local]
    ranked.sort(key=lambda m: m[0])  # stable: ties keep piece order
    return [(left, right) for _, left, right in ranked]


def _template(backend: Tokenizer, bos: str | None, eos: str | None):
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t is not None]
    head = [bos] if bos else []
    tail = [eos] if eos else []
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *head, "$B:1", *tail],
        special_tokens=[(t, i) for t, i in specials if i is not None],
    )


def write_tokenizer(meta: dict[str, Any], path: Path, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json into `out`."""
    backend, config = build_tokenizer(meta, path)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation: dict[str, Any] = {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if isinstance(bos, int):
        generation["bos_token_id"] = bos
    eos = eos_token_ids(meta)
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    for key, hf_key in _SAMPLING.items():
        if f"general.sampling.{key}" in meta:
            value = meta[f"general.sampling.{key}"]
            generation[hf_key] = int(value) if hf_key == "top_k" else float(f"{value:.6g}")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
