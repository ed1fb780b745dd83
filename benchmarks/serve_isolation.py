"""Does the server's event loop ever wait for the engine? /health latency and the other streams'
inter-token gaps while 16 clients stream long prompts and one client misbehaves.

    .venv/bin/python benchmarks/serve_isolation.py [MODEL] [--url URL] [--clients 16]
        [--prompt-tokens 1500] [--max-tokens 64] [--big-bytes 4000000] [--metrics-hz 20]
        [--scenarios A,B,C] [--json benchmarks/results/serve_isolation.json]

Without --url it starts `mlcrun serve [MODEL] --port 0 --max-num-seqs CLIENTS` (the default
model when MODEL is not given; server mode sizes the KV cache for a full context per sequence,
so 16 x ~1,600 tokens fit) with its default threads, runs the scenarios against it, and stops
it. `--pythonpath DIR --mlcrun-home DIR --label NAME` run another checkout's server instead
(e.g. an older commit extracted with `git archive`), with its own artifact cache:

    .venv/bin/python benchmarks/serve_isolation.py --pythonpath /tmp/old \
        --mlcrun-home /tmp/old-home --label ca1d555 \
        --json benchmarks/results/serve_isolation_ca1d555.json

Every scenario: CLIENTS concurrent streamed /v1/completions (distinct ~PROMPT_TOKENS-token
prompts cut from the repository's docs, a unique head per client and scenario so the prefix
cache cannot share them; max_tokens MAX_TOKENS, temperature 0, ignore_eos) while a probe sends
GET /health every 50 ms and times each answer. Then:

* A (baseline): nothing else.
* B: once every stream has its first token, one more client POSTs a ~BIG_BYTES prompt
  (refused with a 400 for the context length after it is tokenized; that is expected). What
  matters is whether /health and the other streams stall meanwhile.
* C: one more client GETs /metrics METRICS_HZ times a second throughout.

Reported per scenario: worst and p99 /health latency, worst and p99 gap between consecutive
SSE chunks of the streams after their first token (all of them, and only those while every
stream is decoding, when no prefill chunk lengthens a step), the big request's latency and
status (B), the /metrics latency (C), generated tokens per second over the scenario's wall
time, and the client's own event-loop lag (a sanity check: if it is large, the client, not
the server, made the gaps). Timestamps are taken as each SSE line arrives (httpx, asyncio, one
process). This is a benchmark, not a test: nothing asserts a latency.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "serve_isolation"
DEFAULT_JSON = ROOT / "results" / "serve_isolation.json"
TEXT_SOURCES = ("README.md", "docs/serve.md", "docs/architecture.md", "benchmarks/README.md")
HEALTH_INTERVAL = 0.05
LAG_INTERVAL = 0.01


# ---------------------------------------------------------------------------- statistics
def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank, as worst-case figures should be read)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def summary_ms(values: list[float]) -> dict:
    """count, median, p99 and max of `values` (seconds) in milliseconds."""

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "count": len(values),
        "median_ms": ms(statistics.median(values)) if values else None,
        "p99_ms": ms(pct(values, 99)),
        "max_ms": ms(max(values)) if values else None,
    }


# ---------------------------------------------------------------------------- the server
def start_server(args) -> tuple[subprocess.Popen, str, Path, list[str]]:
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlcrun", "serve"]
    if args.model:
        cmd.append(args.model)
    cmd += ["--port", "0", "--max-num-seqs", str(args.clients), *shlex.split(args.server_args)]
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = str(Path(args.pythonpath).resolve())
    if args.mlcrun_home:
        env["MLCRUN_HOME"] = str(Path(args.mlcrun_home).resolve())
    log_path = CACHE / f"server-{args.label}.log"
    log = log_path.open("w")
    # cwd outside the repository: with --pythonpath, `-m mlcrun` must not find ./mlcrun first
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=CACHE, start_new_session=True
    )
    log.close()
    deadline = time.monotonic() + args.start_timeout
    pattern = re.compile(r"listening on (http://\S+?:\d+)")
    while time.monotonic() < deadline:
        match = pattern.search(log_path.read_text(errors="replace"))
        if match:
            return proc, match.group(1), log_path, cmd
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    stop_server(proc)
    tail = log_path.read_text(errors="replace")[-3000:]
    sys.exit(f"the server did not start (log {log_path}):\n{tail}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # graceful: drains (nothing is in flight by now)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def scrape(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


# ---------------------------------------------------------------------------- prompts
def source_text() -> list[str]:
    """Paragraphs of the repository's prose (ASCII only, so that a character is a byte)."""
    repo = ROOT.parent
    paragraphs = []
    for name in TEXT_SOURCES:
        path = repo / name
        if path.exists():
            text = path.read_text(errors="replace").encode("ascii", "ignore").decode()
            paragraphs += [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    if not paragraphs:
        sys.exit("no text to build prompts from")
    return paragraphs


async def tokenize(client: httpx.AsyncClient, text: str) -> list[int]:
    r = await client.post("/v1/tokenize", json={"prompt": text})
    r.raise_for_status()
    return r.json()["tokens"]


async def build_prompts(
    client: httpx.AsyncClient, paragraphs: list[str], heads: list[str], target: int
) -> tuple[list[str], list[int]]:
    """One prompt per head: the head, then the paragraphs in a shuffled order (seeded by the
    head), cut to `target` tokens through /v1/tokenize and /v1/detokenize, then counted again
    with /v1/tokenize as the server will count it."""
    prompts, counts = [], []
    for head in heads:
        rng = random.Random(head)
        order = paragraphs[:]
        rng.shuffle(order)
        text, i = head, 0
        while len(text) < target * 8:  # ~4 characters a token: plenty
            text += "\n\n" + order[i % len(order)]
            i += 1
        ids = await tokenize(client, text)
        r = await client.post("/v1/detokenize", json={"tokens": ids[:target]})
        r.raise_for_status()
        prompt = r.json()["prompt"]
        prompts.append(prompt)
        counts.append(len(await tokenize(client, prompt)))
    return prompts, counts


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def big_body(model: str, paragraphs: list[str], size: int) -> bytes:
    """A /v1/completions body of `size` bytes whose prompt is prose (and no stream)."""
    empty = json.dumps({"model": model, "prompt": "", "max_tokens": 16}).encode()
    room = size - len(empty)
    text, i = [], 0
    total = 0
    while total < room:
        part = paragraphs[i % len(paragraphs)] + "\n\n"
        text.append(part)
        total += len(json.dumps(part)) - 2
        i += 1
    prompt = "".join(text)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16}).encode()
    while len(body) > size:  # trim escapes' overshoot
        prompt = prompt[: -(len(body) - size)]
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16}).encode()
    return body


