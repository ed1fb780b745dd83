"""One request cannot hurt the others over HTTP: a pathological request or a client that walks
away leaves concurrent streams' texts unchanged; a request that fails inside the engine fails
alone (500 or an error event); a dead engine thread makes /health 503 and fails every request
instead of hanging. The in-process server here is real uvicorn on a loopback port, driven by
the real openai client; only the faults are injected."""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from conftest import MODEL

from mlcrun import LLM, EngineConfig
from mlcrun.serve.app import create_app
from mlcrun.serve.service import ServeOptions, Service

PROMPTS = [f"Story {i}: once upon a time" for i in range(8)]


def eight_streams(base_url: str, extra=None) -> list[str]:
    """The 8 texts, streamed concurrently; `extra(client)` runs alongside them."""

    async def main():
        async with openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0) as client:

            async def stream(prompt):
                chunks = await client.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                return "".join([c.choices[0].text async for c in chunks if c.choices])

            jobs = [stream(p) for p in PROMPTS]
            if extra is not None:
                jobs.append(extra(client))
            results = await asyncio.gather(*jobs)
            return results[: len(PROMPTS)]

    return asyncio.run(asyncio.wait_for(main(), timeout=300))


async def pathological(client):
    """What used to abort every request in flight (NaN logits: refused at the door now), the
    most extreme values the door lets in, and a client that leaves mid-stream."""
    for extreme in ({"temperature": 1e300, "min_tokens": 4}, {"repetition_penalty": 1e-300}):
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(
                model=MODEL, prompt="x", max_tokens=8, temperature=1, extra_body=extreme
            )
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=16,
        temperature=100,
        extra_body={"min_tokens": 8, "repetition_penalty": 0.01},
        response_format={"type": "json_object"},
    )
    chunks = await client.completions.create(
        model=MODEL, prompt="I will leave", max_tokens=200, stream=True
    )
    async for _ in chunks:
        break  # walk away: the request is aborted and its pages freed
    await chunks.close()


def test_a_pathological_request_leaves_eight_streams_unchanged(server):
    base = f"{server.base_url}/v1"
    alone = eight_streams(base)
    assert all(alone)
    assert eight_streams(base, pathological) == alone
    server.wait_idle()
    assert "Traceback" not in server.log()


class InProcess:
    """uvicorn serving create_app(Service.local(llm)) on a free port, in a thread of this
    process."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.service = Service.local(llm, ServeOptions(model_name=MODEL))
        config = uvicorn.Config(create_app(self.service), host="127.0.0.1", port=0, log_config=None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not (self.server.started or not self.thread.is_alive()):
            threading.Event().wait(0.01)
        assert self.server.started, "uvicorn did not start"
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.service.engine.shutdown()


@pytest.fixture
def inproc(artifacts):
    srv = InProcess(LLM(artifacts("llama"), engine_config=EngineConfig(max_num_sequence=4)))
    yield srv
    srv.stop()


class BrokenGrammar:
    """A constraint whose state breaks after two tokens (as a grammar engine bug would)."""

    def __init__(self):
        self.n = 0

    def allowed(self, vocab_size):
        if self.n == 2:
            raise RuntimeError("grammar engine crashed")
        return np.ones(vocab_size, dtype=bool)

    def accept(self, token):
        self.n += 1
        return False


def test_a_request_failing_inside_the_engine_fails_alone(inproc):
    inproc.service.grammars.constraint = lambda fmt: BrokenGrammar if fmt else None
    client = openai.OpenAI(base_url=f"{inproc.base_url}/v1", api_key="k", max_retries=0)
    fmt = {"response_format": {"type": "json_object"}}
    want = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0)

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{inproc.base_url}/v1", api_key="k", max_retries=0
        ) as aclient:

            async def broken_whole():
                with pytest.raises(openai.InternalServerError, match="grammar engine crashed"):
                    await aclient.completions.create(
                        model=MODEL, prompt="Hi", max_tokens=12, extra_body=fmt
                    )

            async def broken_stream():
                stream = await aclient.completions.create(
                    model=MODEL, prompt="Hi", max_tokens=12, extra_body=fmt, stream=True
                )
                with pytest.raises(openai.APIError, match="grammar engine crashed"):
                    async for _ in stream:
                        pass

            async def fine():
                return await aclient.completions.create(
                    model=MODEL, prompt="Hello", max_tokens=12, temperature=0
                )

            _, _, got = await asyncio.gather(broken_whole(), broken_stream(), fine())
            return got

    got = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert got.choices[0].text == want.choices[0].text
    assert httpx.get(f"{inproc.base_url}/health").status_code == 200


def test_a_dead_engine_thread_makes_health_503_and_fails_requests(inproc):
    client = openai.OpenAI(base_url=f"{inproc.base_url}/v1", api_key="k", max_retries=0)
    assert httpx.get(f"{inproc.base_url}/health").status_code == 200
    stream = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # generating

    def bug():
        raise RuntimeError("scheduler bug")

    inproc.llm.engine.scheduler.schedule = bug
    with pytest.raises(openai.APIError, match="scheduler bug"):
        for _ in stream:
            pass
    health = httpx.get(f"{inproc.base_url}/health")
    assert health.status_code == 503 and "scheduler bug" in health.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt="Again", max_tokens=4)
    assert err.value.status_code == 503
    assert httpx.post(f"{inproc.base_url}/reset_prefix_cache").status_code == 503
