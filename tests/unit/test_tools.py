"""Tool calls: the chat templates render tools and tool messages exactly as transformers'
apply_chat_template does, and the three output formats read back as OpenAI tool_calls, whole
and streamed.

tests/data/chat_templates: qwen2.5.jinja is Qwen2.5-Instruct's template as published;
llama3.2-tools.jinja and mistral-v3-tools.jinja are written after the tool-calling templates
Meta (Llama 3.1-3.2) and Mistral (v0.3) publish, whose tokenizer_config.json copies in this
project's fixtures were trimmed of their tool parts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from mlcrun.chat_template import render
from mlcrun.serve.protocol import APIError, ChatMessage, plain_messages
from mlcrun.serve.tools import ToolStream, family_of, parse, tool_request

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather",
        "arguments": '{"city": "Paris", "unit": "c"}'}}  # fmt: skip
CONVERSATION = [
    ChatMessage(role="system", content="You are helpful."),
    ChatMessage(role="user", content="Weather in Paris?"),
    ChatMessage(role="assistant", content=None, tool_calls=[CALL]),
    ChatMessage(role="tool", tool_call_id="abcDEF123", content='{"temp": 21}'),
]


def _hf_tokenizer():
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(models.BPE()))
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    return tok


@pytest.mark.parametrize("name", ["llama3.2-tools", "qwen2.5", "mistral-v3-tools"])
@pytest.mark.parametrize("with_tools", [True, False])
def test_rendered_prompt_equals_transformers(name, with_tools):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    messages = plain_messages(CONVERSATION)  # as the server passes them: arguments as objects
    if name.startswith("mistral"):
        messages = messages[1:]  # its template takes the system text with the last user turn
    tools = TOOLS if with_tools else None
    extra = {"date_string": "01 Dec 2026"}
    want = _hf_tokenizer().apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False,
        add_generation_prompt=True, **extra,
    )  # fmt: skip
    got = render(
        template, messages, add_generation_prompt=True, tools=tools, template_kwargs=extra,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )  # fmt: skip
    assert got == want
    if with_tools:
        assert "get_weather" in got and "Paris" in got


def test_families_by_template():
    read = {n: family_of((TEMPLATES / f"{n}.jinja").read_text()) for n in
            ("llama3.2-tools", "qwen2.5", "mistral-v3-tools", "llama3.2")}  # fmt: skip
    assert read == {"llama3.2-tools": "llama3", "qwen2.5": "hermes",
                    "mistral-v3-tools": "mistral", "llama3.2": None}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "text", "content", "calls"),
    [
        ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
         "Sure.", [("f", {"x": 1})]),
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>'
         '{"name": "g", "arguments": {"y": "z"}}</tool_call>', None,
         [("f", {}), ("g", {"y": "z"})]),
        ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ("mistral", 'Ok [TOOL_CALLS] [{"name": "f", "arguments": {"x": 2}}]', "Ok",
         [("f", {"x": 2})]),
        ("mistral", '[{"name": "f", "arguments": {"x": 2}}]', None, [("f", {"x": 2})]),
        ("llama3", '{"name": "f", "parameters": {"x": 3}}', None, [("f", {"x": 3})]),
        ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
         None, [("f", {}), ("g", {})]),
        ("llama3", "The answer is {42}.", "The answer is {42}.", []),
        (None, '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "f", "arguments": {}}</tool_call>', []),
    ],
)  # fmt: skip
def test_parse(family, text, content, calls):
    got_content, got_calls = parse(family, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", 'Let me check.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'),
        ("hermes", "No call here, only <tool text that is not a call."),
        ("mistral", 'Hm [TOOL_CALLS] [{"name": "f", "arguments": {}}]'),
        ("llama3", '  {"name": "f", "parameters": {"a": [1, 2]}}'),
        ("llama3", "Plain answer with a { brace."),
    ],
)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_sends_the_content_and_holds_the_calls(family, text, step):
    """Fed in pieces of any size: the content sent equals the parsed content, no byte of a
    call is sent as content, and the calls come out at the end."""
    stream = ToolStream(family)
    sent = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
    rest, calls = stream.finish()
    content, want_calls = parse(family, text)
    assert (sent + rest).strip() == (content or "")  # (spaces before a call may be sent)
    assert [c.name for c in calls] == [c.name for c in want_calls]


def test_tool_request_checks():
    assert tool_request(None, None) is None
    req = tool_request(TOOLS, None)
    assert req.choice == "auto" and not req.constrained
    named = tool_request(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named.schema() == TOOLS[0]["function"]["parameters"]
    required = tool_request(TOOLS, "required", parallel=False)
    assert required.schema()["maxItems"] == 1
    assert [c.name for c in required.read_constrained('[{"name": "get_weather", '
            '"parameters": {"city": "Oslo"}}]')] == ["get_weather"]  # fmt: skip
    for tools, choice, message in [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "no tool named"),
        (None, "required", "needs tools"),
        ([{"type": "function", "function": {}}], "auto", "name is required"),
        (TOOLS, "maybe", "unknown value"),
    ]:
        with pytest.raises(APIError, match=message):
            tool_request(tools, choice)


@pytest.mark.parametrize(
    ("text", "reasoning", "answer"),
    [
        ("<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
        ("<think>\n\n</think>\n\nParis.", None, "Paris."),  # enable_thinking false
        ("Paris.", None, "Paris."),
        ("<think>cut off", "cut off", ""),
    ],
)
@pytest.mark.parametrize("step", [1, 4, 100])
def test_reasoning_is_split_whole_and_streamed(text, reasoning, answer, step):
    from mlcrun.serve.tools import ReasoningStream, split_reasoning

    assert split_reasoning(text) == (reasoning, answer)
    stream = ReasoningStream()
    parts = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)]
    assert "".join(r for r, _ in parts).strip() == (reasoning or "")
    assert "".join(c for _, c in parts) == answer
