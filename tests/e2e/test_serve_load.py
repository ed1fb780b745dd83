"""Bounded load on loopback: many concurrent streams share the engine's batches, come out
whole and in order, equal the same requests run alone; disconnecting clients free their KV."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
from conftest import MODEL

NUM_STREAMS = 64
NUM_DISCONNECTS = 100


def _job(i: int) -> tuple[str, int]:
    return f"Request {i}: tell me about item {i * 7}", 4 + (i * 11) % 37  # prompt, max_tokens


async def _stream(c, prompt: str, max_tokens: int) -> tuple[str, str, int, list[str]]:
    stream = await c.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    ids, texts, usage, reasons = set(), [], None, []
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            assert choice.index == 0
            texts.append(choice.text)
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert len(ids) == 1  # every chunk belongs to this request
    return "".join(texts), next(iter(ids)), usage, reasons


def test_concurrent_streams_batch_and_match_runs_alone(server, arun):
    before = server.wait_idle()

    async def together(c):
        return await asyncio.gather(*(_stream(c, *_job(i)) for i in range(NUM_STREAMS)))

    results = arun(together)
    during = server.metrics()

    async def alone(c):
        texts = []
        for i in range(NUM_STREAMS):  # one at a time: nothing else in the batch
            prompt, max_tokens = _job(i)
            out = await c.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            texts.append(out.choices[0].text)
        return texts

    alone_texts = arun(alone)
    assert len({rid for _, rid, _, _ in results}) == NUM_STREAMS
    for i, (text, _, usage, reasons) in enumerate(results):
        assert usage == _job(i)[1] and reasons == ["length"]
        assert text == alone_texts[i], i
    # batching: engine steps that ran more than one sequence happened during the burst
    batched = lambda m: m["mlcrun_batch_size_count"] - m['mlcrun_batch_size_bucket{le="1"}']  # noqa: E731
    assert batched(during) > batched(before)
    assert during['mlcrun_batch_size_bucket{le="8"}'] < during["mlcrun_batch_size_count"]


def test_disconnecting_clients_free_their_kv_pages(server, arun):
    before = server.wait_idle()
    abort = 'mlcrun_request_success_total{finish_reason="abort"}'

    async def leave_early(c, i: int) -> int:
        stream = await c.completions.create(
            model=MODEL,
            prompt=f"Client {i} leaves",
            max_tokens=200,
            temperature=0.8,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()  # drops the connection mid-stream
        return seen

    async def burst(c):
        return await asyncio.gather(*(leave_early(c, i) for i in range(NUM_DISCONNECTS)))

    assert arun(burst) == [2] * NUM_DISCONNECTS
    m = server.wait_idle()
    assert m["mlcrun_num_requests_running"] == 0 and m["mlcrun_num_requests_waiting"] == 0
    assert m["mlcrun_requests_in_flight"] == 0
    assert m[abort] - before.get(abort, 0) > 0  # some were cut off mid-generation
    generated = m["mlcrun_engine_decode_tokens_total"] - before["mlcrun_engine_decode_tokens_total"]
    assert generated < NUM_DISCONNECTS * 199
    # What remains in use belongs to the prefix cache only: dropping it frees every page.
    r = httpx.post(f"{server.base_url}/reset_prefix_cache")
    assert r.status_code == 200
    m = server.metrics()
    assert m["mlcrun_kv_pages_used"] == 0 and m["mlcrun_prefix_cache_sequences"] == 0
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_non_streaming_client_that_leaves_is_aborted(server):
    abort, decoded, in_flight = (
        'mlcrun_request_success_total{finish_reason="abort"}',
        "mlcrun_engine_decode_tokens_total",
        "mlcrun_requests_in_flight",
    )
    before = server.wait_idle()
    body = json.dumps(
        {"model": MODEL, "prompt": "Slow", "max_tokens": 200, "n": 128, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        # Leave once the server is generating this request (128 choices x 200 tokens: far
        # from done), not after some time: the server must notice the closed connection.
        server.wait_for(
            lambda m: m[in_flight] == 1 and m[decoded] > before[decoded],
            "the request to be generating",
        )
    m = server.wait_idle()
    assert m[abort] - before.get(abort, 0) > 0  # the choices still running were aborted
    assert m[decoded] - before[decoded] < 128 * 200
    assert m["mlcrun_requests_in_flight"] == 0 and m["mlcrun_num_requests_running"] == 0
