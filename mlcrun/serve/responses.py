"""OpenAI response bodies and server-sent-event streams for completions and chat completions.

A call runs its prompts through `Service.generate` and shapes what comes out: `collect()` for
one JSON body, `stream()` for SSE chunks ending in `data: [DONE]`. Choice i of prompt p has
index p * n + i, as in OpenAI's API.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from ..engine.types import RequestOutput
from ..errors import MlcrunError
from .protocol import APIError, error_body
from .service import Prompt, Service, Ticket, usage
from .tools import (
    ReasoningStream,
    ToolCall,
    ToolStream,
    family_of,
    parse,
    split_reasoning,
    thinks,
)

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
FINGERPRINT = "mlcrun"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Call:
    kind = ""  # "text_completion" | "chat.completion"
    prefix = ""

    def __init__(self, service: Service, request, prompts: list[Prompt], params, constraint,
                 ticket: Ticket, state: Any = None) -> None:  # fmt: skip
        self.svc, self.req, self.prompts = service, request, prompts
        self.params, self.constraint, self.ticket = params, constraint, ticket
        self.state = state  # the HTTP request's state: gets a summary for the access log
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.finals: dict[int, RequestOutput] = {}

    def index(self, i: int, out: RequestOutput) -> int:
        return i * self.params.n + out.index

    def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self.svc.generate(self.prompts, self.params, self.constraint, self.ticket)

    def head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.svc.options.model_name,
            "system_fingerprint": FINGERPRINT,
        }

    def usage(self) -> dict[str, Any]:
        finals = [self.finals[k] for k in sorted(self.finals)]
        u = usage(self.prompts, finals)
        if self.state is not None:
            reasons = ",".join(sorted({str(o.finish_reason) for o in finals}))
            self.state.summary = (
                f"prompt={u['prompt_tokens']} completion={u['completion_tokens']} "
                f"cached={u['prompt_tokens_details']['cached_tokens']} finish={reasons}"
            )
        return u

    async def collect(self) -> dict[str, Any]:
        async with aclosing(self.outputs()) as outputs:
            async for i, out in outputs:
                if out.finished:
                    self.finals[self.index(i, out)] = out
        choices = [self.choice(k, self.finals[k]) for k in sorted(self.finals)]
        return {**self.head(self.kind), "choices": choices, "usage": self.usage()}

    async def stream(self) -> AsyncIterator[str]:
        chunk_head = self.head(self.kind + ("" if self.kind == "text_completion" else ".chunk"))
        extra = {"usage": None} if self.req.include_usage else {}
        try:
            for body in self.start():
                yield sse({**chunk_head, "choices": [body], **extra})
            async with aclosing(self.outputs()) as outputs:
                async for i, out in outputs:
                    k = self.index(i, out)
                    for body in self.delta(k, out):
                        yield sse({**chunk_head, "choices": [body], **extra})
                    if out.finished:
                        self.finals[k] = out
            if self.req.include_usage:
                yield sse({**chunk_head, "choices": [], "usage": self.usage()})
            else:
                self.usage()
        except APIError as err:  # headers are sent: the error goes in the stream
            yield sse(err.body())
        except Exception as err:
            if not isinstance(err, MlcrunError):
                log.exception("generation failed")
            yield sse(error_body(f"generation failed: {err}", "server_error"))
        except BaseException:  # cancelled: the client went away (its requests are aborted)
            if self.state is not None:
                self.state.summary = "client disconnected: aborted"
            raise
        yield DONE

    def start(self) -> list[dict[str, Any]]:
        return []

    def choice(self, k: int, out: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, k: int, out: RequestOutput) -> list[dict[str, Any]]:
        raise NotImplementedError

    def new_logprobs(self, out: RequestOutput) -> tuple[list[int], list[dict[int, float]]]:
        """The tokens of this output's delta and their logprobs (empty when not asked)."""
        if out.logprobs is None:
            return [], []
        new = len(out.delta_token_ids)
        start = len(out.token_ids) - new
        return out.token_ids[start:], out.logprobs[start : start + new]


