"""Structured output with llguidance: `response_format` -> a per-choice token constraint.

The engine asks a constraint for the allowed tokens before each sample of a constrained request
(the mask is applied in the sampler for that row only) and advances it with the sampled token;
a complete grammar stops the request. JSON is generated compactly (no free whitespace), so a
model cannot pad an answer with whitespace until it runs out of tokens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ..tokenizer import Tokenizer
from .protocol import APIError, ResponseFormat

log = logging.getLogger(__name__)

_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarConstraint:
    """One choice's grammar state (an llguidance LLMatcher); implements TokenConstraint."""

    def __init__(self, matcher, eos_token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = list(eos_token_ids)

    def allowed(self, vocab_size: int) -> np.ndarray:
        """Runs in the engine thread: it must not raise (that would fail the whole batch)."""
        m = self.matcher
        try:
            bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
            mask = np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)  # [V]
            mask = np.pad(mask, (0, vocab_size - mask.size))
            if not m.is_error() and mask.any():
                return mask
            log.warning("grammar error: %s", m.get_error() or "no token allowed")
        except Exception:
            log.exception("grammar mask failed")
        mask = np.zeros(vocab_size, dtype=bool)  # end the answer: only EOS
        mask[[t for t in self.eos_token_ids if t < vocab_size]] = True
        if not mask.any():  # no EOS: any token; accept() then ends the request
            mask[:] = True
        return mask

    def accept(self, token: int) -> bool:
        m = self.matcher
        try:
            if m.consume_token(int(token)):
                return m.is_stopped()
            log.warning("grammar rejected token %d: %s", token, m.get_error())
        except Exception:
            log.exception("grammar failed to advance")
        return True


class SchemaConstraints:
    """A factory of fresh constraints (one per choice) to JSON matching `schema`. It keeps the
    schema it was compiled from, so that another process (a Ray Serve engine replica) can
    compile it again with its own `Grammars` (a compiled matcher does not cross processes)."""

    def __init__(self, schema: dict | bool, param: str, first, eos_token_ids: Sequence[int]):
        self.schema, self.param = schema, param
        self._first, self._eos = first, list(eos_token_ids)

    def __call__(self) -> GrammarConstraint:
        return GrammarConstraint(self._first.deep_copy(), self._eos)


class Grammars:
    """Compiles response formats for one tokenizer; the llguidance tokenizer is built once,
    on first use (about a second for a 150k vocabulary)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll = None
        self._ll_error: str | None = None
        self._bytes: dict[int, bytes] = {}

    def warm_up(self) -> None:
        """Build the llguidance tokenizer now (call in a thread at startup)."""
        if self.tokenizer is not None:
            with contextlib.suppress(APIError):
                self.ll_tokenizer()

    def ll_tokenizer(self):
        """The llguidance tokenizer; raises APIError when it cannot describe this one."""
        with self._lock:
            if self._ll is None and self._ll_error is None:
                try:
                    import llguidance

                    self._ll = llguidance.LLTokenizer(
                        self.tokenizer.backend.to_str(),
                        n_vocab=self.vocab_size,
                        eos_token=self.eos_token_ids or None,
                    )
                except Exception as err:  # ImportError, or a tokenizer llguidance can't read
                    self._ll_error = f"{type(err).__name__}: {err}"
                    log.warning("structured output unavailable: %s", self._ll_error)
            if self._ll is None:
                raise APIError(
                    400,
                    f"response_format is unavailable for this model ({self._ll_error})",
                    param="response_format",
                )
            return self._ll

    def constraint(self, fmt: ResponseFormat | None) -> Callable[[], GrammarConstraint] | None:
        """A factory of fresh constraints (one per choice), or None for plain text."""
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            schema: dict | bool = {"type": "object"}
        elif fmt.json_schema is None:
            raise APIError(400, "response_format.json_schema is required", param="response_format")
        else:
            schema = fmt.json_schema.schema_
        return self.schema_constraint(schema, "response_format")

    def schema_constraint(self, schema: dict | bool, param: str) -> SchemaConstraints:
        """A factory of constraints to JSON matching `schema` (errors name `param`)."""
        if self.tokenizer is None:
            raise APIError(400, f"{param} needs a tokenizer", param=param)
        ll = self.ll_tokenizer()
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), overrides=_JSON_OPTIONS
            )
        except Exception as err:  # ValueError for a schema that is not JSON-like
            message = f"{param}: {str(err).strip().splitlines()[0][:500]}"
            raise APIError(400, message, param=param) from None
        first = llguidance.LLMatcher(ll, grammar, log_level=0)
        if first.is_error():
            message = first.get_error().splitlines()[0][:500]
            message = f"{param}: schema not supported: {message}"
            raise APIError(400, message, param=param)
        return SchemaConstraints(schema, param, first, self.eos_token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (exact for byte-level BPE pieces of a character)."""
        cached = self._bytes.get(token_id)
        if cached is None:
            if self.tokenizer is None or token_id >= self.tokenizer.vocab_size:
                cached = b""  # ids the model has but the tokenizer does not decode to nothing
            else:
                try:
                    cached = self.ll_tokenizer().decode_bytes([token_id])
                except APIError:  # llguidance does not know this tokenizer: plain decode
                    cached = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
            self._bytes[token_id] = cached
        return cached

    def token_str(self, token_id: int) -> str:
        """The token as text; a piece of a UTF-8 character is written "bytes:\\xe2\\x80" (as
        OpenAI does), so that distinct tokens keep distinct strings."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
