"""Tool calls in /v1/chat/completions: the tools go to the model's own chat template, and its
answer is read back as OpenAI `tool_calls`.

Three output formats, told apart by the chat template that asked for them:

* `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, after optional text;
* `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the marker is a special
  token, so the JSON list alone is accepted too);
* `llama3` (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}` (several
  separated by ";"), optionally after `<|python_tag|>`.

`tool_choice` "auto" parses whatever the model wrote; "required" and a named function
constrain the answer with llguidance to JSON that matches the functions' parameter schemas
(an array of {"name", "parameters"} objects, or the named function's arguments), as vLLM does;
"none" renders the tools and parses nothing.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from .protocol import APIError

_ALNUM = string.ascii_letters + string.digits
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def family_of(template: str | None) -> str | None:
    """The tool-call format a chat template asks the model for, or None."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return "llama3"
    return None


def call_id() -> str:
    """9 letters and digits: Mistral's templates refuse any other id."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def _calls(objects: list, args_key: str) -> list[ToolCall]:
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(obj["name"], text, call_id()))
    return calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse(family: str | None, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished answer; no calls: the text as it is."""
    if family == "hermes" and "<tool_call>" in text:
        objects = [_json(m.group(1)) for m in _HERMES.finditer(text)]
        calls = _calls(objects, "arguments")
        if calls:
            return text[: text.index("<tool_call>")].strip() or None, calls
    if family == "mistral":
        head, marker, tail = text.partition("[TOOL_CALLS]")
        payload = tail if marker else text
        objects = _json(payload.strip())
        if isinstance(objects, dict):
            objects = [objects]
        if isinstance(objects, list) and (marker or payload.strip().startswith("[")):
            calls = _calls(objects, "arguments")
            if calls:
                return (head.strip() or None) if marker else None, calls
    if family == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            objects = [_json(part) for part in body.split(";")] if ";" in body else [_json(body)]
            if any(o is None for o in objects):
                objects = [_json(body)]
            calls = _calls(objects, "parameters")
            if calls:
                return None, calls
    return text, []


class ToolStream:
    """Streaming for tool_choice "auto": content goes out as it comes, except what may be the
    start of a tool call (a marker's prefix, or for llama3 an answer that opens with "{"),
    which is held until the answer is finished and parsed."""

    def __init__(self, family: str | None) -> None:
        self.family = family
        self.marker = MARKERS.get(family or "")
        self.text = ""
        self.sent = 0
        self.in_call = False
        self.plain = False  # llama3: the answer is text, not a call

    def feed(self, delta: str) -> str:
        """The content that can be sent now."""
        self.text += delta
        if self.in_call or self.family is None:
            return "" if self.in_call else self._flush(len(self.text))
        if self.family == "llama3":  # a call is the whole answer: decide on its start
            if not self.plain:
                head = self.text.lstrip()
                if not head or "<|python_tag|>".startswith(head):
                    return ""  # nothing yet, or maybe the tag: wait
                self.in_call = head.startswith(("{", "<|python_tag|>"))
                self.plain = not self.in_call
                if self.in_call:
                    return ""
            return self._flush(len(self.text))
        found = self.text.find(self.marker, self.sent)
        if found >= 0:
            self.in_call = True
            return self._flush(found)
        safe = len(self.text)
        for n in range(min(len(self.marker) - 1, len(self.text)), 0, -1):
            if self.text.endswith(self.marker[:n]):
                safe -= n
                break
        return self._flush(safe)

    def _flush(self, upto: int) -> str:
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, tool calls) once the answer is complete."""
        content, calls = parse(self.family, self.text)
        if not calls:
            return self._flush(len(self.text)), []
        rest = (content or "")[self.sent :] if content else ""
        return rest, calls


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks about tools, checked."""

    tools: list[dict]  # as the template gets them: {"type": "function", "function": {...}}
    choice: str  # "auto" | "none" | "required" | "named"
    named: str | None = None
    parallel: bool = True  # parallel_tool_calls: false -> at most one call ("required")

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def schema(self) -> dict:
        """The JSON the answer must be when constrained."""
        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.choice == "named":
            return functions[self.named].get("parameters") or {"type": "object"}
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "parameters": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "parameters"],
            }
            for name, f in functions.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        return schema if self.parallel else {**schema, "maxItems": 1}

    def read_constrained(self, text: str) -> list[ToolCall]:
        """The calls in a constrained answer (JSON by construction; a cut-off one: none)."""
        value = _json(text)
        if value is None:
            return []
        if self.choice == "named":
            return [ToolCall(self.named, json.dumps(value, ensure_ascii=False), call_id())]
        return _calls(value if isinstance(value, list) else [], "parameters")


