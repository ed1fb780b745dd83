"""Server pieces without a server: request schema, grammar constraints, metrics, CLI parsing."""

import json

import numpy as np
import pytest
from checkpoints import write_tokenizer

from mlcrun.cli.serve import parse_kv_memory
from mlcrun.engine.engine import EngineStats
from mlcrun.errors import MlcrunError
from mlcrun.serve.grammar import Grammars
from mlcrun.serve.metrics import Metrics
from mlcrun.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, ResponseFormat
from mlcrun.tokenizer import Tokenizer


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
    bad = ChatCompletionRequest(messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(APIError, match="role"):
        bad.plain_messages()


def test_suffix_and_echo_with_logprobs_are_refused():
    for req, param in (
        (CompletionRequest(prompt="x", suffix="y"), "suffix"),
        (CompletionRequest(prompt="x", echo=True, logprobs=1), "echo"),
    ):
        with pytest.raises(APIError) as info:
            req.check()
        assert info.value.param == param


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
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert (
        samples['mlcrun_http_requests_total{method="POST",path="/v1/completions",status="200"}']
        == "1"
    )
    assert samples["mlcrun_kv_pages_used"] == "3"
    assert samples['mlcrun_batch_size_bucket{le="1"}'] == "5"
    assert samples['mlcrun_batch_size_bucket{le="4"}'] == "7"
    assert samples["mlcrun_batch_size_count"] == "7"
    assert samples['mlcrun_time_to_first_token_seconds_bucket{le="0.025"}'] == "1"


def test_parse_kv_memory():
    assert parse_kv_memory("0.25") == 0.25
    assert parse_kv_memory("2G") == 2 * 2**30 and parse_kv_memory("512MiB") == 512 * 2**20
    assert parse_kv_memory(None) is None
    with pytest.raises(MlcrunError):
        parse_kv_memory("lots")
