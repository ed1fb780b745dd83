"""Tokenizer over the HF `tokenizers` library, plus a streaming detokenizer.

The checkpoint's `tokenizer.json` is used as serialized; on top of it we apply the two things
transformers layers over it from `tokenizer_config.json` when loading a folder:

- an explicit `add_bos_token` / `add_eos_token` there replaces the post-processor with
  `[bos] $A [eos]` (as `TokenizersBackend.update_post_processor` does); without those keys the
  tokenizer.json post-processor (which usually adds BOS) is kept;
- named special tokens (bos/eos/unk/pad, `additional_special_tokens`, `added_tokens_decoder`)
  missing from tokenizer.json's added tokens are added as special tokens.

- a `LlamaTokenizer`-class BPE tokenizer gets the normalizer, pre-tokenizer and decoder
  transformers 5 builds for that class instead of tokenizer.json's (`legacy: false`, its
  default, prepends "▁" only to the text's first piece, not after special tokens; Phi-3's
  tokenizer.json says otherwise with a `Prepend` normalizer, and transformers 5 wins).

transformers is never imported here.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

# Re-exported: the list lives with the artifact layout, which the compiler may import.
from mlcrun.artifact import TOKENIZER_FILES as TOKENIZER_FILES
from mlcrun.artifact import chat_template_in as _chat_template
from mlcrun.errors import MlcrunError

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MlcrunError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise MlcrunError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_added_token(value: Any) -> AddedToken | None:
    """An AddedToken for a special token given as a string or as a serialized AddedToken."""
    content = _token_content(value)
    if content is None:
        return None
    if isinstance(value, dict):
        flags = ("single_word", "lstrip", "rstrip", "normalized")
        kwargs = {k: bool(value[k]) for k in flags if k in value}
        kwargs.setdefault("normalized", False)
        return AddedToken(content, special=bool(value.get("special", True)), **kwargs)
    return AddedToken(content, special=True, normalized=False)


def _int_ids(value: Any) -> list[int]:
    """`eos_token_id`-style values: an int, a list of ints, or null."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


_LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")


