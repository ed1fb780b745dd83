"""`mlcrun serve` with replicas under Ray Serve against one engine, measured with
`mlcrun bench --url`: 1 replica with 2 threads against 2 replicas with 1 thread each (and the
one-process server with 2 threads, for Ray's own cost), 16 concurrent clients, prompts that
share a long system prompt and prompts that share nothing.

    .venv/bin/python benchmarks/serve_replicas.py [--rounds 2] [--clients 16]

The model is the default one (SmolLM2-135M-Instruct, q4). Per (setup, workload, round): a
fresh server, one `mlcrun bench --url` run (its JSON: throughput, TTFT, the prefix-cache hit
rate from the responses' cached tokens), and the server's /metrics after it (per-replica
requests and hit rates). Writes benchmarks/results/serve_replicas.json, rendered into
docs/performance.md by performance_doc.py. Needs the `ray` extra. Not a test: nothing here
asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "results" / "serve_replicas.json"
READY = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")
MLCRUN = [sys.executable, "-m", "mlcrun"]
SETUPS = {  # name -> serve arguments
    "one process, 2 threads": ["--threads", "2"],
    "Ray, 1 replica x 2 threads": ["--replicas", "1", "--threads", "2"],
    "Ray, 2 replicas x 1 thread": ["--replicas", "2", "--threads", "1"],
}
SYSTEM = (
    "You are the support assistant of a small bakery. Answer in two sentences, politely, "
    "and only about the bakery: opening hours are 7 to 19 on weekdays and 8 to 14 on "
    "Saturdays; it is closed on Sundays; bread is baked twice a day, at 6 and at 13; cakes "
    "must be ordered two days ahead; the shop takes cards and cash; there is no parking, "
    "but the bus stops in front of the door. Never invent products. "
)


def start(artifact: Path, args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [*MLCRUN, "serve", str(artifact), "--port", "0", "--served-model-name", "m", *args],
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        match = READY.search(log.read_text())
        if match:
            return proc, f"http://127.0.0.1:{match.group(1)}"
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not ready in 600 s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def replica_metrics(url: str) -> dict[str, dict[str, float]]:
    """replica -> {requests, prompt_tokens, cached_tokens} from /metrics (empty: no replicas)."""
    out: dict[str, dict[str, float]] = {}
    names = {
        "mlcrun_replica_requests_total": "requests",
        "mlcrun_replica_prompt_tokens_total": "prompt_tokens",
        "mlcrun_replica_prompt_tokens_cached_total": "cached_tokens",
    }
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        m = re.match(r'(\w+)\{replica="([^"]+)"\} (\S+)', line)
        if m and m.group(1) in names:
            out.setdefault(m.group(2), {})[names[m.group(1)]] = float(m.group(3))
    return out


def bench(artifact: Path, url: str, workload: dict, clients: int, seed: int, tmp: Path) -> dict:
    out = tmp / "bench.json"
    cmd = [*MLCRUN, "bench", str(artifact), "--url", url, "--served-model", "m", "-c",
           str(clients), "--seed", str(seed), "--json", str(out), *workload["args"]]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    keep = ("output_throughput", "request_throughput", "prefix_cache_hit_rate", "completed")
    result = {k: summary[k] for k in keep}
    result["ttft_ms_median"] = summary["ttft_ms"]["median"]
    return result


def workloads(tmp: Path, prompts: int, seed: int) -> dict[str, dict]:
    rng = random.Random(seed)
    words = "flour oven crust loaf rye butter sugar yeast tart bun".split()
    shared = tmp / "shared.jsonl"
    with open(shared, "w") as f:
        for _ in range(prompts):
            question = " ".join(rng.choices(words, k=8))
            f.write(json.dumps({"prompt": f"{SYSTEM}Customer: {question}?\nAssistant:"}) + "\n")
    common = ["--num-prompts", str(prompts), "--output-len", "64"]
    return {
        "shared system prompt": {"args": [*common, "--dataset", str(shared)]},
        "nothing shared": {"args": [*common, "--input-len", "160"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--json", type=Path, default=OUT)
    args = parser.parse_args()
    from mlcrun.bench.report import machine_info
    from mlcrun.default_model import resolve_artifact

    artifact = Path(resolve_artifact(None))
    started, runs = time.time(), []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        loads = workloads(tmp, args.prompts, seed=0)
        for r in range(args.rounds):
            order = [(s, w) for s in SETUPS for w in loads]
            random.Random(r).shuffle(order)
            for setup, work in order:
                proc, url = start(artifact, SETUPS[setup], tmp / "serve.log")
                try:
                    result = bench(artifact, url, loads[work], args.clients, seed=r, tmp=tmp)
                    result["replicas"] = replica_metrics(url)
                finally:
                    stop(proc)
                runs.append({"round": r, "setup": setup, "workload": work, **result})
                print(f"round {r}: {setup:28s} {work:22s} {result['output_throughput']:.1f} "
                      f"tok/s, TTFT {result['ttft_ms_median']:.0f} ms, "
                      f"hit {result['prefix_cache_hit_rate']:.1%}", flush=True)  # fmt: skip
    doc = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [Path(sys.executable).name, *sys.argv],
        "machine": machine_info(),
        "clients": args.clients,
        "prompts": args.prompts,
        "rounds": args.rounds,
        "elapsed_s": round(time.time() - started),
        "runs": runs,
        "medians": medians(runs),
    }
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.json}")


def medians(runs: list[dict]) -> list[dict]:
    rows = []
    for setup in SETUPS:
        for work in sorted({r["workload"] for r in runs}):
            mine = [r for r in runs if r["setup"] == setup and r["workload"] == work]
            if mine:
                row = {"setup": setup, "workload": work}
                for key in ("output_throughput", "ttft_ms_median", "prefix_cache_hit_rate"):
                    row[key] = statistics.median(r[key] or 0.0 for r in mine)
                rows.append(row)
    return rows


if __name__ == "__main__":
    main()
