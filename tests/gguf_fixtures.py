"""GGUF files written from HF checkpoints the way llama.cpp's convert_hf_to_gguf.py does.

Independent of mlcrun's reader on purpose: names come from the gguf package's tensor name
map, the llama q/k row permutation is llama.cpp's `LlamaModel.permute`, the vocab follows its
`get_vocab_base` (pads to vocab_size with [PADn], control/user-defined token types).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

Q = gguf.GGMLQuantizationType
ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'd've LIKED it; we'll see.  Double  spaces,\ttabs\n\nand newlines\r\n.",
    "Café déjà vu, naïve façade, Ünïcödé, São Paulo, Straße, ñandú",
    "日本語のテキストと中文字符, 한국어 문장, русский текст, العربية",
    "Emoji: 😀👍🏽🚀✨ and flags 🇫🇷, math ∑∫√π ≠ ∞",
    "Decomposed: Cafe\u0301 A\u030a, digits 20242025 12,345,678.90",
    "def f(x):\n    return x ** 2  # squares zyzzyva\n\nprint(f(12345), 3.14159, 1_000_000)",
    "   leading spaces and trailing   ",
    "<s>special</s> tokens <unk> inline <|im_start|>user\nhi<|im_end|> <tool>x",
    "",
]
CORPUS = [s for s in SAMPLES[:6] for _ in range(3)] + [
    "the of and to in is that for it as was with be by on not he this are or his from at",
    "numbers 0123456789 2024 1999 42 7 000 1,234.56 2025 20242025 12345678",
]


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# ------------------------------------------------- K-quant blocks (gguf-py cannot write them)
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> llama.cpp's 12 bytes (the inverse of get_scale_min)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return out


def quantize_k(w: np.ndarray, qtype: Q) -> np.ndarray:
    """[rows, K] float -> [rows, K / 256 * block bytes] uint8 blocks of Q4_K, Q5_K or Q6_K: a
    plain min/max quantizer (llama.cpp searches scales harder; the layout is what matters)."""
    rows, k = w.shape
    x = w.astype(np.float32).reshape(rows, k // 256, -1)  # [rows, blocks, 256]
    if qtype == Q.Q6_K:
        g = x.reshape(*x.shape[:2], 16, 16)
        amax = np.abs(g).max(axis=-1)
        d = _f16(amax.max(axis=-1) / 31 / 127)
        d32 = d.astype(np.float32)[..., None]
        ratio = np.divide(amax / 31, d32, out=np.zeros_like(amax), where=d32 > 0)
        sc = np.clip(np.ceil(ratio), 0, 127)  # rounded up: no code beyond +-31
        step = (d32 * sc)[..., None]
        q = np.clip(np.rint(np.divide(g, step, out=np.zeros_like(g), where=step > 0)), -32, 31)
        q = (q + 32).astype(np.uint8).reshape(*x.shape[:2], 2, 4, 32)  # [.., half, group, l]
        lo = q & 15
        ql = np.concatenate(
            [lo[..., 0, :] | (lo[..., 2, :] << 4), lo[..., 1, :] | (lo[..., 3, :] << 4)], axis=-1
        )
        qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=-2)
        parts = [
            ql.reshape(*x.shape[:2], 128),
            qh.reshape(*x.shape[:2], 64),
            sc.astype(np.int8).view(np.uint8),
            d[..., None].view(np.uint8),
        ]
        return np.concatenate(parts, axis=-1).reshape(rows, -1)
    levels = 15 if qtype == Q.Q4_K else 31
    g = x.reshape(*x.shape[:2], 8, 32)
    lo, hi = np.minimum(g.min(axis=-1), 0), g.max(axis=-1)
    scale, mins = (hi - lo) / levels, -lo
    d, dmin = _f16(scale.max(axis=-1) / 63), _f16(mins.max(axis=-1) / 63)
    d32, m32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63)
    mn = np.clip(np.rint(np.divide(mins, m32, out=np.zeros_like(mins), where=m32 > 0)), 0, 63)
    step, off = (d32 * sc)[..., None], (m32 * mn)[..., None]
    q = np.clip(np.rint(np.divide(g + off, step, out=np.zeros_like(g), where=step > 0)), 0, levels)
    q = q.astype(np.uint8)  # [rows, blocks, 8, 32]
    qs = (q[..., 0::2, :] & 15) | ((q[..., 1::2, :] & 15) << 4)  # [.., 4, 32]
    parts = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), _pack_k_scales(sc, mn)]
    if qtype == Q.Q5_K:
        fifth = (q >> 4) << np.arange(8, dtype=np.uint8)[:, None]  # bit g of qh[l]: group g
        parts.append(np.bitwise_or.reduce(fifth, axis=-2))
    parts.append(qs.reshape(*x.shape[:2], 128))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def quantize(array: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf's quantizer, or ours for the K-quants."""
    if qtype in K_TYPES:
        return quantize_k(array, qtype)
    return gguf.quants.quantize(array.astype(np.float32), qtype)


def stored_type(array: np.ndarray, qtype: Q) -> Q:
    """llama.cpp keeps 1-D tensors F32; rows that do not split into blocks stay F32 too."""
    if array.ndim == 1 or qtype == Q.F32:
        return Q.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if array.shape[-1] % block == 0 else Q.F32