def tool_request(
    tools: list | None, choice: Any, parallel: bool | None = None
) -> ToolRequest | None:
    """Check `tools` and `tool_choice` (400s naming the field); None when there are none."""
    if choice is None:
        choice = "auto" if tools else "none"
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(named, str):
            raise APIError(
                400,
                'tool_choice: expected "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, f"tool_choice: unknown value {choice!r}", param="tool_choice")
    if not tools:
        if choice in ("required", "named"):
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        return None
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
            raise APIError(
                400,
                f'tools[{i}]: expected {{"type": "function", "function": {{...}}}}',
                param="tools",
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}].function.name is required", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(
                400,
                f"tools[{i}].function.parameters must be a JSON schema object",
                param="tools",
            )
        names.append(fn["name"])
    if named is not None and named not in names:
        raise APIError(400, f"tool_choice: no tool named {named!r}", param="tool_choice")
    return ToolRequest(list(tools), choice, named, parallel is not False)


def thinks(template: str | None) -> bool:
    """Does the chat template let the model think in <think>...</think> (Qwen3)?"""
    return bool(template) and "<think>" in template and "</think>" in template


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a thinking model's output: what stands in <think>...</think>
    at the start (an unclosed block is all reasoning: the answer was cut)."""
    head = text.lstrip()
    if not head.startswith("<think>") and "</think>" not in head:
        return None, text
    body = head.removeprefix("<think>")
    reasoning, closed, answer = body.partition("</think>")
    if not closed:
        return reasoning.strip() or None, ""
    return reasoning.strip() or None, answer.lstrip("\n")


class ReasoningStream:
    """Streaming split of <think>...</think>: (reasoning delta, content delta) per piece. The
    deltas add up to split_reasoning's parts up to surrounding whitespace."""

    def __init__(self) -> None:
        self.text = ""
        self.mode = "start"  # start | thinking | answer | plain
        self.pos = 0  # how far the text has been handed out
        self.started = False  # the answer after </think> has begun

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        if self.mode == "start":
            head = self.text.lstrip()
            if not head or ("<think>".startswith(head) and head != "<think>"):
                return "", ""  # maybe the tag: wait
            if head.startswith("<think>"):
                self.mode, self.pos = "thinking", self.text.index("<think>") + len("<think>")
            else:
                self.mode = "plain"
        if self.mode == "thinking":
            end = self.text.find("</think>", self.pos)
            if end < 0:
                hold = next((n for n in range(7, 0, -1) if self.text.endswith("</think>"[:n])), 0)
                upto = len(self.text) - hold
                out, self.pos = self.text[self.pos : upto], max(self.pos, upto)
                return out, ""
            reasoning = self.text[self.pos : end]
            self.mode, self.pos = "answer", end + len("</think>")
            return reasoning, self._answer()
        return "", self._answer()

    def _answer(self) -> str:
        out, self.pos = self.text[self.pos :], len(self.text)
        if self.mode == "answer" and not self.started:  # newlines after </think>: dropped
            out = out.lstrip("\n")
            self.started = bool(out)
        return out
