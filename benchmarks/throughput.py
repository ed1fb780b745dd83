"""Generation throughput under concurrency: mlcrun's engine against transformers' batched
`generate`, same checkpoint, same prompts, same thread count, each engine in its own process.

    .venv/bin/python benchmarks/throughput.py [--concurrency 1,4,16,64] [--rounds 2]

Uses the SmolLM2-135M-shaped fp32 checkpoint of benchmarks/decode_prefill.py. Every request has
a 32-token prompt and generates exactly 64 tokens (EOS ignored); throughput is generated tokens
over wall time, prefill included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_prefill import SHAPE, compile_artifact, make_checkpoint  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS = 32, 64


def prompts(n: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(3, SHAPE["vocab_size"], size=(n, PROMPT_TOKENS)).tolist()


def worker_mlcrun(artifact: Path, concurrency: int, threads: int) -> dict:
    from mlcrun import LLM, EngineConfig, SamplingParams

    capacity = concurrency * (PROMPT_TOKENS + OUTPUT_TOKENS + 16) + 64  # KV room for all
    config = EngineConfig(
        max_num_sequence=concurrency,
        max_total_sequence_length=capacity,
        prefill_chunk_size=512,
        prefix_cache=False,
    )
    llm = LLM(artifact, num_threads=threads, engine_config=config)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(prompts(1), SamplingParams(max_tokens=4, temperature=0))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts(concurrency), params)
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": sum(len(o.token_ids) for o in outs) / elapsed}


def worker_transformers(checkpoint: Path, concurrency: int, threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = torch.tensor(prompts(concurrency))
    kwargs = dict(
        max_new_tokens=OUTPUT_TOKENS,
        min_new_tokens=OUTPUT_TOKENS,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
    return {"tokens_per_s": (out.shape[1] - PROMPT_TOKENS) * concurrency / elapsed}


def run_worker(kind: str, target: Path, concurrency: int, threads: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--target",
        str(target),
        "--concurrency",
        str(concurrency),
        "--threads",
        str(threads),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", choices=["mlcrun", "transformers"])
    parser.add_argument("--target", type=Path)
    args = parser.parse_args()
    if args.worker:
        fn = worker_mlcrun if args.worker == "mlcrun" else worker_transformers
        print(json.dumps(fn(args.target, int(args.concurrency), args.threads)))
        return

    checkpoint = make_checkpoint()
    artifact = compile_artifact(checkpoint)
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for c in levels:
            for kind, target in (("mlcrun", artifact), ("transformers", checkpoint)):
                tps = run_worker(kind, target, c, args.threads)["tokens_per_s"]
                results.setdefault((kind, c), []).append(tps)
                print(f"round {r + 1}: {kind:12} concurrency {c:3}: {tps:8.1f} tok/s", flush=True)
    print(
        f"\n{args.threads} threads, {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} tokens "
        f"each, median of {args.rounds} rounds"
    )
    print(f"{'concurrency':>12}{'mlcrun tok/s':>14}{'transformers':>14}{'ratio':>8}")
    base = None
    for c in levels:
        ours = statistics.median(results[("mlcrun", c)])
        theirs = statistics.median(results[("transformers", c)])
        base = base or ours
        print(
            f"{c:>12}{ours:>14.1f}{theirs:>14.1f}{ours / theirs:>8.2f}"
            f"   ({ours / base:.1f}x mlcrun at 1)"
        )


if __name__ == "__main__":
    main()