def expected(array: np.ndarray, qtype: Q) -> np.ndarray:
    """What a reader should give back for `array` stored as `qtype`."""
    kind = stored_type(array, qtype)
    if kind == Q.F32:
        return array.astype(np.float32)
    return gguf.quants.dequantize(quantize(array, kind), kind)


def rope_theta(config: dict) -> float:
    return float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def llama3_rope_factors(config: dict) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors for rope_type llama3."""
    rope = config["rope_parameters"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope_theta(config) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def is_table(hf_name: str) -> bool:
    """The embedding table or the lm_head (llama.cpp often stores them in another type)."""
    return hf_name.endswith("embed_tokens.weight") or hf_name == "lm_head.weight"


def write_gguf(
    folder: Path,
    path: Path,
    qtype: Q = Q.F32,
    pre: str = "gpt-2",
    table_qtype: Q | None = None,
    qtype_of=None,
) -> Path:
    """Convert the HF checkpoint in `folder` to a GGUF file at `path` (the embedding table and
    lm_head in `table_qtype` when given; `qtype_of(hf_name)`, when given, picks each 2-D
    tensor's type, as llama.cpp's mixes such as Q4_K_M do)."""
    config = json.loads((folder / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    writer.add_rope_dimension_count(head_dim)
    if config.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(int(qtype))
    add_tokenizer(writer, folder, config["vocab_size"], pre)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    if (config.get("rope_parameters") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    for hf_name, array in load_file(str(folder / "model.safetensors")).items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            array = permute(array, n_head, n_head)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            array = permute(array, n_head, n_kv)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        table = table_qtype is not None and is_table(hf_name)
        kind = stored_type(array, table_qtype if table else qtype)
        if qtype_of is not None and array.ndim == 2:
            kind = stored_type(array, qtype_of(hf_name))
        data = quantize(array, kind)
        writer.add_tensor(name, data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    finish(writer)
    return path


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int, pre: str) -> None:
    """`tokenizer.ggml.*` for an HF byte-level BPE tokenizer folder (llama.cpp's gpt2 vocab)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(max(vocab_size, len(reverse))):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            special = added[i].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        name = tok_config.get(f"{key}_token")
        if name is not None:
            add(tok.token_to_id(name))
    if tok_config.get("unk_token") is not None:
        writer.add_unk_token_id(tok.token_to_id(tok_config["unk_token"]))
    if "add_bos_token" in tok_config:
        writer.add_add_bos_token(bool(tok_config["add_bos_token"]))
    else:  # llama.cpp reads it off the post-processor template
        bos = tok.token_to_id(tok_config.get("bos_token") or "")
        writer.add_add_bos_token(bos is not None and tok.encode("a").ids[:1] == [bos])
    writer.add_chat_template(tok_config.get("chat_template", CHAT_TEMPLATE))


def train_tokenizer(folder: Path, pre: str) -> Path:
    """A small byte-level BPE (trained here with GPT-2's split, so that it also learns digit
    merges) behind the HF pipeline of the real `pre` family."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "qwen2"):
        regex = LLAMA3_REGEX if pre == "llama-bpe" else QWEN2_REGEX
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    if pre == "llama-bpe":
        tok.model.ignore_merges = True
        # a whole word in the vocab that no merge reaches: only ignore_merges finds it
        data = json.loads(tok.to_str())
        data["model"]["vocab"]["\u0120zyzzyva"] = len(data["model"]["vocab"])
        tok = Tokenizer.from_str(json.dumps(data))
    tok.add_tokens(["<tool>"])  # a user-defined (not special) added token
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config["add_bos_token"] = pre == "llama-bpe"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_tokenizer_gguf(folder: Path, path: Path, pre: str, vocab_size: int = 0) -> Path:
    """A GGUF holding only metadata: a llama header and the tokenizer of `folder`."""
    writer = gguf.GGUFWriter(str(path), "llama")
    add_tokenizer(writer, folder, vocab_size, pre)
    finish(writer)
    return path


SPACE = "\u2581"


@functools.cache  # training is not deterministic across calls (hash order of ties)
def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocab (tokens, scores, types): <unk> <s> </s>, 256 <0xNN> byte
    pieces, then pieces learned by BPE over words with a leading U+2581, scored -id."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=400, limit_alphabet=60, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    learned = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [t for t, _ in learned]
    scores = [0.0] * 259 + [-float(i) for i in range(len(learned))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned)
    return tokens, scores, types


def write_spm_gguf(path: Path, add_space_prefix: bool = True) -> Path:
    tokens, scores, types = spm_vocab()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(add_space_prefix)
    finish(writer)
    return path


def spm_reference(text: str, add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SPM tokenizer on one text fragment, written plainly: merge the adjacent
    pair whose concatenation is a piece with the best score (leftmost on ties) until none is
    left; pieces not in the vocab fall back to their UTF-8 bytes."""
    if not text:  # llama.cpp makes no fragment of empty text
        return []
    tokens, scores, _ = spm_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    text = (" " + text if add_space_prefix else text).replace(" ", SPACE)
    symbols = list(text)
    while True:
        best = None
        for i in range(len(symbols) - 1):
            piece = symbols[i] + symbols[i + 1]
            if piece in vocab and (best is None or scores[vocab[piece]] > best[0]):
                best = (scores[vocab[piece]], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    ids: list[int] = []
    for symbol in symbols:
        if symbol in vocab:
            ids.append(vocab[symbol])
        else:
            ids += [vocab[f"<0x{b:02X}>"] for b in symbol.encode()]
    return ids