class CompletionCall(_Call):
    kind, prefix = "text_completion", "cmpl"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offsets: dict[int, int] = {}  # choice -> text offset of its next token
        self.echoed: set[int] = set()

    def echo_text(self, k: int) -> str:
        if not self.req.echo or k in self.echoed:
            return ""
        self.echoed.add(k)
        p = self.prompts[k // self.params.n]
        if p.text is None:
            p.text = self.svc.need_tokenizer("echo").decode(p.ids)
        return p.text

    def logprobs(self, k: int, ids: list[int], lps: list[dict[int, float]]) -> dict | None:
        if self.req.logprobs is None:
            return None
        token = self.svc.grammars.token_str
        tokens = [token(t) for t in ids]
        offsets, at = [], self.offsets.get(k, 0)
        for s in tokens:
            offsets.append(at)
            at += len(s)
        self.offsets[k] = at
        return {
            "tokens": tokens,
            "token_logprobs": [lp[t] for t, lp in zip(ids, lps)],
            "top_logprobs": [{token(t): v for t, v in _ranked(lp)} for lp in lps],
            "text_offset": offsets,
        }

    def choice(self, k: int, out: RequestOutput) -> dict[str, Any]:
        text = self.echo_text(k) + out.text
        self.offsets[k] = len(text) - len(out.text)
        return {
            "index": k,
            "text": text,
            "logprobs": self.logprobs(k, out.token_ids, out.logprobs or []),
            "finish_reason": out.finish_reason,
        }

    def delta(self, k: int, out: RequestOutput) -> list[dict[str, Any]]:
        text = self.echo_text(k)
        if text:
            self.offsets[k] = len(text)
        text += out.delta_text
        ids, lps = self.new_logprobs(out)
        if not (text or ids or out.finished):
            return []
        return [
            {
                "index": k,
                "text": text,
                "logprobs": self.logprobs(k, ids, lps),
                "finish_reason": out.finish_reason,
            }
        ]


class ChatCall(_Call):
    kind, prefix = "chat.completion", "chatcmpl"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tools = self.req.tool_request  # None, or what tool_choice asks (serve/tools.py)
        template = self.svc.tokenizer.chat_template if self.svc.tokenizer else None
        self.family = family_of(template)
        self.think = thinks(template)  # Qwen3: <think>...</think> -> reasoning_content
        self.streams: dict[int, ToolStream] = {}
        self.reasoning: dict[int, ReasoningStream] = {}

    def answer(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished answer (its reasoning taken out before)."""
        if self.tools is None or self.tools.choice == "none":
            return text, []
        if self.tools.constrained:
            return None, self.tools.read_constrained(text)
        return parse(self.family, text)

    def finish_reason(self, out: RequestOutput, calls: list[ToolCall]) -> str | None:
        return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason

    def logprobs(self, ids: list[int], lps: list[dict[int, float]]) -> dict | None:
        if self.req.engine_logprobs is None:
            return None
        top = self.req.engine_logprobs

        def entry(t: int, v: float) -> dict[str, Any]:
            raw = self.svc.grammars.token_bytes(t)
            return {"token": self.svc.grammars.token_str(t), "logprob": v, "bytes": list(raw)}

        return {
            "content": [
                {**entry(t, lp[t]), "top_logprobs": [entry(a, v) for a, v in _ranked(lp)[:top]]}
                for t, lp in zip(ids, lps)
            ]
        }

    def choice(self, k: int, out: RequestOutput) -> dict[str, Any]:
        reasoning, text = split_reasoning(out.text) if self.think else (None, out.text)
        content, calls = self.answer(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
        return {
            "index": k,
            "message": message,
            "logprobs": self.logprobs(out.token_ids, out.logprobs or []),
            "finish_reason": self.finish_reason(out, calls),
        }

    def start(self) -> list[dict[str, Any]]:
        total = len(self.prompts) * self.params.n
        return [
            {
                "index": k,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for k in range(total)
        ]

    def delta(self, k: int, out: RequestOutput) -> list[dict[str, Any]]:
        ids, lps = self.new_logprobs(out)
        text, calls, bodies = out.delta_text, [], []
        if self.think:
            thought, text = self.reasoning.setdefault(k, ReasoningStream()).feed(text)
            if thought:
                bodies.append(
                    {
                        "index": k,
                        "delta": {"reasoning_content": thought},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
        if self.tools is not None and self.tools.choice != "none":
            stream = self.streams.setdefault(k, ToolStream(self.family))
            if self.tools.constrained:  # JSON by construction: sent as calls at the end
                stream.text += text
                text = ""
                if out.finished:
                    calls = self.tools.read_constrained(stream.text)
            else:
                text = stream.feed(text)
                if out.finished:
                    rest, calls = stream.finish()
                    text += rest
        if text or ids:
            bodies.append(
                {
                    "index": k,
                    "delta": {"content": text},
                    "logprobs": self.logprobs(ids, lps),
                    "finish_reason": None,
                }
            )
        if calls:
            bodies.append(
                {
                    "index": k,
                    "delta": {"tool_calls": [c.as_dict(i) for i, c in enumerate(calls)]},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        if out.finished:
            reason = self.finish_reason(out, calls)
            bodies.append({"index": k, "delta": {}, "logprobs": None, "finish_reason": reason})
        return bodies


def _ranked(lp: dict[int, float]) -> list[tuple[int, float]]:
    """A position's logprobs, most likely first."""
    return sorted(lp.items(), key=lambda kv: -kv[1])
