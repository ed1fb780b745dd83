"""Render a model's chat template exactly as transformers' `apply_chat_template` does.

Same jinja2 environment settings (sandboxed, trim_blocks, lstrip_blocks, loop controls), the
same globals (`raise_exception`, `strftime_now`), the same `tojson` filter, and the same
variables (`messages`, `add_generation_prompt`, the special tokens as strings). Models without a
template get `FALLBACK_TEMPLATE`, a plain, documented format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import MlcrunError

# No template: "<role>: <content>" blocks, then "assistant:" for the answer.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")


class TemplateError(MlcrunError):
    """The template itself raised (e.g. it rejects the conversation's roles)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise MlcrunError(f"chat template does not parse: {err}") from None


def validate_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise MlcrunError(f"messages[{i}]: needs 'role' and 'content'")
        if m["role"] not in ROLES:
            raise MlcrunError(f"messages[{i}].role: {m['role']!r} is not one of {ROLES}")
        out.append(dict(m))
    return out


def render(
    template: str | None,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text; tokenize it without adding special tokens (the template has them).
    `tools` (JSON-schema function descriptions) and `template_kwargs` (e.g. enable_thinking)
    reach the template as transformers' apply_chat_template passes them."""
    compiled = _compile(template or FALLBACK_TEMPLATE)
    messages = validate_messages(messages)
    context = {**(template_kwargs or {}), **(special_tokens or {})}
    if tools is not None:
        context["tools"] = list(tools)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except TemplateError as err:
        raise TemplateError(_one_line(str(err))) from None
    except Exception as err:
        # The template is the model's code, run on the caller's messages: whatever it raises
        # (UndefinedError, but also TypeError, ZeroDivisionError, RecursionError...) means it
        # cannot render this conversation, not that mlcrun is broken.
        detail = f"{type(err).__name__}: {_one_line(str(err))}"
        raise MlcrunError(f"chat template failed: {detail}") from None


def _one_line(text: str, limit: int = 300) -> str:
    """An error message on one line, cut: templates may put message content in it."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
