"""A conversation with a model: chat template, history, context-window trimming, streaming.

The interactive REPL, one-shot `--prompt` and piped stdin all go through `Conversation`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from .engine.types import RequestOutput, SamplingParams
from .errors import MlcrunError
from .llm import LLM

log = logging.getLogger(__name__)


@dataclass
class Turn:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft: float | None
    decode_tokens_per_s: float | None
    prefill_tokens_per_s: float | None
    draft_tokens: int = 0  # speculative decoding: tokens drafted and accepted
    accepted_tokens: int = 0
    mean_accepted_length: float | None = None  # tokens per speculative step

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def as_json(self) -> str:
        speculation = {
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }
        return json.dumps(
            {
                "text": self.text,
                "finish_reason": self.finish_reason,
                "usage": {
                    "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens,
                    "cached_tokens": self.cached_tokens,
                },
                "timings": {
                    "ttft_s": self.ttft,
                    "decode_tokens_per_s": self.decode_tokens_per_s,
                    "prefill_tokens_per_s": self.prefill_tokens_per_s,
                },
                **({"speculation": speculation} if self.draft_tokens else {}),
            }
        )


@dataclass
class Conversation:
    llm: LLM
    params: SamplingParams
    system: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    last: Turn | None = None
    raw: bool = False  # continue each prompt as plain text: no chat template, no history

    def reset(self) -> None:
        self.messages = []

    def _all_messages(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def _prompt_ids(self) -> list[int]:
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise MlcrunError("this model has no tokenizer; chat needs one")
        window = self.llm.model.artifact.context_window
        if self.raw:
            ids = tokenizer.encode(self.messages[-1]["content"])
            if len(ids) >= window:
                raise MlcrunError(
                    f"this prompt is {len(ids)} tokens, over the context window ({window})"
                )
            return ids
        while True:
            ids = tokenizer.apply_chat_template(self._all_messages(), add_generation_prompt=True)
            if len(ids) + min(self.params.max_tokens, 64) < window or len(self.messages) <= 1:
                break
            # Drop the oldest exchange (user + assistant) to fit the context window.
            drop = 2 if len(self.messages) > 2 else 1
            self.messages = self.messages[drop:]
            self.notices.append("dropped the oldest turn to fit the context window")
        if len(ids) >= window:
            raise MlcrunError(
                f"this message alone is {len(ids)} tokens, over the context window ({window})"
            )
        return ids

    def ask(self, text: str) -> Iterator[str]:
        """Send a user message; yields the answer's text as it streams."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self._prompt_ids()
        except MlcrunError:
            self.messages.pop()
            raise
        window = self.llm.model.artifact.context_window
        max_tokens = min(self.params.max_tokens, window - len(ids))
        min_tokens = min(self.params.min_tokens, max_tokens)  # the window caps both
        params = replace(self.params, max_tokens=max_tokens, min_tokens=min_tokens)
        final: RequestOutput | None = None
        answer = []
        stream = self.llm.stream([ids], params)  # held here, so it outlives the loop
        try:
            for out in stream:
                answer.append(out.delta_text)
                final = out
                if out.delta_text:
                    yield out.delta_text
        finally:
            text = "".join(answer)
            if final is not None and not final.finished:
                # Stopped (the caller closed us: Ctrl-C in the REPL). Abort the request here,
                # rather than leave it to the stream, to keep its final output: the timings.
                for out in self.llm.engine.abort(final.request_id):
                    if out.index == final.index:
                        final = out
            stream.close()
            if self.raw:
                self.messages = []
            else:
                self.messages.append({"role": "assistant", "content": text})
            if final is not None:
                m = final.metrics
                self.last = Turn(
                    text,
                    final.finish_reason,
                    len(ids),
                    len(final.token_ids),
                    m.cached_tokens if m else 0,
                    m.ttft if m else None,
                    m.decode_tokens_per_s if m else None,
                    m.prefill_tokens_per_s if m else None,
                    m.draft_tokens if m else 0,
                    m.accepted_tokens if m else 0,
                    m.mean_accepted_length if m else None,
                )

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"messages": self._all_messages()}, f, indent=2, ensure_ascii=False)