# ---------------------------------------------------------------------------- the clients
async def stream_one(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, on_first
) -> dict:
    """One streamed completion: the arrival time of every SSE data line, parsed afterwards
    (`on_first()` is called when the first one arrives)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    lines: list[tuple[float, str]] = []
    status = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            status = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    lines.append((time.perf_counter(), line))
                    if len(lines) == 1:
                        on_first()
    except httpx.HTTPError as err:
        return {"start": start, "end": time.perf_counter(), "error": repr(err), "status": status}
    end = time.perf_counter()
    chunks, usage, error = [], None, None
    for t, line in lines:
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            continue
        obj = json.loads(data)
        if "error" in obj:
            error = obj["error"]
        if obj.get("usage"):
            usage = obj["usage"]
        if obj.get("choices"):
            chunks.append(t)
    return {
        "start": start,
        "end": end,
        "status": status,
        "error": error,
        "chunks": chunks,
        "usage": usage,
    }


async def probe(client: httpx.AsyncClient, path: str, interval: float, stop: asyncio.Event):
    """GET `path` every `interval` seconds (the next right away if one took longer):
    [(sent at, latency, status)]."""
    samples = []
    next_at = time.perf_counter()
    while not stop.is_set():
        t = time.perf_counter()
        try:
            r = await client.get(path)
            await r.aread()
            status = r.status_code
        except httpx.HTTPError as err:
            status = repr(err)
        samples.append((t, time.perf_counter() - t, status))
        next_at = max(next_at + interval, time.perf_counter())
        await asyncio.sleep(next_at - time.perf_counter())
    return samples


async def loop_lag(stop: asyncio.Event) -> list[tuple[float, float]]:
    """How late this process's own event loop wakes up from a 10 ms sleep."""
    samples = []
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(LAG_INTERVAL)
        samples.append((t, time.perf_counter() - t - LAG_INTERVAL))
    return samples


