"""The engine's own cost per token: LLM.generate's greedy decode against the same Model's bare
decode loop (embed + batch_decode, what `mlcrun bench --mode kernel` times), in one process.

    .venv/bin/python benchmarks/engine_overhead.py ARTIFACT [--tokens 200] [--runs 7]

Run it with TVM_NUM_THREADS=1 on a small model (e.g. a compile of the trained 260K-parameter
llama), where the engine's share is largest. Prints the medians of RUNS runs: generate tokens/s,
the model's step, and their difference per token (scheduling, sampling, detokenizing). Another
checkout: `cd / && PYTHONPATH=/tmp/old python /path/to/engine_overhead.py ARTIFACT`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlcrun import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    n = args.tokens
    llm = LLM(args.artifact)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    prompt = [1, 400, 300]
    tokens = llm.generate([prompt], params)[0].token_ids  # also the warm-up
    generate = []
    for _ in range(args.runs):
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        generate.append((time.perf_counter() - start) / n)
        assert out.token_ids == tokens
    model = llm.model
    model.create_kv_cache(max_num_sequence=1, max_total_sequence_length=len(prompt) + n + 16)
    step = []
    for _ in range(args.runs):
        model.add_new_sequence(0)
        model.batch_prefill(model.token_embed(prompt), [0], [len(prompt)])
        start = time.perf_counter()
        for token in tokens:
            model.batch_decode(model.token_embed([token]), [0])
        step.append((time.perf_counter() - start) / n)
        model.remove_sequence(0)
    g, s = statistics.median(generate), statistics.median(step)
    print(
        f"generate {1 / g:.0f} tok/s ({1e3 * g:.3f} ms/token); model step {1 / s:.0f} tok/s "
        f"({1e3 * s:.3f} ms); outside the model {1e3 * (g - s):.3f} ms/token"
    )


if __name__ == "__main__":
    main()
