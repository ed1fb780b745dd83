"""`mlcrun bench` as a real process: every mode on a tiny artifact, the JSON it writes, the
same workload offline and over HTTP, and bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlcrun.bench.report import validate


def bench(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlcrun", "bench", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TVM_NUM_THREADS": "1"},
    )


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_kernel_mode_reports_every_test(artifacts, tmp_path):
    out = tmp_path / "k.json"
    result = bench(
        artifacts("llama"), "--mode", "kernel", "-p", "16,40", "-b", "1,3", "-d", "0,8",
        "-n", "4", "-r", "2", "--json", out,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["mode"] == "kernel" and doc["config"]["repetitions"] == 2
    names = [r["test"] for r in doc["runs"]]
    assert names == [
        "pp16@d0", "pp40@d0", "pp16@d8", "pp40@d8", "tg4x1@d0", "tg4x3@d0", "tg4x1@d8", "tg4x3@d8"
    ]  # fmt: skip
    for run in doc["runs"]:
        assert len(run["samples"]) == 2 and all(s > 0 for s in run["samples"])
        work = run["batch"] * (run["prompt_len"] or 4)
        rates = [work / s for s in run["samples"]]
        assert run["tokens_per_s"]["mean"] == pytest.approx(sum(rates) / 2)
        assert run["test"] in result.stdout
    assert doc["model"]["params_sha256"] and doc["machine"]["cores"] >= 1


WORKLOAD = ("--num-prompts", 6, "--input-len", "4:20", "--output-len", "3:9")


def serve_sim(target, tmp_path, name, *extra, workload=WORKLOAD) -> dict:
    out = tmp_path / f"{name}.json"
    result = bench(target, *workload, "-c", "1,3", "--seed", 7, "--json", out, *extra)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    validate(doc)
    return doc


def test_serve_sim_offline_and_over_http_send_the_same_tokens(artifacts, server, tmp_path):
    offline = serve_sim(artifacts("llama"), tmp_path, "offline")
    online = serve_sim(artifacts("llama"), tmp_path, "online", "--url", server.base_url)
    assert online["model"]["url"] == server.base_url and online["config"]["url"]
    for doc in (offline, online):
        assert [run["concurrency"] for run in doc["runs"]] == [1, 3]
        for run in doc["runs"]:
            assert run["summary"]["completed"] == 6 and run["summary"]["failed"] == 0
            assert run["summary"]["ttft_ms"]["mean"] > 0
    shape = [[(s["prompt_len"], s["output_len"]) for s in r["samples"]] for r in offline["runs"]]
    assert shape == [
        [(s["prompt_len"], s["output_len"]) for s in r["samples"]] for r in online["runs"]
    ]
    lens = shape[0]
    assert all(4 <= p <= 20 and 3 <= o <= 9 for p, o in lens) and len(set(lens)) > 1
    summary = offline["runs"][1]["summary"]
    assert summary["total_output_tokens"] == sum(o for _, o in lens)
    assert summary["output_throughput"] == pytest.approx(
        summary["total_output_tokens"] / summary["duration_s"]
    )


def test_every_level_over_http_starts_with_a_reset_cache(artifacts, server, tmp_path):
    """Against the real server: each level resets the prefix cache and sends fresh prompts, so
    no prompt token of a later level is served from the cache."""
    doc = serve_sim(artifacts("llama"), tmp_path, "levels", "--url", server.base_url)
    assert doc["config"]["fresh_prompts_per_level"] is True
    for run in doc["runs"]:
        assert run["engine"]["prefix_cache_reset"] == "reset"
        assert run["summary"]["prefix_cache_hit_rate"] == 0
        assert all(s["cached_tokens"] == 0 for s in run["samples"])


class _RecordingServer(BaseHTTPRequestHandler):
    """A minimal OpenAI completions server that records what it is sent: every prompt, and
    each /reset_prefix_cache call (answered 404 when `resets` is None)."""

    prompts: list = []
    resets: list | None = []

    def do_GET(self):
        self._reply(200, b'{"data": [{"id": "fake"}]}', "application/json")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/reset_prefix_cache":
            if self.resets is None:
                return self._reply(404, b'{"detail": "Not Found"}', "application/json")
            self.resets.append(len(self.prompts))  # how many prompts came before the reset
            return self._reply(200, b'{"dropped": 0}', "application/json")
        request = json.loads(body)
        self.prompts.append(request["prompt"])
        chunks = [{"choices": [{"index": 0, "text": "x"}]}] * request["max_tokens"]
        chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        usage = {
            "prompt_tokens": len(request["prompt"]),
            "completion_tokens": request["max_tokens"],
        }
        chunks.append({"choices": [], "usage": usage})
        stream = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        self._reply(200, stream + b"data: [DONE]\n\n", "text/event-stream")

    def _reply(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("can_reset", [True, False])
def test_later_levels_never_resend_earlier_prompts(artifacts, tmp_path, can_reset):
    """What a server receives over a 1,3 sweep: each level its own prompts (same lengths, no
    prompt of the first level again), and a reset before each level when it has the endpoint;
    a server without it (404) is benchmarked all the same, the run saying so."""
    handler = type(
        "Handler", (_RecordingServer,), {"prompts": [], "resets": [] if can_reset else None}
    )
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        doc = serve_sim(artifacts("llama"), tmp_path, "fake", "--url", url)
    finally:
        httpd.shutdown()
        httpd.server_close()
    first = [s["prompt_len"] for s in doc["runs"][0]["samples"]]
    n = len(first)
    sent = handler.prompts
    assert len(sent) == 2 * n
    levels = [sent[:n], sent[n:]]  # concurrency 1 finishes before concurrency 3 starts
    assert sorted(map(len, levels[0])) == sorted(map(len, levels[1])) == sorted(first)
    assert not {tuple(p) for p in levels[0]} & {tuple(p) for p in levels[1]}
    assert all(isinstance(t, int) for p in sent for t in p)
    status = [run["engine"]["prefix_cache_reset"] for run in doc["runs"]]
    if can_reset:
        assert handler.resets == [0, n] and status == ["reset", "reset"]
    else:
        assert status == ["HTTP 404", "HTTP 404"]


def test_serve_sim_dataset_and_plot(artifacts, tmp_path):
    data = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "hello there", "output_len": 3},
        {"conversations": [{"from": "human", "value": "a b c"}, {"from": "gpt", "value": "d e"}]},
        {"prompt": "the quick brown fox", "max_tokens": 5},
    ]
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    plot = tmp_path / "bench.png"
    extra = ("--dataset", data, "--plot", plot)
    doc = serve_sim(artifacts("llama"), tmp_path, "data", *extra, workload=())
    samples = doc["runs"][0]["samples"]
    assert len(samples) == 3 and doc["config"]["dataset"] == str(data)
    assert [s["output_len"] for s in samples][0::2] == [3, 5]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_malformed_dataset_line_is_one_line_error(artifacts, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok"}\n{"prompt": 12\n')
    one_line_error(bench(artifacts("llama"), "--dataset", data), "bad.jsonl:2")


def test_unreachable_url_is_one_line_error(artifacts):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    one_line_error(bench(artifacts("llama"), "--url", url, "--num-prompts", 2), url)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--num-prompts", "0"], "--num-prompts"),
        (["--num-prompts", "-3"], "--num-prompts"),
        (["-c", "0"], "--concurrency"),
        (["--input-len", "-5"], "--input-len"),
        (["--request-rate", "0"], "--request-rate"),
        (["--mode", "kernel", "-b", "0"], "--batches"),
        (["--mode", "kernel", "-r", "0"], "--repetitions"),
        (["--mode", "kernel", "-p", "16", "-d", "0", "-b", "64"], "max batch"),
        (["--mode", "kernel", "-p", "600"], "context window"),
        (["--mode", "fast"], "--mode"),
    ],
)
def test_bad_counts_are_one_line_errors(artifacts, args, needle):
    one_line_error(bench(artifacts("llama"), *args), needle)


def test_kernel_profile_names_the_kernels_of_a_decode_step(artifacts, tmp_path):
    out = tmp_path / "p.json"
    args = ("--mode", "kernel", "-p", "8", "-b", "1", "-d", "16", "-n", "2", "-r", "1")
    result = bench(artifacts("llama"), *args, "--profile", "--json", out)
    assert result.returncode == 0, result.stderr
    profile = json.loads(out.read_text())["profile"]
    assert profile["step_ms"] > 0 and profile["depth"] == 16
    names = [k["name"] for k in profile["kernels"]]
    layers = 2  # the tiny llama checkpoint
    attention = [k for k in profile["kernels"] if "attention" in k["name"]]
    assert attention and attention[0]["calls"] == layers
    assert "rms_norm" in names and "VM builtins" in names and "other" in names
    assert "one decode step" in result.stdout
    assert "verify_profile" not in json.loads(out.read_text())


def test_kernel_profile_of_a_verify_step(artifacts, tmp_path):
    out = tmp_path / "v.json"
    args = ("--mode", "kernel", "-p", "8", "-b", "1", "-d", "16", "-n", "2", "-r", "1")
    result = bench(artifacts("llama"), *args, "-k", "2,3", "--profile", "--json", out)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    decode, verify = doc["profile"], doc["verify_profile"]
    assert decode["tokens"] == 1 and verify["tokens"] == 4  # the largest K + 1
    assert verify["depth"] == 16 and verify["step_ms"] > 0
    attention = [k for k in verify["kernels"] if "attention" in k["name"]]
    assert attention and attention[0]["calls"] == 2  # one per layer
    # the verify step runs the verify function's kernels, not the decode step's
    assert {k["name"] for k in verify["kernels"]} != {k["name"] for k in decode["kernels"]}
    assert "one verify step of 4 tokens" in result.stdout
