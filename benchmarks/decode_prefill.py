"""Decode and prefill speed of mlcrun against transformers (torch, CPU), same run, same machine.

    .venv/bin/python benchmarks/decode_prefill.py [--threads N] [--rounds 3]

Builds a SmolLM2-135M-shaped fp32 Llama checkpoint with random weights (hidden 576, 30 layers,
9 heads, 3 KV heads, intermediate 1536, vocab 49152, tied), compiles it with `mlcrun compile`,
then measures, interleaved round by round (A B A B ...), each engine in a fresh process:
decode tokens/s at batch 1 (after a 16-token prompt) and prefill tokens/s of a 512-token prompt.
The memory-bandwidth bound is measured in the same run with the same thread count (a read-only
sweep; the STREAM triad is printed too): decode can at best read every weight once per token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache"
SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
DECODE_TOKENS = 64
PREFILL_TOKENS = 512


def make_checkpoint() -> Path:
    folder = CACHE / "smollm2-135m-shape-fp32"
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    model.save_pretrained(folder)
    return folder


def compile_artifact(checkpoint: Path) -> Path:
    from mlcrun.compiler.build import is_up_to_date
    from mlcrun.compiler.options import CompileOptions

    out = CACHE / "smollm2-135m-shape-fp32-q0f32-cpu"
    cmd = [sys.executable, "-m", "mlcrun", "compile", str(checkpoint), "-o", str(out)]
    if not is_up_to_date(str(checkpoint), out, CompileOptions()):
        cmd.append("--force")  # compiled by an older mlcrun
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"mlcrun compile: {time.perf_counter() - start:.1f}s ({' '.join(cmd[2:])})")
    return out


# ------------------------------------------------------------------ workers (one process each)
def worker_mlcrun(artifact: Path, threads: int) -> dict:
    import numpy as np

    from mlcrun.runtime import Model

    model = Model(artifact, num_threads=threads)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, SHAPE["vocab_size"], PREFILL_TOKENS).tolist()
    model.add_new_sequence(0)
    model.batch_prefill(model.token_embed(prompt[:16]), [0], [16])  # warm-up
    model.remove_sequence(0)

    model.add_new_sequence(0)
    start = time.perf_counter()
    model.batch_prefill(model.token_embed(prompt), [0], [PREFILL_TOKENS])
    prefill_s = time.perf_counter() - start
    model.remove_sequence(0)

    model.add_new_sequence(0)
    logits = model.batch_prefill(model.token_embed(prompt[:16]), [0], [16])
    token = int(logits[0].argmax())
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        token = int(model.batch_decode(model.token_embed([token]), [0])[0].argmax())
    decode_s = time.perf_counter() - start
    return {"prefill_tps": PREFILL_TOKENS / prefill_s, "decode_tps": DECODE_TOKENS / decode_s}


def worker_transformers(checkpoint: Path, threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, SHAPE["vocab_size"], (1, PREFILL_TOKENS), generator=gen)
    with torch.inference_mode():
        model(prompt[:, :16])  # warm-up
        start = time.perf_counter()
        model(prompt)
        prefill_s = time.perf_counter() - start

        out = model(prompt[:, :16], use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - start
    return {"prefill_tps": PREFILL_TOKENS / prefill_s, "decode_tps": DECODE_TOKENS / decode_s}


def worker_triad(threads: int) -> dict:
    """Memory bandwidth with torch's thread pool, best of 10 (as STREAM reports): the triad
    a = b + s * c (GB/s counts 3 arrays moved) and a read-only sum, which is what decode does
    with the weights."""
    import torch

    torch.set_num_threads(threads)
    n = 1 << 26  # 256 MiB per float32 array: far past the caches
    b, c, a = torch.rand(n), torch.rand(n), torch.empty(n)

    def best(fn, nbytes: int) -> float:
        rates = []
        for _ in range(10):
            start = time.perf_counter()
            fn()
            rates.append(nbytes / (time.perf_counter() - start) / 1e9)
        return max(rates)

    return {
        "triad_gbps": best(lambda: torch.add(b, c, alpha=3.0, out=a), 3 * 4 * n),
        "read_gbps": best(lambda: b.sum(), 4 * n),
    }


def run_worker(kind: str, target: Path | None, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(threads)]
    if target is not None:
        cmd += ["--target", str(target)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=["mlcrun", "transformers", "triad"])
    parser.add_argument("--target", type=Path)
    args = parser.parse_args()
    if args.worker:
        fn = {"mlcrun": worker_mlcrun, "transformers": worker_transformers}.get(args.worker)
        result = worker_triad(args.threads) if fn is None else fn(args.target, args.threads)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return

    checkpoint = make_checkpoint()
    artifact = compile_artifact(checkpoint)
    config = json.loads((artifact / "mlcrun-config.json").read_text())
    weight_bytes = sum(
        4 * _prod(p["shape"]) for p in config["params"]
    )  # fp32; the tied embedding is read once, by the lm_head
    samples: dict[str, list[dict]] = {"mlcrun": [], "transformers": [], "triad": []}
    # This VM's bandwidth drifts by up to 2x within minutes: measure it right before each
    # engine's run and compare each decode with the bound of its own round.
    fraction: dict[str, list[float]] = {"mlcrun": [], "transformers": []}
    for r in range(args.rounds):
        for kind, target in (("mlcrun", artifact), ("transformers", checkpoint)):
            bw = run_worker("triad", None, args.threads)
            samples["triad"].append(bw)
            samples[kind].append(run_worker(kind, target, args.threads))
            bound_r = bw["read_gbps"] * 1e9 / weight_bytes
            fraction[kind].append(samples[kind][-1]["decode_tps"] / bound_r)
        print(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]}" for k, v in samples.items())
        )

    med = {k: {m: statistics.median(s[m] for s in v) for m in v[0]} for k, v in samples.items()}
    bandwidth = med["triad"]["read_gbps"]
    bound = bandwidth * 1e9 / weight_bytes
    ours, hf = med["mlcrun"], med["transformers"]
    print()
    print(
        f"machine: {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"{os.cpu_count()} CPUs; median of {args.rounds} rounds"
    )
    print(
        f"weights read per decoded token: {weight_bytes / 1e6:.0f} MB; read bandwidth "
        f"{bandwidth:.1f} GB/s (triad {med['triad']['triad_gbps']:.1f}) -> bound {bound:.1f} tok/s"
    )
    print(f"{'':24}{'mlcrun':>10}{'transformers':>14}{'ratio':>8}")
    for key, label in (
        ("decode_tps", "decode tok/s (batch 1)"),
        ("prefill_tps", f"prefill tok/s ({PREFILL_TOKENS})"),
        ("peak_rss_mb", "peak RSS (MB)"),
    ):
        print(f"{label:24}{ours[key]:>10.1f}{hf[key]:>14.1f}{ours[key] / hf[key]:>8.2f}")
    print(
        "decode vs the bandwidth bound measured just before it (median of rounds): "
        f"{100 * statistics.median(fraction['mlcrun']):.0f}% (mlcrun), "
        f"{100 * statistics.median(fraction['transformers']):.0f}% (transformers)"
    )


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
