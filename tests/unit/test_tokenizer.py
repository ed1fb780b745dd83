"""mlcrun.tokenizer against transformers, on small tokenizers trained here (no files, no network).

Two kinds, like the checkpoints we support: a byte-level BPE (GPT-2 / Llama 3 / Qwen style,
BOS added by the post-processor) and a SentencePiece-style BPE (Metaspace + byte fallback,
Llama 2 / Mistral style). The alphabet of the second is limited so emoji, CJK and some accented
letters go through `<0xNN>` byte tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from mlcrun.errors import MlcrunError
from mlcrun.tokenizer import TOKENIZER_FILES, StreamDecoder, Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Compilers turn programs into fast machine code; schedules make loops faster.",
    "She said: \"I'm sure it's fine, isn't it?\" and we'll see 12345 or 3.14159.",
    "Café, naïve, façade, résumé, jalapeño, Ångström, Straße, Œuvre, déjà vu.",
    "Привет, мир! Как дела? Всё хорошо, спасибо.",
    "日本語のテキストと中文文本，还有한국어 텍스트도 있습니다。",
    "Emoji: 😀 😂 🎉 🚀 👍🏽 👨‍👩‍👧 ❤️ and flags 🇫🇷 🇯🇵.",
    "def main():\n    print('hello, world')  # say hi\n\treturn 0\n",
    "Ελληνικά γράμματα και العربية مرحبا بالعالم और हिन्दी भी।",
]

TEXTS = [
    "Hello world",
    " Hello  world ",
    "  two leading spaces",
    "héllo wörld, ça va? Ñandú",
    "e\u0301 decomposed accents vs é composed",
    "日本語のテキスト 中文 한국어",
    "😀🎉🚀 family 👨‍👩‍👧 thumbs 👍🏽 flag 🇫🇷 ❤️",
    "never seen: 𝄞 🦜 ☃ ꙮ",
    "line one\nline two\n\n\tindented\r\n",
    "",
    " ",
    "<s> special </s> inside <|bos|> text <|eos|>",
    "numbers 0123456789 and 3.14",
    "Привет мир مرحبا",
    "a" * 40,
]


def _save(folder: Path, backend: HFTokenizer, tokenizer_config: dict, **extra_files: dict) -> Path:
    """A checkpoint-like folder; extra_files maps a stem (e.g. config) to its JSON content."""
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config_text = json.dumps(tokenizer_config)
    (folder / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    for name, data in extra_files.items():
        (folder / f"{name}.json").write_text(json.dumps(data), encoding="utf-8")
    return folder


def _train_byte_level() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    return tok


def _train_sentencepiece_style() -> HFTokenizer:
    tok = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    # Trained with word splits (like SentencePiece pieces), used unsplit like Llama 2/Mistral.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=70,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):  # byte-fallback pieces, as SentencePiece's byte_fallback adds them
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["pre_tokenizer"] = {
        "type": "Metaspace",
        "replacement": "▁",
        "prepend_scheme": "first",
        "split": False,
    }
    data["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    bos = vocab["<s>"]
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<s>", "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}},
    }
    return HFTokenizer.from_str(json.dumps(data))


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": {
            "__type": "AddedToken",
            "content": "<|eos|>",
            "special": True,
            "normalized": False,
        },
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    return _save(
        tmp_path_factory.mktemp("byte_level"),
        _train_byte_level(),
        config,
        generation_config={"bos_token_id": 1, "eos_token_id": [2, 0]},
    )


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
    }
    return _save(tmp_path_factory.mktemp("spm"), _train_sentencepiece_style(), config)


@pytest.fixture(params=["byte_level", "sentencepiece"])
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


def _stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    decoder = tok.stream(skip_special_tokens=skip)
    return [decoder.add(i) for i in ids] + [decoder.finish()]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizer_dir: Path, add_special_tokens: bool) -> None:
    ours = Tokenizer.from_dir(tokenizer_dir)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json")
    )
    auto = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == fast(text, add_special_tokens=add_special_tokens).input_ids, text
        assert ids == auto(text, add_special_tokens=add_special_tokens).input_ids, text


def test_decode_matches_transformers(tokenizer_dir: Path) -> None:
    ours = Tokenizer.from_dir(tokenizer_dir)
    auto = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for text in TEXTS:
        ids = auto(text).input_ids
        for skip in (True, False):
            assert ours.decode(ids, skip) == auto.decode(ids, skip_special_tokens=skip), text


def test_bos_added_and_roundtrip(tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_dir(tokenizer_dir)
    assert tok.bos_token_id is not None
    assert tok.encode("Hello")[0] == tok.bos_token_id
    assert tok.bos_token_id not in tok.encode("Hello", add_special_tokens=False)
    for text in TEXTS:
        if text[:1].isspace() or "<" in text:
            continue  # SentencePiece strips one leading space; special-token text is dropped
        assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_style_uses_byte_fallback(sentencepiece_dir: Path) -> None:
    tok = Tokenizer.from_dir(sentencepiece_dir)
    ids = tok.encode("🦜 日本", add_special_tokens=False)
    pieces = [tok.id_to_token(i) for i in ids]
    assert "<0xF0>" in pieces  # the parrot's first UTF-8 byte
    assert tok.decode(ids) == "🦜 日本"


def test_stream_concatenates_to_decode_and_never_breaks_utf8(tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_dir(tokenizer_dir)
    for text in TEXTS + CORPUS:
        ids = tok.encode(text)
        for skip in (True, False):
            deltas = _stream(tok, ids, skip)
            assert "".join(deltas) == tok.decode(ids, skip), text
            assert not any("\ufffd" in d for d in deltas), (text, deltas)


def test_stream_holds_back_partial_characters(sentencepiece_dir: Path) -> None:
    tok = Tokenizer.from_dir(sentencepiece_dir)
    ids = tok.encode("🦜", add_special_tokens=False)
    assert len(ids) >= 4  # ▁ plus four byte tokens
    deltas = _stream(tok, ids)
    assert all(d == "" for d in deltas[:-2])
    assert "".join(deltas) == "🦜"


def test_stream_keeps_spaces_between_tokens(sentencepiece_dir: Path) -> None:
    tok = Tokenizer.from_dir(sentencepiece_dir)
    ids = tok.encode("fox jumps over", add_special_tokens=False)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == "fox jumps over"
    assert any(d.startswith(" ") for d in deltas)  # a later word keeps its leading space


def test_stream_random_byte_level_ids(byte_level_dir: Path) -> None:
    # Byte-level decoding is self-synchronizing, so even invalid UTF-8 streams match decode().
    tok = Tokenizer.from_dir(byte_level_dir)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 25))]
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip), ids


def test_stream_random_valid_pieces(sentencepiece_dir: Path) -> None:
    tok = Tokenizer.from_dir(sentencepiece_dir)
    rng = random.Random(0)
    words = [w for w in " ".join(CORPUS + TEXTS).split() if "<" not in w]
    for _ in range(100):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 8)))
        ids = tok.encode(text)
        deltas = _stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)


def test_stream_with_prefix_keeps_leading_space(sentencepiece_dir: Path) -> None:
    tok = Tokenizer.from_dir(sentencepiece_dir)
    prompt = tok.encode("The quick")
    output = tok.encode(" brown fox", add_special_tokens=False)
    decoder = StreamDecoder(tok, prefix_ids=prompt)
    text = "".join(decoder.add(i) for i in output) + decoder.finish()
    assert text == tok.decode(prompt + output)[len(tok.decode(prompt)) :]
    assert text.startswith(" brown")


def test_special_tokens_and_eos_ids(byte_level_dir: Path) -> None:
    tok = Tokenizer.from_dir(byte_level_dir)
    assert tok.bos_token == "<|bos|>" and tok.bos_token_id == tok.token_to_id("<|bos|>")
    assert tok.eos_token == "<|eos|>"  # given as an AddedToken dict
    assert set(tok.eos_token_ids) == {0, 2}  # tokenizer eos + generation_config list
    assert tok.pad_token_id == tok.token_to_id("<|pad|>")
    assert tok.id_to_token(tok.bos_token_id) == "<|bos|>"
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.vocab_size == len(transformers.AutoTokenizer.from_pretrained(str(byte_level_dir)))
    assert tok.chat_template is not None and "messages" in tok.chat_template


def test_eos_from_config_json_and_int(tmp_path: Path) -> None:
    folder = _save(
        tmp_path / "m",
        _train_byte_level(),
        {"eos_token": "<|eos|>"},
        generation_config={"eos_token_id": 0},
        config={"eos_token_id": [1, 2], "bos_token_id": 1},
    )
    tok = Tokenizer.from_dir(folder)
    assert tok.eos_token_ids == (0, 1, 2)
    assert tok.bos_token_id == 1  # no bos_token in tokenizer_config: from the config files


def test_explicit_null_bos_token(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", _train_byte_level(), {"bos_token": None, "add_bos_token": False})
    (folder / "generation_config.json").write_text('{"bos_token_id": 1}')
    tok = Tokenizer.from_dir(folder)
    assert tok.bos_token_id is None
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


def test_add_bos_and_eos_token_flags_rewrite_post_processor(tmp_path: Path) -> None:
    backend = _train_byte_level()
    backend.post_processor = None
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "add_bos_token": True}
    tok = Tokenizer.from_dir(_save(tmp_path / "a", backend, config))
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi")[-1] not in tok.eos_token_ids
    config.update(add_bos_token=False, add_eos_token=True)
    tok = Tokenizer.from_dir(_save(tmp_path / "b", _train_byte_level(), config))
    ids = tok.encode("hi")
    assert ids[0] != tok.bos_token_id and ids[-1] == tok.token_to_id("<|eos|>")
    assert tok.encode("hi", add_special_tokens=False) == ids[:-1]


def test_special_token_missing_from_tokenizer_json_is_added(tmp_path: Path) -> None:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|im_end|>",
        "additional_special_tokens": ["<|im_start|>"],
    }
    folder = _save(tmp_path / "m", _train_byte_level(), config)
    tok = Tokenizer.from_dir(folder)
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text) == auto(text).input_ids
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    assert tok.decode(tok.encode(text)) == "user\nhi"


def test_chat_template_file_wins(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", _train_byte_level(), {"chat_template": "from config"})
    assert Tokenizer.from_dir(folder).chat_template == "from config"
    (folder / "chat_template.jinja").write_text("from file", encoding="utf-8")
    assert Tokenizer.from_dir(folder).chat_template == "from file"


def test_named_chat_templates(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    folder = _save(tmp_path / "m", _train_byte_level(), {"chat_template": templates})
    assert Tokenizer.from_dir(folder).chat_template == "d"


def test_minimal_folder_without_configs(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    _train_byte_level().save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_dir(folder)
    assert tok.bos_token_id is None and tok.eos_token_ids == () and tok.chat_template is None
    assert tok.decode(tok.encode("héllo 😀")) == "héllo 😀"


def test_missing_tokenizer_json_is_a_one_line_error(tmp_path: Path) -> None:
    folder = tmp_path / "no-tokenizer-here"
    folder.mkdir()
    with pytest.raises(MlcrunError) as info:
        Tokenizer.from_dir(folder)
    message = str(info.value)
    assert "no-tokenizer-here" in message and "tokenizer.json" in message
    assert "\n" not in message


def test_truncation_in_tokenizer_json_is_ignored(tmp_path: Path) -> None:
    backend = _train_byte_level()
    backend.enable_truncation(max_length=4)
    tok = Tokenizer.from_dir(_save(tmp_path / "m", backend, {}))
    assert len(tok.encode("The quick brown fox jumps over the lazy dog.")) > 4


def test_tokenizer_files_names() -> None:
    assert TOKENIZER_FILES[0] == "tokenizer.json"
    for name in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert name in TOKENIZER_FILES


def _phi3_style(folder: Path, legacy: bool | None) -> Path:
    """The SentencePiece-style BPE with Phi-3's tokenizer.json text handling (a `Prepend "▁"`
    + `Replace " " -> "▁"` normalizer, no pre-tokenizer), chat markers as special tokens, and
    a `LlamaTokenizer` tokenizer_config.json (`legacy` as given; absent means false)."""
    data = json.loads(_train_sentencepiece_style().to_str())
    data["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    data["pre_tokenizer"] = None
    backend = HFTokenizer.from_str(json.dumps(data))
    backend.add_special_tokens(["<|user|>", "<|end|>", "<|assistant|>"])
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
    }
    if legacy is not None:
        config["legacy"] = legacy
    return _save(folder, backend, config)


@pytest.mark.parametrize("legacy", [False, None, True])
def test_llama_class_follows_transformers_not_tokenizer_json(tmp_path: Path, legacy) -> None:
    """transformers 5 rebuilds a LlamaTokenizer's text handling: with legacy false (or absent)
    no "▁" goes in front of text after a special token, which tokenizer.json's Prepend
    normalizer would add (Phi-3's chat prompts differed at the second id)."""
    folder = _phi3_style(tmp_path / "phi3", legacy)
    ours = Tokenizer.from_dir(folder)
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    chat = "<|user|>\nthe quick brown fox<|end|>\n<|assistant|>"
    raw = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    if not legacy:  # the case that differs from tokenizer.json
        assert auto.encode(chat) != raw.encode(chat).ids
    for text in [chat, *TEXTS, "<|user|>the<|end|> the", " two  spaces "]:
        ids = ours.encode(text)
        assert ids == auto.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip) == auto.decode(ids, skip_special_tokens=skip), text
