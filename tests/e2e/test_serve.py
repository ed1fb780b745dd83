"""`mlcrun serve` with the official openai client (sync and async) against a real process."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from conftest import MODEL

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "tags", "ok"],
    "additionalProperties": False,
}


def tokenize(server, **body) -> list[int]:
    r = httpx.post(f"{server.base_url}/v1/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert models.data[0].model_extra["max_model_len"] == 256


def test_completion_streamed_equals_whole(client, server):
    whole = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = whole.choices[0]
    assert whole.object == "text_completion" and whole.model == MODEL
    assert choice.finish_reason == "length" and choice.index == 0
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1


def test_usage_counts_prompt_cached_and_completion_tokens(client, server):
    prompt = "Usage is counted in tokens"
    want_prompt = len(tokenize(server, prompt=prompt))
    for attempt in range(2):
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
        )
        u = out.usage
        assert (u.prompt_tokens, u.completion_tokens) == (want_prompt, 7)
        assert u.total_tokens == want_prompt + 7
        if attempt:  # the second time the prompt (but its last token) comes from the cache
            assert u.prompt_tokens_details.cached_tokens == want_prompt - 1
        timings = u.model_extra["timings"]
        assert timings["ttft_s"] > 0 and timings["decode_tokens_per_s"] > 0


def test_chat_streamed_and_whole(arun, server):
    want_prompt = len(tokenize(server, messages=CHAT))

    async def go(c):
        whole = await c.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=10, temperature=0
        )
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        return whole, [chunk async for chunk in stream]

    whole, chunks = arun(go)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and whole.object == "chat.completion"
    assert whole.usage.prompt_tokens == want_prompt
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_text_parts(client):
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]
    a = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=5, temperature=0
    )
    b = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say\nhi"}], max_tokens=5, temperature=0
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def test_n3_whole_and_streamed(client):
    out = client.completions.create(model=MODEL, prompt="Pick", max_tokens=6, n=3, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1  # each choice samples on its own
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=6, n=3, seed=5, stream=True
        )
    )
    finished = {c.choices[0].index for c in chunks if c.choices[0].finish_reason}
    assert finished == {0, 1, 2}


def test_several_prompts_and_token_ids(client, server):
    out = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    ids = tokenize(server, prompt="Token ids")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(
        model=MODEL, prompt="Token ids", max_tokens=5, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    two = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2)
    assert len(two.choices) == 2


def test_stop_sequences(client):
    args = dict(model=MODEL, prompt="Stop here", max_tokens=24, temperature=0)
    full = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    k = next(
        i
        for i in range(3, len(full))
        if full[i].isascii() and full[i].isprintable() and full[i] not in full[:i]
    )
    out = client.completions.create(**args, stop=[full[k], "never seen"]).choices[0]
    assert (out.text, out.finish_reason) == (full[:k], "stop")


def test_seeded_sampling_is_deterministic(arun):
    async def go(c):
        calls = [
            c.completions.create(model=MODEL, prompt="Seed", max_tokens=16, temperature=1, seed=s)
            for s in (123, 123, 124)
        ]
        return [r.choices[0].text for r in await asyncio.gather(*calls)]

    a, b, other = arun(go)
    assert a == b and a != other


def test_completion_logprobs(client):
    args = dict(model=MODEL, prompt="Logprobs", max_tokens=8, temperature=0, logprobs=3)
    whole = client.completions.create(**args).choices[0].logprobs
    assert len(whole.tokens) == len(whole.token_logprobs) == len(whole.top_logprobs) == 8
    for chosen, top in zip(whole.token_logprobs, whole.top_logprobs):
        assert 3 <= len(top) <= 4 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy takes the top token
    assert whole.text_offset == sorted(whole.text_offset)
    chunks = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True)]
    streamed = [lp for lp in chunks if lp is not None]
    assert sum((lp.tokens for lp in streamed), []) == whole.tokens
    # equal up to float32 rounding: the second run reuses the prompt's KV from the prefix cache
    streamed_logprobs = sum((lp.token_logprobs for lp in streamed), [])
    assert streamed_logprobs == pytest.approx(whole.token_logprobs, abs=1e-4)


def test_chat_logprobs(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        if not entry.token.startswith("bytes:"):  # else a piece of a UTF-8 character
            assert bytes(entry.bytes).decode() == entry.token
    stream = client.chat.completions.create(**args, logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for c in stream if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = client.chat.completions.create(**args)
    assert plain.choices[0].logprobs is None


def test_echo(client):
    out = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=4, echo=True)
    assert out.choices[0].text.startswith("Echo me")
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Echo me", max_tokens=4, echo=True, stream=True, temperature=0
        )
    )
    assert chunks[0].choices[0].text.startswith("Echo me")


def _check(value, schema) -> None:
    """A tiny JSON-schema checker for the keywords SCHEMA uses."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict) and set(schema["required"]) <= set(value)
        assert set(value) <= set(schema["properties"])
        for key, sub in value.items():
            _check(sub, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        for item in value:
            _check(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str)
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema["minimum"] <= value <= schema["maximum"]
    elif kind == "boolean":
        assert isinstance(value, bool)


def test_json_schema_output_always_validates(arun):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}

    async def go(c):
        calls = [
            c.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=200,
                temperature=1.0,
                seed=seed,
                response_format=fmt,
            )
            for seed in range(20)
        ]
        return await asyncio.gather(*calls)

    outs = arun(go)
    texts = set()
    for out in outs:
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        _check(json.loads(choice.message.content), SCHEMA)
        texts.add(choice.message.content)
    assert len(texts) > 10  # sampled, not one forced answer


def test_json_object(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=100,
        n=8,
        seed=3,
        response_format={"type": "json_object"},
    )
    for choice in out.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    assert any(c.finish_reason == "stop" for c in out.choices)


def test_tokenize_detokenize(server):
    ids = tokenize(server, prompt="round trip", add_special_tokens=False)
    r = httpx.post(f"{server.base_url}/v1/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "round trip"}
    r = httpx.post(f"{server.base_url}/v1/tokenize", json={"prompt": "x"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256


def test_health_and_metrics(server, client):
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    m = server.metrics()
    assert m['mlcrun_http_requests_total{method="POST",path="/v1/completions",status="200"}'] >= 1
    for name in (
        "mlcrun_time_to_first_token_seconds_count",
        "mlcrun_inter_token_latency_seconds_count",
        "mlcrun_generation_tokens_total",
        "mlcrun_prompt_tokens_total",
        "mlcrun_num_requests_running",
        "mlcrun_num_requests_waiting",
        "mlcrun_kv_cache_usage_ratio",
        "mlcrun_batch_size_count",
    ):
        assert name in m
    assert m["mlcrun_time_to_first_token_seconds_count"] >= 1
