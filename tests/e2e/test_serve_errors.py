"""Every error the server answers, with OpenAI's status and shape and without a traceback in
the server log; API key, body limit, full queue and graceful shutdown on a second, strict
server; chat templates that fail on a third; a hypothesis fuzz of the schema."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal

import httpx
import openai
import pytest
from conftest import MODEL, ServerProcess
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mlcrun.serve.protocol import MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

USER = [{"role": "user", "content": "hi"}]
LONG = "x" * 300  # 301 tokens with BOS (one per byte), over the 256-token window
LONE = "\ud800"  # a lone UTF-16 surrogate: valid JSON ("\\ud800"), not valid Unicode

CASES = [  # (path, body, status, param)
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "suffix": "bye"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 9999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"9999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        None,
    ),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": USER, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}},
        },
        400,
        "response_format",
    ),
    ("/v1/chat/completions", {"messages": USER, "model": "nope"}, 404, "model"),
    ("/v1/tokenize", {}, 400, "prompt"),
    ("/v1/detokenize", {"tokens": [-1]}, 400, "tokens"),
    # Each of these was a 500.
    ("/v1/tokenize", {"messages": []}, 400, "messages"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"²": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {"٣": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": LONE, "prompt": "hi"}, 400, "model"),
    ("/v1/chat/completions", {"model": f"x{LONE}", "messages": USER}, 400, "model"),
    ("/v1/completions", {"prompt": f"a{LONE}b"}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["ok", LONE]}, 400, "prompt[1]"),
    (
        "/v1/chat/completions",
        {"messages": [USER[0], {"role": "user", "content": LONE}]},
        400,
        "messages[1].content",
    ),
    ("/v1/chat/completions", {"messages": USER, "stop": LONE}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", LONE]}, 400, "stop[1]"),
    ("/v1/tokenize", {"prompt": LONE}, 400, "prompt"),
    (
        "/v1/tokenize",
        {"messages": [{"role": "user", "content": LONE}]},
        400,
        "messages[0].content",
    ),
    # Limits and values.
    (
        "/v1/chat/completions",
        {"messages": USER, "max_completion_tokens": 0, "max_tokens": 5},
        400,
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "max_completion_tokens": 300},
        400,
        "max_completion_tokens",
    ),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * (MAX_STOP + 1)}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "s" * (MAX_STOP_CHARS + 1)}, 400, "stop"),
    (
        "/v1/completions",
        {"prompt": "hi", "stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)},
        400,
        "stop_token_ids",
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
        400,
        "logit_bias",
    ),
]


def assert_error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def post(server, path: str, body) -> httpx.Response:
    """POST `body` as JSON with non-ASCII escaped, so lone surrogates travel as "\\ud800"."""
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body), headers=headers)


@pytest.mark.parametrize("path,body,status,param", CASES)
def test_error_status_and_shape(server, path, body, status, param):
    seen = len(server.log())
    err = assert_error_shape(post(server, path, {"model": MODEL, **body}), status)
    if param is not None:
        assert err["param"] == param, err
        assert param in err["message"], err  # one line that names the field
    assert "Traceback" not in server.log()[seen:]


def test_context_errors_name_the_limits(server):
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": LONG})
    err = assert_error_shape(r, 400)
    assert "256" in err["message"] and "301" in err["message"]  # window, prompt tokens
    assert err["code"] == "context_length_exceeded"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 300}
    err = assert_error_shape(httpx.post(f"{server.base_url}/v1/completions", json=body), 400)
    assert "256" in err["message"] and "300" in err["message"]


def test_protocol_errors(server):
    url = server.base_url
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=10)
    assert_error_shape(r, 400)
    r = httpx.post(f"{url}/v1/completions", json=[1, 2], timeout=10)
    assert_error_shape(r, 400)
    assert_error_shape(httpx.get(f"{url}/v1/nothing-here"), 404)
    assert_error_shape(httpx.get(f"{url}/v1/completions"), 405)
    assert_error_shape(httpx.get(f"{url}/v1/models/other"), 404)


def test_metric_labels_stay_bounded(server):
    """Made-up methods and paths are counted, under "other", never as labels of their own."""
    key = 'mlcrun_http_requests_total{method="other",path="other",status="%d"}'
    before = server.metrics()
    statuses = [httpx.request(f"M{i}X", f"{server.base_url}/p/{i}").status_code for i in range(20)]
    assert set(statuses) == {404}
    m = server.metrics()
    assert m[key % 404] - before.get(key % 404, 0) == 20
    assert not [k for k in m if "M1X" in k or "/p/" in k]


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi")
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", suffix="!")
    assert info.value.param == "suffix"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, temperature=-2)


# -- a strict server: API key, small body limit, one running sequence and one queued ---------


@pytest.fixture(scope="module")
def strict(artifacts, tmp_path_factory):
    log = tmp_path_factory.mktemp("strict") / "server.log"
    args = ("--served-model-name", MODEL, "--api-key", "sekret", "--max-num-seqs", "1")
    args += ("--max-queue", "1", "--max-request-bytes", "2000", "--shutdown-timeout", "0")
    proc = ServerProcess(artifacts("llama"), log, *args)
    yield proc
    proc.stop(signal.SIGKILL)


def strict_client(server, key="sekret"):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def test_api_key(strict):
    with pytest.raises(openai.AuthenticationError) as info:
        strict_client(strict, "wrong").models.list()
    assert info.value.status_code == 401
    r = httpx.get(f"{strict.base_url}/v1/models")
    assert assert_error_shape(r, 401)["code"] == "invalid_api_key"
    assert [m.id for m in strict_client(strict).models.list()] == [MODEL]
    assert httpx.get(f"{strict.base_url}/health").status_code == 200  # open for probes
    # The scheme is case-insensitive (RFC 7235); the key is not.
    for header, status in (
        ("bearer sekret", 200),
        ("BEARER  sekret", 200),
        ("Bearer SEKRET", 401),
        ("Basic sekret", 401),
        ("sekret", 401),
    ):
        r = httpx.get(f"{strict.base_url}/v1/models", headers={"Authorization": header})
        assert r.status_code == status, (header, r.text)


def test_oversized_body_is_413(strict):
    with pytest.raises(openai.APIStatusError) as info:
        strict_client(strict).completions.create(model=MODEL, prompt="x" * 5000, max_tokens=1)
    assert info.value.status_code == 413
    # chunked, without a Content-Length: counted while it is read
    chunks = iter([b'{"model": "tiny", "prompt": "', b"y" * 3000, b'"}'])
    r = httpx.post(
        f"{strict.base_url}/v1/completions",
        content=chunks,
        headers={"Authorization": "Bearer sekret", "Content-Type": "application/json"},
    )
    assert_error_shape(r, 413)


def test_full_queue_is_429_and_shutdown_is_graceful(strict):
    async def go():
        c = openai.AsyncOpenAI(base_url=f"{strict.base_url}/v1", api_key="sekret", max_retries=0)
        args = dict(model=MODEL, prompt="busy", max_tokens=200, extra_body={"ignore_eos": True})
        # one running + one queued fill the server: most of 16 at once are refused
        calls = [c.completions.create(**args) for _ in range(16)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        done = [r for r in results if not isinstance(r, Exception)]
        assert refused and done and len(refused) + len(done) == 16, results
        assert refused[0].status_code == 429 and refused[0].code == "queue_full"
        assert all(r.choices[0].finish_reason == "length" for r in done)
        args["stream"] = True
        # In flight at SIGTERM: the stream still ends properly (finished or aborted).
        stream = await c.completions.create(**args)
        first = await stream.__anext__()
        strict.proc.send_signal(signal.SIGTERM)
        last = first
        async for chunk in stream:
            last = chunk
        return last.choices[0].finish_reason

    assert asyncio.run(go()) in ("length", "abort")
    assert strict.proc.wait(30) == 0, strict.log()
    assert "Traceback" not in strict.log()


# -- a model whose chat template fails at runtime on some conversations -------------------------

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('no system messages, please') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }} ({{ 100 // (m['content'] | length) }}%)\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def templated(artifacts, tmp_path_factory):
    """The tiny model with TEMPLATE as its chat template (chat_template.jinja wins)."""
    folder = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(artifacts("llama"), folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    proc = ServerProcess(folder, folder.parent / "server.log", "--served-model-name", MODEL)
    yield proc
    proc.stop()


@pytest.mark.parametrize(
    "content,message",
    [
        ("", "ZeroDivisionError"),  # a Python error inside the template
        ([{"type": "text", "text": ""}], "ZeroDivisionError"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/tokenize"])
def test_template_runtime_errors_are_400(templated, path, content, message):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    err = assert_error_shape(post(templated, path, body), 400)
    assert err["param"] == "messages" and message in err["message"], err
    assert "Traceback" not in templated.log()


def test_template_raise_exception_is_400(templated):
    body = {"model": MODEL, "messages": [{"role": "system", "content": "x"}, *USER]}
    err = assert_error_shape(post(templated, "/v1/chat/completions", body), 400)
    assert err["param"] == "messages" and "no system messages, please" in err["message"]


def test_template_that_renders_is_used(templated):
    r = post(templated, "/v1/tokenize", {"model": MODEL, "messages": USER})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    want = post(templated, "/v1/tokenize", {"prompt": "user: hi (50%)\nassistant:"})
    assert ids == want.json()["tokens"][1:]  # the same text, without BOS
    body = {"model": MODEL, "messages": USER, "max_tokens": 2}
    r = post(templated, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
    assert "Traceback" not in templated.log()


# -- fuzz -------------------------------------------------------------------------------------
# Two kinds of bodies: in-range values (most succeed: exercises sampling, grammars, streaming)
# and anything-goes values (must fail cleanly, never 500).

_any = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(-5, 400), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_text = st.text(max_size=20)
_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}))
_roles = st.sampled_from(["user", "system", "assistant", "developer"])
_message = st.fixed_dictionaries({"role": _roles, "content": st.one_of(_text, _parts)})
_bad_message = st.fixed_dictionaries(
    {"role": st.one_of(_roles, st.just("tool"), _any), "content": st.one_of(_text, _any)}
)
_valid = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 16),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 400),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**64),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1), max_size=2)),
    "logit_bias": st.dictionaries(st.integers(0, 319).map(str), st.floats(-100, 100), max_size=3),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": st.text(max_size=5),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
}
_completion_only = {"echo": st.booleans(), "logprobs": st.integers(0, 5)}
_chat_only = {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)}
_garbage = {name: st.one_of(value, _any) for name, value in _valid.items()}
_garbage.update(
    {"suffix": _any, "echo": _any, "logprobs": _any, "top_logprobs": _any, "tools": _any}
)
_prompt = st.one_of(
    st.text(max_size=30),
    st.lists(st.text(max_size=5), min_size=1, max_size=2),
    st.lists(st.integers(0, 319), min_size=1, max_size=10),
)
_completion = st.one_of(
    st.fixed_dictionaries({"prompt": _prompt}, optional={**_valid, **_completion_only}),
    st.fixed_dictionaries({"prompt": st.one_of(_prompt, _any)}, optional=_garbage),
)
_chat = st.one_of(
    st.fixed_dictionaries(
        {"messages": st.lists(_message, min_size=1, max_size=3)}, optional={**_valid, **_chat_only}
    ),
    st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(_bad_message, max_size=3), _any)}, optional=_garbage
    ),
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(
        st.tuples(st.just("/v1/completions"), _completion),
        st.tuples(st.just("/v1/chat/completions"), _chat),
    )
)
def test_fuzz_never_500(server, case):
    path, body = case
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 16:
        body["max_tokens"] = 16  # keep it quick
    raw = json.dumps(body).encode()  # NaN and Infinity included, as Python clients send them
    headers = {"Content-Type": "application/json"}
    r = httpx.post(f"{server.base_url}{path}", content=raw, headers=headers, timeout=60)
    assert r.status_code < 500, r.text
    event(f"status {r.status_code}")
    if r.status_code != 200:
        assert_error_shape(r, r.status_code)
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in r.text, r.text
