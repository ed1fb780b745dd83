"""The OpenAI request schema (pydantic, only here at the HTTP edge) and its conversion to
engine types. Types are checked by pydantic; values by SamplingParams, whose errors name the
field. Unknown request fields are ignored, as most OpenAI-compatible servers do, except the
ones whose silent omission would change the meaning of a request (tools, suffix, best_of).

Checks here run before a prompt is tokenized, so that a bad request costs little: text that is
not valid Unicode, the size of stop/stop_token_ids/logit_bias, and logit_bias keys."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.types import SamplingParams
from ..errors import MlcrunError

MAX_N = 128
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
MAX_STOP = 4  # stop strings, as OpenAI
MAX_STOP_CHARS = 256  # each is matched against the text after every token
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_TOKEN_ID_DIGITS = 18  # longer keys name no token (and int() refuses over 4300 digits)


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_FIELD = re.compile(r"^(?:unknown sampling parameter\(s\): )?([a-z_]+)")


def bad_value(err: MlcrunError) -> APIError:
    """A 400 for an engine validation error; its message starts with the field's name."""
    match = _FIELD.match(str(err))
    return APIError(400, str(err), param=match.group(1) if match else None)


def _show(value: str, limit: int = 40) -> str:
    """A user-given string for an error message: repr'd, and cut if long."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."


# JSON "\ud800" (or UTF-8 bytes of a surrogate) decodes to a str that cannot be encoded back:
# it would fail later, in the tokenizer or while writing the answer, as a 500.
_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset((int, float, bool, type(None)))


def check_text(value: Any, param: str) -> None:
    """A 400 naming the first string (or dict key) in `value` with a lone UTF-16 surrogate."""
    if isinstance(value, str):
        found = None if value.isascii() else _SURROGATE.search(value)
        if found:
            raise APIError(
                400,
                f"{param}: lone UTF-16 surrogate U+{ord(found.group()):04X} at index "
                f"{found.start()}; text must be valid Unicode",
                param=param,
            )
    elif isinstance(value, BaseModel):
        for name, field in type(value).model_fields.items():
            key = field.alias or name
            check_text(getattr(value, name), f"{param}.{key}" if param else key)
    elif isinstance(value, (list, tuple)):
        if set(map(type, value)) <= _SCALARS:  # token ids: skipped without a Python loop
            return
        for i, item in enumerate(value):
            check_text(item, f"{param}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, param)
            check_text(item, f"{param}.{key}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    def check_text(self) -> None:
        """Every string of the request is valid Unicode (see `check_text`)."""
        check_text(self, "")


class StreamOptions(_Model):
    include_usage: bool = False


class JsonSchemaFormat(_Model):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Model):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None

    def check(self) -> None:
        """Size limits and logit_bias keys (which the engine's int() parsing must not see)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} strings, got {len(stop)}", param="stop")
        long = next((s for s in stop if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise APIError(
                400,
                f"stop: each string is at most {MAX_STOP_CHARS} characters, got {len(long)}",
                param="stop",
            )
        ids = self.stop_token_ids or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise APIError(
                400,
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                param="stop_token_ids",
            )
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise APIError(
                400,
                f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
                param="logit_bias",
            )
        for key in bias:
            # str.isdigit() also accepts "²" and other digits that int() refuses
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise APIError(
                    400,
                    f"logit_bias: keys must be token ids (decimal integers), got {_show(key)}",
                    param="logit_bias",
                )

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        """The request's sampling; what it leaves out comes from `defaults` (the model's
        generation_config.json), then from SamplingParams."""
        given = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "frequency_penalty",
                "presence_penalty",
                "repetition_penalty",
            )
            if getattr(self, name) is not None
        }
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                logprobs=logprobs,
                n=self.n,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                logit_bias=self.logit_bias or {},
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                **{**(defaults or {}), **given},
            )
        except MlcrunError as err:
            raise bad_value(err) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")
        if self.echo and self.logprobs is not None:
            raise APIError(
                400, "echo with logprobs is not supported (no prompt logprobs)", param="echo"
            )


class TextPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}

    def check(self) -> None:
        super().check()
        if self.functions:
            raise APIError(
                400, "functions is deprecated and not supported: use tools", param="functions"
            )
        if self.tool_choice is not None or self.tools:
            from .tools import tool_request

            tool_request(self.tools, self.tool_choice)  # 400s name the field
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise APIError(
                400,
                f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}",
                param="max_completion_tokens",
            )

    @property
    def asked_max_tokens(self) -> tuple[int | None, str]:
        """The completion budget asked for and the field that asked: max_completion_tokens
        (OpenAI's current name) wins over max_tokens; 0 is a value, not "unset"."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def plain_messages(self) -> list[dict[str, Any]]:
        return plain_messages(self.messages)

    @property
    def tool_request(self):
        """The checked tools and tool_choice (tools.ToolRequest), or None."""
        from .tools import tool_request

        return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


def plain_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates expect them: {"role", "content"} with text content; an
    assistant's `tool_calls` with their arguments as objects (OpenAI sends JSON text, the
    templates of the model families write them out with `tojson`), a tool message's
    `tool_call_id` (and `name`)."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(
                400,
                f"messages[{i}].role: {_show(m.role)} is not one of system, user, assistant, tool",
                param=f"messages[{i}].role",
            )
        content = m.content
        if content is None and not (role == "assistant" and m.tool_calls):
            raise APIError(
                400, f"messages[{i}].content is required", param=f"messages[{i}].content"
            )
        if content is not None and not isinstance(content, str):
            bad = [p.type for p in content if p.type != "text" or p.text is None]
            if bad:
                raise APIError(
                    400,
                    f"messages[{i}].content: only text parts are supported, got {_show(bad[0])}",
                    param=f"messages[{i}].content",
                )
            content = "\n".join(p.text or "" for p in content)
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.tool_calls:
            message["tool_calls"] = [_template_call(c, i, j) for j, c in enumerate(m.tool_calls)]
        if role == "tool":
            if m.tool_call_id is None:
                raise APIError(
                    400,
                    f"messages[{i}].tool_call_id is required in a tool message",
                    param=f"messages[{i}].tool_call_id",
                )
            message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
        out.append(message)
    return out


def _template_call(call: dict[str, Any], i: int, j: int) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where}.function.name is required", param=where)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise APIError(400, f"{where}.function.arguments is not JSON", param=where) from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if "id" in call:
        out["id"] = call["id"]
    return out