async def send_big(client: httpx.AsyncClient, body: bytes) -> dict:
    start = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    try:
        r = await client.post("/v1/completions", content=body, headers=headers)
        status, text = r.status_code, r.text
    except httpx.HTTPError as err:
        status, text = None, repr(err)
    end = time.perf_counter()
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:300]
    return {"start": start, "end": end, "status": status, "message": message[:300]}


# ---------------------------------------------------------------------------- a scenario
async def run_scenario(name: str, url: str, model: str, prompts: list[str], args, big: bytes):
    clients = len(prompts)
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    timeout = httpx.Timeout(args.request_timeout)
    async with (
        httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as streams,
        httpx.AsyncClient(base_url=url, timeout=timeout) as health_client,
        httpx.AsyncClient(base_url=url, timeout=timeout) as side_client,
    ):
        before = scrape((await side_client.get("/metrics")).text)
        stop = asyncio.Event()
        lag_task = asyncio.create_task(loop_lag(stop))
        health_task = asyncio.create_task(probe(health_client, "/health", HEALTH_INTERVAL, stop))
        metrics_task = None
        if name == "C":
            period = 1 / args.metrics_hz
            metrics_task = asyncio.create_task(probe(side_client, "/metrics", period, stop))
        await asyncio.sleep(0.5)  # a few idle samples first (not counted)
        first_seen, all_started = [0], asyncio.Event()

        def on_first() -> None:
            first_seen[0] += 1
            if first_seen[0] == clients:
                all_started.set()

        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(stream_one(streams, model, p, args.max_tokens, on_first))
            for p in prompts
        ]
        big_result = None
        if name == "B":  # once every stream decodes (or has failed)
            started = asyncio.create_task(all_started.wait())
            await asyncio.wait([started, *tasks], return_when=asyncio.FIRST_COMPLETED)
            while not started.done() and not all(t.done() for t in tasks):
                await asyncio.wait([started, *tasks], return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            big_result = await send_big(side_client, big)
        results = await asyncio.gather(*tasks)
        t_end = max(r["end"] for r in results)
        stop.set()
        health = await health_task
        metrics = await metrics_task if metrics_task else None
        lag = await lag_task
        after = scrape((await side_client.get("/metrics")).text)
    return _report(name, t0, t_end, results, health, metrics, lag, big_result, before, after)


def _report(name, t0, t_end, results, health, metrics, lag, big, before, after) -> dict:
    errors = [r for r in results if r.get("error") or r.get("status") != 200]
    firsts = [r["chunks"][0] for r in results if r.get("chunks")]
    all_decoding = max(firsts) if len(firsts) == len(results) else None
    gaps, steady_gaps, per_stream = [], [], []
    for r in results:
        chunks = r.get("chunks") or []
        g = [b - a for a, b in zip(chunks, chunks[1:])]
        gaps += g
        if all_decoding is not None:
            steady_gaps += [b - a for a, b in zip(chunks, chunks[1:]) if a >= all_decoding]
        per_stream.append(
            {
                "ttft_s": round(chunks[0] - r["start"], 3) if chunks else None,
                "chunks": len(chunks),
                "max_gap_ms": round(max(g) * 1000, 1) if g else None,
                "prompt_tokens": (r.get("usage") or {}).get("prompt_tokens"),
                "cached_tokens": ((r.get("usage") or {}).get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                ),
                "completion_tokens": (r.get("usage") or {}).get("completion_tokens"),
                "chunk_times_s": [round(t - t0, 4) for t in chunks],
            }
        )
    window = [s for s in health if t0 <= s[0] <= t_end]
    generated = sum(
        (r.get("usage") or {}).get("completion_tokens") or len(r.get("chunks") or [])
        for r in results
    )
    wall = t_end - t0
    out = {
        "wall_s": round(wall, 2),
        "all_decoding_from_s": None if all_decoding is None else round(all_decoding - t0, 2),
        "stream_errors": [{k: r.get(k) for k in ("status", "error")} for r in errors],
        "generated_tokens": generated,
        "throughput_tok_s": round(generated / wall, 2) if wall > 0 else None,
        "decode_tok_s_all_decoding": None,
        "health": summary_ms([s[1] for s in window]),
        "health_non_200": sum(1 for s in window if s[2] != 200),
        "itl": summary_ms(gaps),
        "itl_all_decoding": summary_ms(steady_gaps),
        "client_loop_lag": summary_ms([s[1] for s in lag if t0 <= s[0] <= t_end]),
        "server_counters": {
            k: after[k] - before.get(k, 0.0)
            for k in sorted(after)
            if k.endswith("_total") and after[k] != before.get(k, 0.0)
        },
        "kv_pages_total": after.get("mlcrun_kv_pages_total"),
        "streams": per_stream,
        "health_samples": [[round(s[0] - t0, 4), round(s[1] * 1000, 2), s[2]] for s in window],
    }
    if all_decoding is not None:
        tokens = sum(sum(1 for t in r["chunks"] if t > all_decoding) for r in results)
        out["decode_tok_s_all_decoding"] = round(tokens / max(1e-9, t_end - all_decoding), 2)
    if big is not None:
        inside = [s for s in window if big["start"] <= s[0] <= big["end"]]
        big_gaps = []
        for r in results:
            chunks = r.get("chunks") or []
            big_gaps += [
                b - a for a, b in zip(chunks, chunks[1:]) if b >= big["start"] and a <= big["end"]
            ]
        out["big_request"] = {
            "bytes": None,
            "sent_at_s": round(big["start"] - t0, 2),
            "latency_s": round(big["end"] - big["start"], 3),
            "status": big["status"],
            "message": big["message"],
            "streams_ended_before_answer": sum(1 for r in results if r["end"] < big["end"]),
            "health_meanwhile": summary_ms([s[1] for s in inside]),
            "itl_meanwhile": summary_ms(big_gaps),
        }
    if metrics is not None:
        inside = [s for s in metrics if t0 <= s[0] <= t_end]
        out["metrics_scrapes"] = summary_ms([s[1] for s in inside])
        out["metrics_scrapes"]["non_200"] = sum(1 for s in inside if s[2] != 200)
    return out


# ---------------------------------------------------------------------------- main
def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem_kib / 2**20, 1),
        "platform": platform.platform(),
    }