def _rebuild_llama_class(backend: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
    """transformers 5 builds a `LlamaTokenizer`-class tokenizer's text handling itself rather
    than taking tokenizer.json's: no normalizer, a Metaspace pre-tokenizer that prepends "▁"
    to the first piece only unless `legacy` is true (after a special token, "first" adds none:
    Phi-3's `<|user|>\nHi` differs at the second id from the Prepend normalizer's), and the
    matching decoder. Do the same for such a BPE (SentencePiece-style) tokenizer."""
    if config.get("tokenizer_class") not in _LLAMA_CLASSES:
        return
    if not isinstance(backend.model, tokenizers.models.BPE):
        return
    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if config.get("legacy", False) else "first") if prefix else "never"
    backend.normalizer = None
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    steps = [
        tokenizers.decoders.Replace("▁", " "),
        tokenizers.decoders.ByteFallback(),
        tokenizers.decoders.Fuse(),
    ]
    if prefix:
        steps.append(tokenizers.decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = tokenizers.decoders.Sequence(steps)


class Tokenizer:
    """Text <-> token ids for one checkpoint or artifact folder."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        """Wrap `backend`; token ids default to those of the named tokens.

        `eos_token_ids` are added to the id of `eos_token`; `bos_token_id` is used only when
        `bos_token` is unset or unknown to the vocabulary.
        """
        # Encoding must never truncate or pad, whatever tokenizer.json says (transformers
        # does neither unless asked to).
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        named_bos = None if bos_token is None else backend.token_to_id(bos_token)
        self._bos_token_id = named_bos if named_bos is not None else bos_token_id
        eos_ids = {int(i) for i in eos_token_ids}
        named_eos = None if eos_token is None else backend.token_to_id(eos_token)
        if named_eos is not None:
            eos_ids.add(named_eos)
        self._eos_token_ids = tuple(sorted(eos_ids))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and the optional config files beside it."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise MlcrunError(f"no tokenizer.json in {folder}: cannot load a tokenizer from it")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise MlcrunError(f"cannot load {tokenizer_file}: {exc}") from exc

        config = _read_json(folder / "special_tokens_map.json")
        config.update(_read_json(folder / "tokenizer_config.json"))
        named = {key: _token_content(config.get(key)) for key in _NAMED_SPECIAL_TOKENS}
        _add_missing_special_tokens(backend, config)
        _rebuild_llama_class(backend, config)
        if "add_bos_token" in config or "add_eos_token" in config:
            _set_template_post_processor(
                backend,
                bos=named["bos_token"] if config.get("add_bos_token") else None,
                eos=named["eos_token"] if config.get("add_eos_token") else None,
            )

        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")
        eos_ids = _int_ids(generation.get("eos_token_id")) + _int_ids(
            model_config.get("eos_token_id")
        )
        bos_ids: list[int] = []
        if "bos_token" not in config:  # an explicit `"bos_token": null` means "none"
            bos_ids = _int_ids(generation.get("bos_token_id")) or _int_ids(
                model_config.get("bos_token_id")
            )
        return cls(
            backend,
            **named,
            bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_ids=eos_ids,
            chat_template=_chat_template(folder, config),
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (already adjusted as described above)."""
        return self._backend

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: tokenizer eos plus generation_config/config.json."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self._backend.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's vocab_size)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> frozenset[int]:
        added = self._backend.get_added_tokens_decoder()
        return frozenset(i for i, tok in added.items() if tok.special)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; with add_special_tokens the post-processor adds BOS etc."""
        # encode() holds the GIL for the whole call (seconds on a 4 MB prompt, stalling a
        # server's event loop even from a worker thread); encode_batch_fast releases it and
        # skips the offsets we never read. Same ids.
        batch = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Token ids (or the text) of a conversation, as transformers' apply_chat_template
        (`tools` and extra keyword arguments go to the template)."""
        from .chat_template import render

        text = render(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens={
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "unk_token": self.unk_token,
                "pad_token": self.pad_token,
            },
            tools=tools,
            template_kwargs=template_kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def stream(
        self, skip_special_tokens: bool = True, prefix_ids: Sequence[int] = ()
    ) -> StreamDecoder:
        """A fresh incremental detokenizer; see `StreamDecoder`."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens, prefix_ids=prefix_ids)


def _add_missing_special_tokens(backend: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
    """Register special tokens named in tokenizer_config.json that tokenizer.json lacks."""
    present = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    candidates: list[Any] = [config.get(key) for key in _NAMED_SPECIAL_TOKENS]
    candidates += list(config.get("additional_special_tokens") or [])
    decoder = config.get("added_tokens_decoder") or {}
    candidates += [v for _, v in sorted(decoder.items(), key=lambda kv: int(kv[0]))]
    missing: list[AddedToken] = []
    for value in candidates:
        token = _as_added_token(value)
        if token is not None and token.content not in present:
            present.add(token.content)
            missing.append(token)
    if missing:
        logger.debug("adding tokens missing from tokenizer.json: %s", missing)
        backend.add_special_tokens([t for t in missing if t.special])
        backend.add_tokens([t for t in missing if not t.special])


def _set_template_post_processor(
    backend: tokenizers.Tokenizer, bos: str | None, eos: str | None
) -> None:
    """`[bos] $A [eos]`, leaving out a token that is unset or unknown to the vocabulary."""
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    specials = [(t, i) for t, i in specials if i is not None]
    known = {t for t, _ in specials}
    head = f"{bos}:0 " if bos in known else ""
    tail = f" {eos}:0" if eos in known else ""
    head_b = f" {bos}:1" if bos in known else ""
    tail_b = f" {eos}:1" if eos in known else ""
    backend.post_processor = processors.TemplateProcessing(
        single=f"{head}$A:0{tail}",
        pair=f"{head}$A:0{tail}{head_b} $B:1{tail_b}",
        special_tokens=specials,
    )


class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get the new text back.

    Prefix-offset technique: decode a small window of already-emitted tokens ("prefix") with
    and without the new tokens and return the difference, so that decoders which depend on
    the neighbouring token (SentencePiece's leading-space strip, byte-fallback `<0xNN>`
    tokens, byte-level BPE pieces of one character) come out as in a full decode. Text is held
    back while it ends in U+FFFD (an incomplete UTF-8 sequence); `finish()` flushes it.
    Concatenating every `add` result plus `finish()` gives
    `decode(prefix_ids + ids)[len(decode(prefix_ids)):]`, i.e. `decode(ids)` without prefix.

    One exception, for invalid UTF-8 only: the ByteFallback decoder turns a whole run of
    `<0xNN>` tokens into U+FFFDs when any byte in it is invalid, so ASCII byte tokens already
    streamed before a later bad byte come out in the stream but not in `decode`. Byte-level
    (GPT-2 style) decoding has no such effect.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prefix_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prefix_ids)
        self._prefix_offset = 0  # start of the context window
        self._read_offset = len(self._ids)  # tokens before this have been emitted

    @property
    def token_ids(self) -> list[int]:
        """Every id fed so far (prefix ids first)."""
        return list(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _delta(self, flush: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not flush:
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""
        if not new_text.startswith(prefix_text):
            # A decoder whose output for the window is not prefix-stable (never seen with
            # BPE/SentencePiece decoders): fall back to diffing decodes from the window start.
            logger.debug("stream decode window not prefix-stable: %r / %r", prefix_text, new_text)
            prefix_text = os.path.commonprefix([prefix_text, new_text])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text it completes ("" while held back)."""
        self._ids.append(int(token_id))
        return self._delta(flush=False)

    def finish(self) -> str:
        """Whatever was held back (e.g. a trailing incomplete UTF-8 sequence, as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._delta(flush=True)
