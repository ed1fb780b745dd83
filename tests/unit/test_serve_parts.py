"""Server pieces without a server: request schema, grammar constraints, metrics, CLI parsing."""

import json

import numpy as np
import pytest
from checkpoints import write_tokenizer

from mlcrun.chat_template import TemplateError, render
from mlcrun.cli.serve import parse_kv_memory
from mlcrun.engine.engine import EngineStats
from mlcrun.errors import MlcrunError
from mlcrun.serve.grammar import Grammars
from mlcrun.serve.metrics import Metrics
from mlcrun.serve.protocol import (
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
)
from mlcrun.tokenizer import Tokenizer

USER = {"role": "user", "content": "hi"}


def test_sampling_errors_name_the_field():
    req = CompletionRequest(prompt="x", temperature=-1)
    with pytest.raises(APIError) as info:
        req.sampling_params(4, None)
    assert info.value.status == 400 and info.value.param == "temperature"
    req = CompletionRequest(prompt="x", stop="\n", logit_bias={"5": 2}, seed=-3, top_k=-1)
    params = req.sampling_params(4, 2)
    assert params.stop == ("\n",) and params.logit_bias == ((5, 2.0),) and params.logprobs == 2


def test_chat_messages_are_plain_strings():
    req = ChatCompletionRequest(
        messages=[
            {"role": "developer", "content": "be kind"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert req.plain_messages() == [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "a\nb"},
    ]
    bad = ChatCompletionRequest(messages=[{"role": "function", "content": "x"}])
    with pytest.raises(APIError, match="role"):
        bad.plain_messages()
    tool = ChatCompletionRequest(messages=[{"role": "tool", "content": "x", "tool_call_id": "a"}])
    assert tool.plain_messages() == [{"role": "tool", "content": "x", "tool_call_id": "a"}]


def test_suffix_and_echo_with_logprobs_are_refused():
    for req, param in (
        (CompletionRequest(prompt="x", suffix="y"), "suffix"),
        (CompletionRequest(prompt="x", echo=True, logprobs=1), "echo"),
    ):
        with pytest.raises(APIError) as info:
            req.check()
        assert info.value.param == param


def test_lone_surrogates_are_named():
    cases = [
        (CompletionRequest(model="\ud800", prompt="x"), "model"),
        (CompletionRequest(prompt=["ok", "a\udfffb"]), "prompt[1]"),
        (CompletionRequest(prompt="x", stop=["\ud800"]), "stop[0]"),
        (CompletionRequest(prompt="x", logit_bias={"\ud800": 1}), "logit_bias"),
        (ChatCompletionRequest(messages=[USER, {"role": "user", "content": "\udc00"}]),
         "messages[1].content"),
        (ChatCompletionRequest(messages=[{"role": "user", "content": [
            {"type": "text", "text": "ok"}, {"type": "text", "text": "\ud83d"}]}]),
         "messages[0].content[1].text"),
    ]  # fmt: skip
    for req, param in cases:
        with pytest.raises(APIError) as info:
            req.check_text()
        assert info.value.status == 400 and info.value.param == param, info.value.message
        assert info.value.message.startswith(f"{param}: lone UTF-16 surrogate")
    # a character outside the BMP, sent as a surrogate pair, is a single valid code point
    ChatCompletionRequest(messages=[{"role": "user", "content": "🙂 é"}]).check_text()
    CompletionRequest(prompt=[[1, 2], [3]]).check_text()


def test_logit_bias_keys_are_ascii_token_ids():
    for key in ("²", "١٢", "-1", "x", "1" * 19):  # "²".isdigit() is true, int("²") fails
        req = CompletionRequest(prompt="x", logit_bias={key: 1})
        with pytest.raises(APIError) as info:
            req.check()
        assert info.value.param == "logit_bias" and "token ids" in info.value.message
    CompletionRequest(prompt="x", logit_bias={"007": 1}).check()


def test_size_limits():
    def param_of(**fields) -> str:
        with pytest.raises(APIError) as info:
            CompletionRequest(prompt="x", **fields).check()
        return info.value.param

    assert param_of(stop=["a", "b", "c", "d", "e"]) == "stop"
    assert param_of(stop="s" * (MAX_STOP_CHARS + 1)) == "stop"
    assert param_of(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))) == "stop_token_ids"
    assert param_of(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}) == "logit_bias"
    CompletionRequest(
        prompt="x",
        stop=["s" * MAX_STOP_CHARS] * MAX_STOP,
        stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
        logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS)},
    ).check()


def test_max_completion_tokens_zero_is_a_value():
    req = ChatCompletionRequest(messages=[USER], max_completion_tokens=0, max_tokens=5)
    with pytest.raises(APIError) as info:
        req.check()
    assert info.value.param == "max_completion_tokens"
    req = ChatCompletionRequest(messages=[USER], max_completion_tokens=3, max_tokens=5)
    assert req.asked_max_tokens == (3, "max_completion_tokens")
    assert ChatCompletionRequest(messages=[USER]).asked_max_tokens == (None, "max_tokens")