def git_state() -> str | None:
    """The commit this checkout's server runs, "+ changes" when mlcrun/ differs from it."""
    repo = ROOT.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "mlcrun"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head} + changes in mlcrun/" if changes else head


async def main_async(args, url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        card = r.json()["data"][0]
        model, window = card["id"], card.get("max_model_len")
        target = args.prompt_tokens
        if window is not None and target + args.max_tokens > window:
            target = window - args.max_tokens - 16
            print(f"context window {window}: prompts cut to {target} tokens", file=sys.stderr)
        paragraphs = source_text()
        nonce = f"{time.time_ns():x}"  # a rerun against the same server must not hit its cache
        heads, scenarios = {}, args.scenarios.split(",")
        for name in scenarios:
            heads[name] = [  # distinct from the first token on
                f"{_digest(f'{nonce}-{name}-{i}')} Report {name}{i}: summarize these notes."
                for i in range(args.clients)
            ]
        prompts, counts = {}, {}
        for name in scenarios:
            prompts[name], counts[name] = await build_prompts(
                client, paragraphs, heads[name], target
            )
        big = big_body(model, paragraphs, args.big_bytes)
        # warm-up: one short request and one long one, so that nothing is compiled or paged in
        # during the first scenario
        warm = await build_prompts(client, paragraphs, [_digest(f"warm-up {nonce}")], target)
        await client.post(
            "/v1/completions",
            json={"model": model, "prompt": warm[0][0], "max_tokens": 8, "temperature": 0},
        )
    results = {}
    for name in scenarios:
        print(f"scenario {name} ...", file=sys.stderr, flush=True)
        load_before = _loadavg()
        results[name] = await run_scenario(name, url, model, prompts[name], args, big)
        results[name]["loadavg_1m_before_after"] = [load_before, _loadavg()]
        results[name]["prompt_tokens_tokenize"] = counts[name]
        if "big_request" in results[name]:
            results[name]["big_request"]["bytes"] = len(big)
        _print_row(name, results[name])
        await asyncio.sleep(args.pause)
    return {"model": model, "max_model_len": window, "prompt_tokens_target": target, **results}


def _loadavg() -> float | None:
    """The 1-minute load average (other work on the machine shows up here)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _print_row(name: str, r: dict) -> None:
    line = (
        f"  {name}: wall {r['wall_s']} s, {r['throughput_tok_s']} tok/s; /health max "
        f"{r['health']['max_ms']} ms p99 {r['health']['p99_ms']} ms; ITL max "
        f"{r['itl']['max_ms']} ms p99 {r['itl']['p99_ms']} ms (all decoding: max "
        f"{r['itl_all_decoding']['max_ms']} ms p99 {r['itl_all_decoding']['p99_ms']} ms); "
        f"client lag max {r['client_loop_lag']['max_ms']} ms; load "
        f"{r['loadavg_1m_before_after']}"
    )
    if "big_request" in r:
        b = r["big_request"]
        line += f"; big: {b['status']} in {b['latency_s']} s"
    if "metrics_scrapes" in r:
        line += f"; /metrics max {r['metrics_scrapes']['max_ms']} ms"
    if r["stream_errors"]:
        line += f"; STREAM ERRORS {r['stream_errors'][:2]}"
    print(line, file=sys.stderr, flush=True)


def dump(obj) -> str:
    """Indented JSON with every list of plain values on one line (the samples stay short)."""
    text = json.dumps(obj, indent=1)
    return _FLAT_LIST.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


_FLAT_LIST = re.compile(r"\[([^\[\]{}\"]*)\]")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="MODEL for mlcrun serve (default: the default model)")
    p.add_argument("--url", help="a running server instead of starting one")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--big-bytes", type=int, default=4_000_000, help="size of the big body")
    p.add_argument("--metrics-hz", type=float, default=20.0)
    p.add_argument("--scenarios", default="A,B,C")
    p.add_argument("--pause", type=float, default=2.0, help="seconds between scenarios")
    p.add_argument("--server-args", default="", help="more `mlcrun serve` options")
    p.add_argument("--pythonpath", help="serve from this checkout (PYTHONPATH)")
    p.add_argument("--mlcrun-home", help="MLCRUN_HOME for the server (its artifact cache)")
    p.add_argument("--label", default="head", help="name of this server in the JSON")
    p.add_argument("--start-timeout", type=float, default=1800)
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    if not 1 <= args.clients <= 16:
        p.error("--clients: 1 to 16")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    source = args.pythonpath or git_state()  # before the run: the tree may change meanwhile
    proc, server_cmd, log_path = None, None, None
    if args.url:
        url = args.url.rstrip("/").removesuffix("/v1")
    else:
        print("starting the server (a first run compiles the model) ...", file=sys.stderr)
        proc, url, log_path, server_cmd = start_server(args)
    try:
        report = asyncio.run(main_async(args, url))
    finally:
        if proc is not None:
            stop_server(proc)
    out = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "label": args.label,
        "source": source,
        "server": {
            "url": url if proc is None else None,
            "command": server_cmd,
            "pythonpath": args.pythonpath,
            "mlcrun_home": args.mlcrun_home,
            "log": None if log_path is None else str(log_path),
        },
        "settings": {
            "clients": args.clients,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "big_bytes": args.big_bytes,
            "metrics_hz": args.metrics_hz,
            "health_interval_s": HEALTH_INTERVAL,
        },
        **report,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(dump(out))
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
