"""Tool calls through `mlcrun serve` with the official openai client: a forced tool (named,
and "required") gives schema-valid `tool_calls`; the loop goes on with the tool's result
rendered by the model's own template (the tiny llama with Qwen2.5's chat template, which
asks for Hermes `<tool_call>` blocks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import MODEL, ServerProcess

from mlcrun.compiler.build import compile_model
from mlcrun.compiler.options import CompileOptions

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid_weather(args: dict) -> bool:
    return (
        set(args) == {"city", "unit"}
        and isinstance(args["city"], str)
        and 1 <= len(args["city"]) <= 12
        and args["unit"] in ("celsius", "fahrenheit")
    )


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    from checkpoints import build_checkpoint

    root = tmp_path_factory.mktemp("tools")
    # a byte-level vocab of 320: the tool prompt is about 1,100 tokens
    folder = build_checkpoint("llama", root / "ckpt", max_position_embeddings=2048)
    shutil.copy(TEMPLATES / "qwen2.5.jinja", folder / "chat_template.jinja")
    art = compile_model(str(folder), root / "art", CompileOptions())
    proc = ServerProcess(art, root / "server.log", "--served-model-name", MODEL)
    yield proc
    assert proc.stop() == 0, proc.log()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module")
def client(tool_server):
    import openai

    base = f"{tool_server.base_url}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as c:
        yield c


def test_named_tool_loop(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        out = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice=named,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert len(call.id) == 9 and call.id.isalnum()
        assert _valid_weather(json.loads(call.function.arguments))
    # the loop goes on: the call and the tool's result, rendered by the model's template
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21, "sky": "clear"}'},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=12, temperature=0
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls


def test_required_tool_streamed(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            parallel_tool_calls=False,
            seed=1,
            max_tokens=120,
            stream=True,
        )
    )
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "tool_calls" and len(calls) == 1
    for tc in calls:
        args = json.loads(tc.function.arguments)
        assert tc.function.name in ("get_weather", "get_time")
        if tc.function.name == "get_weather":
            assert _valid_weather(args)
        else:
            assert set(args) == {"zone"} and len(args["zone"]) <= 8


def test_tool_errors_name_the_field(client):
    import openai

    bad = [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "no tool named 'x'"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ]  # fmt: skip
    for extra, message in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)
        assert message in str(info.value)
