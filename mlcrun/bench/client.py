"""`mlcrun bench --url`: a serving workload against any OpenAI-compatible server (mlcrun serve,
llama.cpp's llama-server, vLLM) over HTTP, timed from the client side.

Before each run the server is asked to drop its prefix cache (`reset_prefix_cache`), so that one
concurrency level cannot reuse the prompts of the one before; the CLI also sends fresh synthetic
prompts at every level (`workload.reseeded`), which covers servers without that endpoint.

Each request is a streamed /v1/completions call sent at its arrival time, with at most
`concurrency` in flight. Each chunk that carries text is one entry of `chunk_times` (text-less
chunks, such as a bare finish or the usage, are not); the final usage chunk, when the server
sends one, gives the exact output and cached token counts. A failed request is recorded with
its error, never raised.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx

from ..errors import MlcrunError
from .metrics import RequestRecord
from .workload import BenchRequest

_ERRNO = re.compile(r"^\[Errno -?\d+\]\s*")
_MAX_ERROR = 200  # characters of a server's error message kept on a record


def base_url(url: str) -> str:
    """The server's root: `url` without a trailing slash or `/v1`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _reason(err: Exception) -> str:
    """A transport error in a few words: 'connection refused', 'timed out', ..."""
    if isinstance(err, httpx.TimeoutException):
        return "timed out"
    lines = str(err).strip().splitlines()
    text = _ERRNO.sub("", lines[-1]) if lines else ""
    return text[:1].lower() + text[1:] if text else type(err).__name__


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 3] + "..."


def _error_message(body: bytes) -> str:
    """The message of an error body: OpenAI's {"error": {"message"}}, vLLM's {"message"}, or
    the body itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return _one_line(body.decode(errors="replace")) or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return _one_line(str(error["message"]))
        if data.get("message"):
            return _one_line(str(data["message"]))
        if isinstance(error, str):
            return _one_line(error)
    return _one_line(json.dumps(data))


def resolve_model(url: str, model: str | None, api_key: str | None, timeout: float) -> str:
    """`model`, or the first model the server lists; an MlcrunError when the server cannot be
    reached or does not answer /v1/models with an OpenAI model list."""
    root = base_url(url)
    try:
        r = httpx.get(f"{root}/v1/models", headers=_headers(api_key), timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise MlcrunError(f"cannot reach {root}: {_reason(err)}") from None
    if r.status_code != 200:
        raise MlcrunError(
            f"{root}/v1/models answered HTTP {r.status_code}: {_error_message(r.content)}"
        )
    try:
        ids = [str(m["id"]) for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise MlcrunError(f"{root}/v1/models did not answer an OpenAI model list") from None
    if model:
        return model
    if not ids:
        raise MlcrunError(f"{root} serves no models")
    return ids[0]


def reset_prefix_cache(url: str, api_key: str | None, timeout: float) -> str:
    """Ask the server to drop its prefix cache (`POST /reset_prefix_cache`: mlcrun serve, and
    vLLM in dev mode). "reset" when it did, else why not ("HTTP 404", "connection refused"):
    servers without the endpoint are benchmarked all the same."""
    try:
        r = httpx.post(
            f"{base_url(url)}/reset_prefix_cache", headers=_headers(api_key), timeout=timeout
        )
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        return _reason(err)
    return "reset" if r.status_code == 200 else f"HTTP {r.status_code}"


async def run_requests(
    url: str,
    requests: list[BenchRequest],
    *,
    model: str,
    concurrency: int | None,
    api_key: str | None = None,
    timeout: float = 600,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send `requests` at their arrival times, at most `concurrency` in flight (None: no
    limit). Returns the records by index and the wall time from the first send to the last
    completion."""
    endpoint = f"{base_url(url)}/v1/completions"
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    connections = max(1, concurrency or len(requests))
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)

    async def one(client: httpx.AsyncClient, req: BenchRequest, t0: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
        if slots is None:
            record = await _send(client, endpoint, model, req)
        else:
            async with slots:
                record = await _send(client, endpoint, model, req)
        if on_done is not None:
            on_done(record)
        return record

    async with httpx.AsyncClient(
        headers=_headers(api_key), timeout=timeout, limits=limits
    ) as client:
        t0 = time.perf_counter()  # after the client's setup, which takes milliseconds
        records = await asyncio.gather(*(one(client, req, t0) for req in requests))
        finished = time.perf_counter()
    first = min((r.start for r in records), default=finished)
    return sorted(records, key=lambda r: r.index), finished - first


def run_url(
    url: str,
    requests: list[BenchRequest],
    *,
    model: str | None = None,
    concurrency: int | None = None,
    api_key: str | None = None,
    timeout: float = 600,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float, str]:
    """Resolve the model, then run the workload: (records, wall seconds, model id)."""
    model_id = resolve_model(url, model, api_key, timeout)
    records, duration = asyncio.run(
        run_requests(
            url,
            requests,
            model=model_id,
            concurrency=concurrency,
            api_key=api_key,
            timeout=timeout,
            on_done=on_done,
        )
    )
    return records, duration, model_id


async def _send(
    client: httpx.AsyncClient, endpoint: str, model: str, req: BenchRequest
) -> RequestRecord:
    """One streamed completion; transport and server errors end up in `record.error`."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record = RequestRecord(index=req.index, prompt_len=req.prompt_len, start=time.perf_counter())
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                message = _error_message(await response.aread())
                record.error = f"HTTP {response.status_code}: {message}"
            else:
                await _read_stream(response, record)
    except httpx.HTTPError as err:
        record.error = _reason(err)
    return record


async def _read_stream(response: httpx.Response, record: RequestRecord) -> None:
    """Fill `record` from an SSE stream of completion chunks ending in `data: [DONE]`."""
    usage: dict[str, Any] | None = None
    usage_time = None
    complete = False  # [DONE] or a finish_reason seen: the stream was not cut short
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            complete = True
            break
        now = time.perf_counter()
        chunk = _json_object(data)
        if chunk is None:
            record.error = f"malformed stream chunk: {_one_line(data)}"
            return
        if "error" in chunk:  # a failure after the 200 headers were sent
            record.error = f"stream error: {_error_message(data.encode())}"
            return
        choices = chunk.get("choices") or []
        if any(c.get("text") for c in choices):
            record.chunk_times.append(now)
        complete = complete or any(c.get("finish_reason") for c in choices)
        if chunk.get("usage"):
            usage, usage_time = chunk["usage"], now
    if not complete:
        record.error = "stream ended before [DONE]"
        return
    _finish(record, usage, usage_time)


def _json_object(data: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _finish(record: RequestRecord, usage: dict[str, Any] | None, usage_time: float | None):
    """Token counts from the usage chunk when there is one, else one token per chunk."""
    usage = usage or {}
    record.output_len = usage.get("completion_tokens") or len(record.chunk_times)
    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    record.end = record.chunk_times[-1] if record.chunk_times else usage_time
    if record.end is None:
        record.error = "no output and no usage in the stream"
