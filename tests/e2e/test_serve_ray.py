"""`mlcrun serve --replicas 2` on a local Ray cluster: the held openai client tests of
test_serve.py, unchanged, against two engine replicas; greedy answers equal to the
one-process server's; prefix routing; a replica killed mid-stream; a drained shutdown.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import string
import subprocess
import sys
import threading
import time

import openai
import pytest
from conftest import MODEL, WAIT_TIMEOUT, ServerProcess

# The held tests: pytest collects them again in this module, where `server` is the replicas.
from test_serve import (  # noqa: F401
    test_chat_logprobs,
    test_chat_streamed_and_whole,
    test_chat_text_parts,
    test_completion_logprobs,
    test_completion_streamed_equals_whole,
    test_echo,
    test_health_and_metrics,
    test_json_object,
    test_json_schema_output_always_validates,
    test_models,
    test_n3_whole_and_streamed,
    test_seeded_sampling_is_deterministic,
    test_several_prompts_and_token_ids,
    test_stop_sequences,
    test_tokenize_detokenize,
    test_usage_counts_prompt_cached_and_completion_tokens,
)

REPLICAS = ("--replicas", "2", "--threads", "1")


def start(artifacts, tmp_path_factory, *args: str) -> ServerProcess:
    log = tmp_path_factory.mktemp("serve-ray") / "server.log"
    return ServerProcess(
        artifacts("llama"), log, "--served-model-name", MODEL, "--max-num-seqs", "16", *args
    )


def stop_cleanly(proc: ServerProcess) -> None:
    code = proc.stop()
    assert code == 0, f"the server exited with {code}:\n{proc.log()}"


@pytest.fixture(scope="module")
def server(artifacts, tmp_path_factory):
    proc = start(artifacts, tmp_path_factory, *REPLICAS)
    yield proc
    stop_cleanly(proc)
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def single(artifacts, tmp_path_factory):
    """The one-process server of the same artifact, for comparison."""
    proc = start(artifacts, tmp_path_factory)
    yield proc
    stop_cleanly(proc)


def by_replica(metrics: dict[str, float], name: str) -> dict[str, float]:
    """replica -> value of the per-replica series `name`."""
    prefix = f'{name}{{replica="'
    return {k[len(prefix) : -2]: v for k, v in metrics.items() if k.startswith(prefix)}


def pids(metrics: dict[str, float]) -> dict[str, int]:
    """replica -> its process id, from mlcrun_replica_info{pid=..., replica=...}."""
    out = {}
    for key in metrics:
        if key.startswith("mlcrun_replica_info{"):
            labels = dict(p.split("=", 1) for p in key[len("mlcrun_replica_info{") : -1].split(","))
            out[labels["replica"].strip('"')] = int(labels["pid"].strip('"'))
    return out


PROMPTS = ["Once upon a time", "The quick brown fox", "In a small village", "She said"]


def test_greedy_answers_equal_the_one_process_server(server, single):
    def answers(proc: ServerProcess) -> list[tuple[str, int]]:
        with openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="-", max_retries=0) as c:
            outs = [
                c.completions.create(
                    model=MODEL,
                    prompt=p,
                    max_tokens=24,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for p in PROMPTS
            ]
            chat = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=16,
                temperature=0,
            )  # fmt: skip
        return [(o.choices[0].text, o.usage.completion_tokens) for o in outs] + [
            (chat.choices[0].message.content, chat.usage.completion_tokens)
        ]

    assert answers(server) == answers(single)


def test_shared_prefix_lands_on_one_replica(server, client):
    shared = "You are a careful assistant who answers in one short sentence. " * 2
    before = server.metrics()
    for i in range(6):
        client.completions.create(
            model=MODEL, prompt=f"{shared}Question {i}:", max_tokens=2, temperature=0
        )
    after = server.metrics()
    requests = by_replica(after, "mlcrun_replica_requests_total")
    was = by_replica(before, "mlcrun_replica_requests_total")
    deltas = {r: requests[r] - was.get(r, 0) for r in requests}
    winner = max(deltas, key=deltas.get)
    assert deltas[winner] == 6 and sum(deltas.values()) == 6, deltas
    prompt = by_replica(after, "mlcrun_replica_prompt_tokens_total")[winner]
    cached = by_replica(after, "mlcrun_replica_prompt_tokens_cached_total")[winner]
    prompt -= by_replica(before, "mlcrun_replica_prompt_tokens_total").get(winner, 0)
    cached -= by_replica(before, "mlcrun_replica_prompt_tokens_cached_total").get(winner, 0)
    assert cached / prompt > 0.5, (cached, prompt)  # 5 of the 6 reused the shared prefix
    assert by_replica(after, "mlcrun_replica_prefix_cache_hit_rate")[winner] > 0


@pytest.fixture(scope="module")
def fragile(artifacts, tmp_path_factory):
    """A replicas server of its own, for the tests that kill a replica and stop it."""
    proc = start(artifacts, tmp_path_factory, *REPLICAS)
    yield proc
    proc.stop(signal.SIGKILL)


def long_stream(proc: ServerProcess, prompt: str):
    c = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="-", max_retries=0, timeout=60)
    return c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=200, n=8, temperature=1, seed=1, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def serve_until(proc: ServerProcess, done) -> set[str]:
    """Send unrelated prompts (each must succeed) until done(replicas in /metrics) holds: the
    router sends a prompt that matches nothing it has routed (under 10% of its tokens) to the
    replica holding the least, so every live replica gets some. Returns those replicas."""
    c = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="-", max_retries=0, timeout=60)
    deadline = time.monotonic() + WAIT_TIMEOUT
    rng = random.Random(0)
    for i in itertools.count():
        replicas = set(pids(proc.metrics()))
        if done(replicas):
            return replicas
        assert time.monotonic() < deadline, f"{i} requests, replicas seen: {replicas}"
        prompt = "".join(rng.choices(string.ascii_letters, k=48))
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        time.sleep(0.1)


def test_a_killed_replica_fails_its_stream_and_ray_replaces_it(fragile):
    originals = serve_until(fragile, lambda replicas: len(replicas) == 2)
    stream = iter(long_stream(fragile, "Once upon a time"))
    next(stream)  # generating on one replica, which has told the ingress so
    m = fragile.metrics()
    busy = [r for r, n in by_replica(m, "mlcrun_replica_requests_in_flight").items() if n]
    assert len(busy) == 1, m
    os.kill(pids(m)[busy[0]], signal.SIGKILL)
    with pytest.raises(openai.APIError, match="replica serving this request stopped"):
        for _ in stream:
            pass
    # new requests succeed meanwhile; the dead replica leaves /metrics, Ray starts another
    now = serve_until(fragile, lambda replicas: bool(replicas - originals))
    assert busy[0] not in now and len(now) == 2, now


def test_sigterm_drains_requests_in_flight(fragile):
    result = {}

    def read() -> None:
        chunks = list(long_stream(fragile, "Drain me"))
        result["finish"] = {c.choices[0].finish_reason for c in chunks if c.choices} - {None}

    reader = threading.Thread(target=read)
    reader.start()
    fragile.wait_for(lambda m: m["mlcrun_requests_in_flight"] >= 1, "the stream to start")
    code = fragile.stop(signal.SIGTERM)
    reader.join(WAIT_TIMEOUT)
    assert result.get("finish") == {"length"}, fragile.log()[-3000:]
    assert code == 0, fragile.log()[-3000:]


def test_replicas_without_ray_is_a_one_line_error(tmp_path):
    blocked = "import sys; sys.modules['ray'] = None; from mlcrun.cli.main import main; main()"
    run = subprocess.run(
        [sys.executable, "-c", blocked, "serve", str(tmp_path), "--replicas", "2"],
        capture_output=True,
        text=True,
        timeout=WAIT_TIMEOUT,
    )
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'mlcrun[ray]'" in lines[0], run.stderr