@pytest.mark.parametrize(
    "template,error",
    [
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
        ("{{ 1 // (messages | length - 1) }}", "ZeroDivisionError"),
        ("{{ nothing.here }}", "UndefinedError"),
        ("{{ messages[0]['content'].index('zz') }}", "ValueError"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ],
)
def test_chat_template_runtime_errors_are_clean(template, error):
    with pytest.raises(MlcrunError) as info:
        render(template, [USER])
    message = str(info.value)
    assert message.startswith(f"chat template failed: {error}") and "\n" not in message


def test_chat_template_raise_exception_is_one_cut_line():
    template = "{{ raise_exception('bad\nconversation: ' + messages[0]['content']) }}"
    with pytest.raises(TemplateError) as info:
        render(template, [{"role": "user", "content": "x" * 5000}])
    assert str(info.value).startswith("chat template: bad conversation: xxx")
    assert len(str(info.value)) < 400


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return Grammars(Tokenizer.from_dir(folder), vocab_size=320, eos_token_ids=[2])


def test_json_schema_constraint_only_allows_valid_json(grammars):
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "boolean"},
        },
        "required": ["n", "b"],
        "additionalProperties": False,
    }
    fmt = ResponseFormat(type="json_schema", json_schema={"name": "x", "schema": schema})
    factory = grammars.constraint(fmt)
    rng = np.random.default_rng(0)
    for _ in range(10):
        c, tokens = factory(), []
        for _ in range(100):
            mask = c.allowed(320)
            assert mask.shape == (320,) and not mask[259:].any()  # ids past the tokenizer
            token = int(rng.choice(np.flatnonzero(mask)))
            tokens.append(token)
            if c.accept(token):
                break
        value = json.loads(grammars.tokenizer.decode(tokens))
        assert set(value) == {"n", "b"} and 0 <= value["n"] <= 9


def test_bad_schemas_are_400(grammars):
    for fmt in (
        ResponseFormat(type="json_schema"),
        ResponseFormat(type="json_schema", json_schema={"schema": {"type": "nope"}}),
    ):
        with pytest.raises(APIError) as info:
            grammars.constraint(fmt)
        assert info.value.status == 400 and info.value.param == "response_format"
    assert grammars.constraint(ResponseFormat(type="text")) is None


def test_token_strings_keep_byte_pieces_apart(grammars):
    assert grammars.token_str(grammars.tokenizer.token_to_id("a")) == "a"
    pieces = {grammars.token_str(t) for t in range(3, 259)}
    assert len(pieces) == 256  # every byte token has its own string


def test_metrics_render_prometheus_text():
    m = Metrics("tiny")
    m.count_request("POST", "/v1/completions", 200)
    m.ttft.observe(0.02)
    stats = EngineStats(total_pages=10, free_pages=7, step_sizes={1: 5, 3: 2})
    text = m.render(stats)
    samples = {
        key: float(value)
        for key, value in (line.rsplit(" ", 1) for line in text.splitlines())
        if not key.startswith("#")
    }
    assert (
        samples['mlcrun_http_requests_total{method="POST",path="/v1/completions",status="200"}']
        == 1
    )
    assert samples["mlcrun_kv_pages_used"] == 3
    assert samples['mlcrun_batch_size_bucket{le="1"}'] == 5
    assert samples['mlcrun_batch_size_bucket{le="4"}'] == 7
    assert samples["mlcrun_batch_size_count"] == 7
    assert samples['mlcrun_time_to_first_token_seconds_bucket{le="0.025"}'] == 1
    assert not any("_created" in key for key in samples)


def test_metric_labels_have_fixed_values():
    m = Metrics("tiny")
    for i in range(50):
        m.count_request(f"M{i}", "other", 405)  # any method string a client sends
    m.record_choice("stop", None)
    m.record_choice("made-up", None)
    text = m.render(EngineStats())
    assert text.count("mlcrun_http_requests_total{") == 1
    assert 'method="other",path="other",status="405"} 50.0' in text
    assert 'finish_reason="stop"} 1.0' in text and 'finish_reason="other"} 1.0' in text
    assert 'finish_reason="made-up"' not in text


def test_each_server_has_its_own_registry():
    a, b = Metrics("a"), Metrics("b")
    a.count_request("GET", "/health", 200)
    assert "/health" in a.render(EngineStats()) and "/health" not in b.render(EngineStats())


def test_parse_kv_memory():
    assert parse_kv_memory("0.25") == 0.25
    assert parse_kv_memory("2G") == 2 * 2**30 and parse_kv_memory("512MiB") == 512 * 2**20
    assert parse_kv_memory(None) is None
    with pytest.raises(MlcrunError):
        parse_kv_memory("lots")
