"""`mlcrun bench --url`'s client against a real `mlcrun serve` process over loopback HTTP."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import MODEL, WAIT_TIMEOUT

from mlcrun.bench.client import resolve_model, run_requests, run_url
from mlcrun.bench.workload import BenchRequest
from mlcrun.errors import MlcrunError

WINDOW = 256  # the tiny artifact's context window


def token_requests(shapes: list[tuple[int, int]], arrivals: list[float] | None = None):
    """BenchRequests of random token ids, one per (prompt_len, output_len)."""
    rng = random.Random(0)
    arrivals = arrivals or [0.0] * len(shapes)
    return [
        BenchRequest(i, [rng.randrange(3, 259) for _ in range(p)], p, o, arrival)
        for i, ((p, o), arrival) in enumerate(zip(shapes, arrivals))
    ]


def max_overlap(records) -> int:
    """The most requests in flight (between start and end) at any request's start."""
    return max(sum(r.start <= s.start < r.end for r in records) for s in records)


def test_concurrent_requests_record_every_token(server):
    requests = token_requests([(5, 4), (17, 12), (9, 7), (30, 5), (3, 10), (12, 8)])
    done = []
    records, duration, model = run_url(
        f"{server.base_url}/v1/", requests, concurrency=3, on_done=done.append
    )
    assert model == MODEL
    assert [r.index for r in records] == list(range(6))
    assert sorted(r.index for r in done) == list(range(6))
    for req, rec in zip(requests, records):
        assert rec.ok, rec.error
        assert rec.prompt_len == req.prompt_len
        assert rec.output_len == req.output_len  # ignore_eos: exactly max_tokens
        # mlcrun serve streams one chunk per token but skips a token whose text is empty (a
        # special token, or bytes of a UTF-8 character held back until it is complete, sent
        # with the next chunk); the tiny random model makes many such tokens.
        assert 1 <= len(rec.chunk_times) <= rec.output_len
        assert rec.chunk_times == sorted(rec.chunk_times)
        assert rec.start < rec.chunk_times[0] <= rec.end == rec.chunk_times[-1]
    assert max_overlap(records) <= 3
    first, last = min(r.start for r in records), max(r.end for r in records)
    assert last - first <= duration


def test_arrivals_are_respected(server):
    """No request is sent before its arrival time. How late one is sent depends on how busy
    the machine is, so that is not checked."""
    arrivals = [0.0, 0.3, 0.6]
    requests = token_requests([(6, 4)] * 3, arrivals)
    before = time.perf_counter()  # the run's clock (also perf_counter) starts after this
    records, _ = asyncio.run(run_requests(server.base_url, requests, model=MODEL, concurrency=None))
    assert all(r.ok for r in records), [r.error for r in records]
    for rec, arrival in zip(records, arrivals):
        assert rec.start - before >= arrival - 0.001, (arrival, rec.start - before)
    assert [r.start for r in records] == sorted(r.start for r in records)


def test_prefix_cache_hits_are_reported(server):
    prompt = token_requests([(40, 3)])[0]
    records, _, _ = run_url(server.base_url, [prompt, prompt], concurrency=1)
    assert [r.ok for r in records] == [True, True]
    assert records[1].cached_tokens == 39  # all but the last prompt token


def test_one_failed_request_does_not_stop_the_others(server):
    requests = token_requests([(8, 4), (WINDOW + 10, 4), (8, 4)])
    records, _, _ = run_url(server.base_url, requests, concurrency=2)
    assert records[0].ok and records[2].ok
    bad = records[1]
    assert not bad.ok and bad.end is None
    assert bad.error.startswith("HTTP 400: This model's maximum context length is 256 tokens")
    assert "\n" not in bad.error


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_resolve_model(server, suffix):
    url = server.base_url + suffix
    assert resolve_model(url, None, None, timeout=WAIT_TIMEOUT) == MODEL
    assert resolve_model(url, "other-name", None, timeout=WAIT_TIMEOUT) == "other-name"


def test_unreachable_server_is_one_line_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(MlcrunError) as err:
        resolve_model(url + "/v1", None, None, timeout=WAIT_TIMEOUT)
    assert str(err.value) == f"cannot reach {url}: connection refused"


class _FakeServer(BaseHTTPRequestHandler):
    """Not OpenAI: /v1/models answers a JSON object without `data`; a completion stream is cut
    off after one chunk."""

    def do_GET(self):
        self._reply(b'{"hello": "world"}', "application/json")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(b'data: {"choices": [{"index": 0, "text": "hi"}]}\n\n', "text/event-stream")

    def _reply(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_not_an_openai_server(fake_url):
    with pytest.raises(MlcrunError, match=r"/v1/models did not answer an OpenAI model list$"):
        resolve_model(fake_url, None, None, timeout=WAIT_TIMEOUT)


def test_broken_stream_is_recorded(fake_url):
    records, _ = asyncio.run(
        run_requests(fake_url, token_requests([(4, 4)]), model="m", concurrency=1)
    )
    assert records[0].error == "stream ended before [DONE]"
    assert len(records[0].chunk_times) == 1
