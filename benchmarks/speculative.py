"""Speculative decoding side by side: mlcrun's modes against plain decoding, with llama.cpp's and
transformers' prompt lookup beside them; same prompts, same machine, same threads, one run.

    .venv/bin/python benchmarks/speculative.py [--models q4,f32]
        [--engines mlcrun,llama.cpp,transformers] [--rounds 2] [--seed S] [--threads N]
        [--quick] [--commit REV] [--json benchmarks/results/speculative.json]

Models: SmolLM2-135M-Instruct. `q4` is the default model's GGUF (Q4_1 layers, Q8_0 embedding):
mlcrun compiles it with `-q auto` (q4f16_1+q8f16), llama.cpp runs the file itself. `f32` is the
same weights dequantized: mlcrun compiles the same GGUF with `-q q0f32` (with its q4f16_1+q8f16
self-draft, `--draft-quantization`), llama.cpp runs the F32 GGUF and transformers the fp32
safetensors that benchmarks/compare.py prepares (its helpers, imported). Artifacts are cached
under benchmarks/.cache/speculative/ (the F32 GGUF and safetensors under .cache/compare/smollm2/).

Prompts: 6 input-grounded chat prompts (fix typos in, summarize, quote or edit a given text or
code) and 6 open chat prompts, rendered with the model's chat template by mlcrun's tokenizer;
the same token ids for every engine. Greedy, 256 new tokens, EOS ignored (generation goes on
past it), so every engine generates exactly 256 tokens of every prompt.

Every (engine, model, mode) runs in its own fresh process, interleaved round by round, each
round in a random order (compare.py's `round_orders`: a fresh shuffle per round from one seeded
generator; the seed and the orders go into the JSON), so that no mode always runs first or
after another (a process's placement moves a 16-way run by a few percent: in one process, F32
`self` with no draft at all ran 3.6% faster than plain, while fixed-order rounds had it 3.5%
slower); medians over rounds. Per process: a short warm-up, then each prompt alone (batch 1):
decode tokens/s (tokens after the first over the time after the first) and what the drafts did;
for mlcrun's plain and adaptive modes also 16 concurrent requests (the prompts cycled, 256
tokens each): generated tokens over wall time. A speculative mode's process also loads the
target without speculation and runs the same 16 requests with it, twice, around its own two
runs (plain, mode, mode, plain or the reverse, alternating by round): the 16-way target counts
that paired ratio, because two processes' 16-way rates differ by a few percent with nothing but
their placement and time apart (the plain process's rate is still compared, as `ratio`).
mlcrun's adaptive draft length measures step costs at its first start and caches them in
$MLCRUN_HOME/spec-costs; $MLCRUN_HOME is benchmarks/.cache/speculative/mlcrun-home and one
warm-up start per configuration precedes the rounds, so no measured process pays for it (and
only generation is timed anyway).

Modes: mlcrun plain, ngram (adaptive K; K=5), self (F32 only: adaptive; K=3), draft (F32 target,
the q4 artifact as the draft model: the only smaller model with SmolLM2's tokenizer available
offline, i.e. the same weights at 4 bits, much like `self`); llama.cpp plain and prompt lookup
(llama-cpp-python's LlamaPromptLookupDecoding, num_pred_tokens=10, max_ngram_size=2) on q4 and
f32; transformers plain and prompt_lookup_num_tokens=10 on f32 (it runs fp32 only).

A benchmark, never a test: nothing asserts a speed. The only assertion is that every engine
generated the requested number of tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import compare  # benchmarks/compare.py: weight preparation, machine and version info

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "speculative"
HOME = CACHE / "mlcrun-home"  # $MLCRUN_HOME of every worker: spec-costs, drafts
DEFAULT_JSON = ROOT / "results" / "speculative.json"
QUICK_JSON = CACHE / "speculative-quick.json"
RESULT_MARK = compare.RESULT_MARK
DRAFT_QUANTIZATION = "q4f16_1+q8f16"
LOOKUP_TOKENS = 10  # llama.cpp's num_pred_tokens, transformers' prompt_lookup_num_tokens
LOOKUP_NGRAM = 2  # both libraries' default max n-gram size
KINDS = ("grounded", "open")
MODELS = ("q4", "f32")
ENGINES = ("mlcrun", "llama.cpp", "transformers")


@dataclass(frozen=True)
class Settings:
    prompts_per_kind: int = 6
    tokens: int = 256
    concurrency: int = 16
    warmup_tokens: int = 8

    def kv_tokens(self, longest_prompt: int) -> int:
        """KV room for `concurrency` sequences of the longest prompt plus the answer and the
        deepest draft tree (rounded up to pages of 256)."""
        need = self.concurrency * (longest_prompt + self.tokens + 32)
        return -(-need // 256) * 256


FULL = Settings()
QUICK = Settings(prompts_per_kind=2, tokens=32)


# ------------------------------------------------------------------ prompts
TYPO_TEXT = (
    "The lighthouse on the northern cliff has stood for more then two hundred years. It was "
    "bulit in 1812 by a local stonemason who had never seen the sea befor he arrived in the "
    "vilage. Every night, the keeper climbed the one hundred and twelve steps to light the "
    "lamp, and every morning he wrote the wether in a small leather book. The book is now "
    "kept in the town musuem, where visiters can read about storms, shipwrecks and the long "
    "quiet winters. In 1924 the lamp was replaced by an electric light, and the last keeper "
    "left in 1961. Today the lighthouse is run by a charity that ofers guided tours in the "
    "sumer. From the top, on a clear day, you can see the islands to the west and the old "
    "harbour wall, wich was rebuilt after the great storm of 1953."
)
COFFEE_TEXT = (
    "Coffee was first cultivated in Yemen in the fifteenth century, although legends place "
    "its discovery earlier, in the highlands of Ethiopia. From the port of Mocha, traders "
    "shipped the beans across the Red Sea to Egypt and Turkey, where coffee houses became "
    "places to talk, play chess and hear the news. In the seventeenth century coffee reached "
    "Venice, London and Amsterdam. Dutch traders smuggled seedlings out of Yemen and started "
    "plantations in Java, and a single plant given to the French king became the ancestor of "
    "most of the coffee later grown in the Caribbean and Latin America. Brazil became the "
    "largest producer in the nineteenth century and remains so today. Coffee is now grown in "
    "more than seventy countries, mostly by small farmers, and the price they receive can "
    "swing widely from year to year. Two species dominate the market: arabica, which grows at "
    "high altitude and has a milder taste, and robusta, which is hardier, contains more "
    "caffeine and is often used in instant coffee."
)
LOG_CODE = """\
def parse_log(lines, min_level="INFO"):
    levels = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    threshold = levels.index(min_level)
    counts = {level: 0 for level in levels}
    messages = []
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(" ", 2)
        if len(parts) < 3:
            raise ValueError(f"line {number}: expected 'TIME LEVEL MESSAGE'")
        time, level, message = parts
        if level not in levels:
            raise ValueError(f"line {number}: unknown level {level!r}")
        counts[level] += 1
        if levels.index(level) >= threshold:
            messages.append((time, level, message))
    first = messages[0][0] if messages else None
    last = messages[-1][0] if messages else None
    return {
        "counts": counts,
        "messages": messages,
        "first": first,
        "last": last,
    }
"""
BEES_TEXT = (
    "Honey bees live in colonies of up to sixty thousand insects. Each colony has a single "
    "queen, a few hundred male drones and thousands of female workers, and every bee has a "
    "job that changes as it grows older.\n\n"
    "Young workers stay inside the hive. They clean the cells, feed the larvae, build new "
    "comb from wax and guard the entrance. Only after about three weeks do they leave the "
    "hive to collect nectar, pollen and water, flying up to five kilometres from home.\n\n"
    "When a forager finds a good patch of flowers, it returns and performs a dance on the "
    "comb. The angle of the dance points the other bees towards the flowers, and its length "
    "tells them how far away they are."
)
AVERAGE_CODE = """\
def moving_average(values, window):
    result = []
    tmp = 0.0
    for i, value in enumerate(values):
        tmp += value
        if i >= window:
            tmp -= values[i - window]
        if i >= window - 1:
            result.append(tmp / window)
    return result


def normalize(values):
    tmp = sum(values)
    if tmp == 0:
        return [0.0 for _ in values]
    return [value / tmp for value in values]
"""
EMAIL_TEXT = (
    "Hi Sarah,\n\n"
    "Thank you for you're email. I has looked at the report and I think the numbers in the "
    "second table is wrong, because the totals doesn't match the figures from last month. "
    "Could you checks them before the meeting on thursday? Also, the chart on page four are "
    "missing it's labels. I will send you my notes tomorrow morning, and we can discussed "
    "them after lunch if your free.\n\n"
    "Best regards,\nTom"
)
GROUNDED = [
    ("fix-typos", f"Fix the typos in this paragraph:\n\n{TYPO_TEXT}"),
    ("docstring", f"Repeat this code, adding a docstring:\n\n```python\n{LOG_CODE}```"),
    ("summarize", f"Summarize this text:\n\n{COFFEE_TEXT}"),
    ("quote", f"Quote the second paragraph of this text:\n\n{BEES_TEXT}"),
    (
        "rename",
        "Rewrite this code, renaming the variable `tmp` to `total`:\n\n"
        f"```python\n{AVERAGE_CODE}```",
    ),
    ("grammar", f"Correct the grammar in this email, changing nothing else:\n\n{EMAIL_TEXT}"),
]
OPEN = [
    ("story", "Write a short story about a lighthouse keeper."),
    ("vaccines", "Explain how vaccines work."),
    ("language", "What are some tips for learning a new language?"),
    ("poem", "Write a poem about autumn."),
    ("water-cycle", "Describe the water cycle to a ten-year-old."),
    ("remote-work", "What are the pros and cons of working from home?"),
]


def build_prompts(artifact: Path, settings: Settings) -> list[dict]:
    """Chat-template token ids (mlcrun's tokenizer), `prompts_per_kind` of each kind."""
    from mlcrun.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(artifact)
    out = []
    for kind, items in (("grounded", GROUNDED), ("open", OPEN)):
        for name, text in items[: settings.prompts_per_kind]:
            ids = tok.apply_chat_template([{"role": "user", "content": text}])
            out.append({"name": name, "kind": kind, "text": text, "ids": ids})
    return out


def throughput_prompts(prompts: list[dict], settings: Settings) -> list[list[int]]:
    return [prompts[i % len(prompts)]["ids"] for i in range(settings.concurrency)]


# ------------------------------------------------------------------ variants
@dataclass
class Variant:
    """One engine running one model in one mode."""

    engine: str
    model: str
    mode: str  # "plain", "ngram", "ngram K=5", ..., "prompt lookup"
    target: str
    options: dict = field(default_factory=dict)  # mlcrun: EngineConfig speculation fields
    throughput: bool = False  # also the 16-way test
    samples: list[dict] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.engine}/{self.model}/{self.mode}"

    def spec(self) -> dict:
        return {
            "engine": self.engine,
            "model": self.model,
            "mode": self.mode,
            "target": self.target,
            "options": self.options,
            "throughput": self.throughput,
        }


def mlcrun_modes(model: str, q4_artifact: Path) -> list[tuple[str, dict]]:
    modes = [
        ("plain", {}),
        ("ngram", {"speculative_mode": "ngram"}),
        ("ngram K=5", {"speculative_mode": "ngram", "spec_draft_length": 5}),
    ]
    if model == "f32":  # a q4 model is refused as a self-draft target, and is the draft
        modes += [
            ("self", {"speculative_mode": "self", "draft_quantization": DRAFT_QUANTIZATION}),
            (
                "self K=3",
                {
                    "speculative_mode": "self",
                    "draft_quantization": DRAFT_QUANTIZATION,
                    "spec_draft_length": 3,
                },
            ),
            ("draft", {"speculative_mode": "draft", "draft_model": str(q4_artifact)}),
        ]
    return modes


def adaptive(options: dict) -> bool:
    return bool(options.get("speculative_mode")) and not options.get("spec_draft_length")


# ------------------------------------------------------------------ workers (one process each)
def per_prompt(tokens: list[int], times: list[float], n: int, **extra) -> dict:
    """Decode rate as mlcrun's metrics.decode_tokens_per_s: the tokens after the first (those
    that arrived with the first, e.g. drafts accepted in the first step, count as first) over
    the time after the first."""
    if len(tokens) != n or len(times) != n:
        raise RuntimeError(f"generated {len(tokens)} tokens ({len(times)} times), expected {n}")
    first = sum(1 for t in times if t == times[0])
    seconds = times[-1] - times[0]
    return {
        "tokens": [int(t) for t in tokens],
        "decode_tokens": n - first,
        "decode_s": seconds,
        "decode_tps": (n - first) / seconds if seconds > 0 else None,
        **extra,
    }


def worker_mlcrun(spec: dict, prompts: list[dict], threads: int, settings: Settings) -> dict:
    from mlcrun import LLM, EngineConfig, SamplingParams

    config = EngineConfig(
        max_num_sequence=settings.concurrency,
        max_total_sequence_length=settings.kv_tokens(max(len(p["ids"]) for p in prompts)),
        prefix_cache=False,  # every prompt prefilled in full, whatever ran before
        **spec["options"],
    )
    start = time.perf_counter()
    llm = LLM(spec["target"], num_threads=threads, engine_config=config)
    load_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=settings.tokens, temperature=0, ignore_eos=True)
    warm = SamplingParams(max_tokens=settings.warmup_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompts[0]["ids"]], warm)
    results = []
    for p in prompts:
        out = llm.generate([p["ids"]], params)[0]
        m = out.metrics
        accepted = m.accepted_tokens
        results.append(
            per_prompt(
                out.token_ids,
                m.token_times,
                settings.tokens,
                ttft_s=m.ttft,
                spec_steps=m.spec_steps,
                draft_tokens=m.draft_tokens,
                accepted_tokens=accepted,
                # one target forward per decode step (plain or verify): the first token came
                # from the prefill, every accepted draft saved one
                forwards=settings.tokens - 1 - accepted,
            )
        )
    import mlcrun

    result = {"load_s": load_s, "prompts": results, "resolved": resolved_config(llm)}
    result["resolved"]["mlcrun_file"] = mlcrun.__file__
    if spec["throughput"]:
        batch = throughput_prompts(prompts, settings)
        if not spec["options"].get("speculative_mode"):
            mine = throughput_run(llm, batch, params, settings)
        else:
            # Plain decoding's 16-way runs in this same process, around this mode's: plain,
            # mode, mode, plain or mode, plain, plain, mode (alternating by round), so that a
            # drift of the machine's speed and whatever the run after a switch of engines pays
            # fall on both alike. A separate plain process runs minutes away, in another
            # placement, and that moves a 16-way rate by a few percent, more than speculation
            # adds or costs at 16 requests.
            plain = LLM(spec["target"], num_threads=threads, engine_config=plain_config(config))
            plain.generate([prompts[0]["ids"]], warm)
            engines = {"mode": llm, "plain": plain}
            order = ["plain", "mode"] if spec.get("plain_first") else ["mode", "plain"]
            runs = {"mode": [], "plain": []}
            for name in order + order[::-1]:
                runs[name].append(throughput_run(engines[name], batch, params, settings))
            seconds = {name: sum(r["seconds"] for r in rs) for name, rs in runs.items()}
            latency = {name: sum(r["mean_latency_s"] for r in rs) for name, rs in runs.items()}
            # what speculation did: the first run's counts; the rate: both runs'
            mine = runs["mode"][0] | {
                "seconds": seconds["mode"] / 2,
                "tput_tps": settings.concurrency * settings.tokens * 2 / seconds["mode"],
            }
            mine["paired"] = {
                "ratio": seconds["plain"] / seconds["mode"],
                "latency_ratio": latency["plain"] / latency["mode"],  # above 1: the mode's lower
                "plain_first": bool(spec.get("plain_first")),
                "seconds": [r["seconds"] for r in runs["mode"]],
                "plain_seconds": [r["seconds"] for r in runs["plain"]],
            }
        result["throughput"] = mine
    return result


def plain_config(config):
    """`config` without speculation."""
    from dataclasses import replace

    from mlcrun import EngineConfig

    fields = ("speculative_mode", "spec_draft_length", "draft_model", "draft_quantization")
    return replace(config, **{f: getattr(EngineConfig(), f) for f in fields})


def throughput_run(llm, batch: list[list[int]], params, settings: Settings) -> dict:
    """`batch` generated at once: tokens over wall time, and what speculation did."""
    stats = llm.engine.stats
    spent = stats.draft_seconds, stats.verify_seconds
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    if generated != settings.concurrency * settings.tokens:
        raise RuntimeError(f"throughput: generated {generated} tokens")
    return {
        "tput_tps": generated / elapsed,
        "seconds": elapsed,
        # when each request had its last token, from the start (the same clock as
        # metrics.token_times): a draft the adaptive length makes lowers the mean of these,
        # step by step, while the rate above is set by the last of them
        "mean_latency_s": statistics.mean(o.metrics.token_times[-1] - start for o in outs),
        "draft_tokens": sum(o.metrics.draft_tokens for o in outs),
        "accepted_tokens": sum(o.metrics.accepted_tokens for o in outs),
        "spec_steps": sum(o.metrics.spec_steps for o in outs),
        "preemptions": sum(o.metrics.preemptions for o in outs),
        # the engine's own clocks: drafting (lookups, draft-model forwards, verified or not)
        # and verify forwards
        "draft_seconds": stats.draft_seconds - spent[0],
        "verify_seconds": stats.verify_seconds - spent[1],
    }


def resolved_config(llm) -> dict:
    c = llm.engine_config
    info = {
        "quantization": llm.model.artifact.quantization,
        "max_num_sequence": c.max_num_sequence,
        "max_total_sequence_length": c.max_total_sequence_length,
        "speculative_mode": c.speculative_mode,
        "spec_draft_length": c.spec_draft_length,
        "spec_max_draft_length": c.spec_max_draft_length,
        "ngram_max": c.ngram_max,
    }
    if llm.draft is not None:
        info["draft"] = str(llm.draft.folder)
        info["draft_quantization"] = llm.draft.artifact.quantization
    return info


def worker_mlcrun_warmup(spec: dict, prompts: list[dict], threads: int, settings: Settings):
    """One start with the measured configuration: builds what is built on first use (the
    adaptive mode's step costs) into $MLCRUN_HOME, so that no measured process does."""
    from mlcrun import LLM, EngineConfig, SamplingParams

    config = EngineConfig(
        max_num_sequence=settings.concurrency,
        max_total_sequence_length=settings.kv_tokens(max(len(p["ids"]) for p in prompts)),
        prefix_cache=False,
        **spec["options"],
    )
    start = time.perf_counter()
    llm = LLM(spec["target"], num_threads=threads, engine_config=config)
    load_s = time.perf_counter() - start
    llm.generate([prompts[0]["ids"]], SamplingParams(max_tokens=4, temperature=0))
    return {"load_s": load_s, "costs": llm.engine.costs.to_dict() if llm.engine.costs else None}


def worker_llama_cpp(spec: dict, prompts: list[dict], threads: int, settings: Settings) -> dict:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    compare.quiet_llama()
    lookup = spec["mode"] == "prompt lookup"
    need = max(len(p["ids"]) for p in prompts) + settings.tokens + LOOKUP_TOKENS + 64
    n_ctx = -(-need // 256) * 256
    draft = (
        LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_NGRAM, num_pred_tokens=LOOKUP_TOKENS)
        if lookup
        else None
    )
    start = time.perf_counter()
    llm = Llama(
        model_path=spec["target"],
        n_ctx=n_ctx,
        # With a draft (logits_all), llama-cpp-python keeps the logits of every position in a
        # buffer of n_batch rows: n_batch = n_ctx, or it overflows past n_batch positions.
        n_batch=n_ctx if lookup else 512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        draft_model=draft,  # forces logits_all=True: verification needs every row's logits
        verbose=False,
    )
    load_s = time.perf_counter() - start
    evals: list[int] = []
    plain_eval = llm.eval

    def counting_eval(tokens):  # one llama_decode per call (n_batch covers every prompt)
        evals.append(len(tokens))
        return plain_eval(tokens)

    llm.eval = counting_eval

    def run(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        llm.reset()  # no KV reuse from the previous prompt
        evals.clear()
        tokens, times = [], []
        # Llama.generate never stops by itself (create_completion is what stops at EOS), so
        # EOS is ignored as in the other engines; temp=0 is llama.cpp's greedy sampler.
        for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0):
            times.append(time.perf_counter())
            tokens.append(token)
            if len(tokens) == n:
                break
        return tokens, times

    run(prompts[0]["ids"], settings.warmup_tokens)
    results = []
    for p in prompts:
        tokens, times = run(p["ids"], settings.tokens)
        decode_evals = evals[1:]  # evals[0] is the prompt
        drafted = sum(k - 1 for k in decode_evals)
        results.append(
            per_prompt(
                tokens,
                times,
                settings.tokens,
                forwards=len(decode_evals),
                draft_tokens=drafted if lookup else 0,
                # tokens after the first that did not need a forward of their own
                accepted_tokens=settings.tokens - 1 - len(decode_evals),
            )
        )
    settings_info = {
        "n_ctx": n_ctx,
        "n_batch": 512,
        "logits_all": llm._logits_all,
        "draft": f"LlamaPromptLookupDecoding(max_ngram_size={LOOKUP_NGRAM}, "
        f"num_pred_tokens={LOOKUP_TOKENS})"
        if lookup
        else None,
        "system_info": llama_cpp.llama_print_system_info().decode(),
    }
    return {"load_s": load_s, "prompts": results, "settings": settings_info}


def worker_transformers(spec: dict, prompts: list[dict], threads: int, settings: Settings):
    import torch
    import transformers

    torch.set_num_threads(threads)
    lookup = spec["mode"] == "prompt lookup"
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["target"], dtype=torch.float32
    ).eval()
    load_s = time.perf_counter() - start
    # EOS ignored as mlcrun's ignore_eos does it: no EOS id, so generation never stops early
    # and EOS itself may be generated (min_new_tokens would mask it instead, changing tokens).
    gen_config = transformers.GenerationConfig(
        do_sample=False,
        eos_token_id=[],  # never stop (None would take the model's own EOS: transformers 5
        pad_token_id=0,  # fills unset fields from model.generation_config)
        prompt_lookup_num_tokens=LOOKUP_TOKENS if lookup else None,
        max_matching_ngram_size=LOOKUP_NGRAM if lookup else None,
    )

    class Clock(transformers.generation.streamers.BaseStreamer):
        """Timestamps what each put() delivers (the first put is the prompt)."""

        def __init__(self):
            self.puts: list[tuple[float, int]] = []

        def put(self, value):
            self.puts.append((time.perf_counter(), int(value.numel())))

        def end(self):
            pass

    def run(ids: list[int], n: int) -> tuple[list[int], list[float], int]:
        x = torch.tensor([ids])
        clock = Clock()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            generation_config=gen_config,
            max_new_tokens=n,
            streamer=clock,
        )
        tokens = out[0, len(ids) :].tolist()
        times = [t for t, count in clock.puts[1:] for _ in range(count)]
        return tokens, times, len(clock.puts) - 1

    with torch.inference_mode():
        run(prompts[0]["ids"], settings.warmup_tokens)
        results = []
        for p in prompts:
            tokens, times, steps = run(p["ids"], settings.tokens)
            forwards = steps - 1  # the first step is the prefill
            results.append(
                per_prompt(
                    tokens,
                    times,
                    settings.tokens,
                    forwards=forwards,
                    accepted_tokens=settings.tokens - 1 - forwards,
                )
            )
    info = {"attn_implementation": model.config._attn_implementation}
    if lookup:
        info.update(prompt_lookup_num_tokens=LOOKUP_TOKENS, max_matching_ngram_size=LOOKUP_NGRAM)
    return {"load_s": load_s, "prompts": results, "settings": info}


WORKERS = {
    "mlcrun": worker_mlcrun,
    "mlcrun-warmup": worker_mlcrun_warmup,
    "llama.cpp": worker_llama_cpp,
    "transformers": worker_transformers,
}


def run_worker(kind: str, spec: dict, prompts_file: Path, threads: int, quick: bool) -> dict:
    """One fresh process; its result, or {"error": ...} when it fails."""
    cmd = [sys.executable, __file__, "--worker", kind, "--spec", json.dumps(spec)]
    cmd += ["--prompts-file", str(prompts_file), "--threads", str(threads)]
    cmd += ["--quick"] if quick else []
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "MLCRUN_HOME": str(HOME),
    }
    return compare.run_child(cmd, env, 900 if quick else 3600)


def worker_main(args: argparse.Namespace) -> None:
    settings = QUICK if args.quick else FULL
    spec = json.loads(args.spec)
    prompts = json.loads(Path(args.prompts_file).read_text())
    result = WORKERS[args.worker](spec, prompts, args.threads, settings)
    result.update(compare.memory_use())
    print(RESULT_MARK + json.dumps(result), flush=True)


# ------------------------------------------------------------------ the code measured
def git(*args: str) -> str:
    """A read-only git query in the repository."""
    proc = subprocess.run(["git", "-C", str(ROOT.parent), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def mlcrun_code(commit: str | None) -> dict:
    """Which mlcrun runs. By default the working tree as it is. With `commit`, mlcrun/ as
    committed there (`git archive`, which leaves the repository alone) is extracted once under
    .cache/speculative/code-<sha>/ and put first on the path of this process and of every
    compile and worker: a run then measures one fixed version even while the working tree is
    being edited."""
    info = {"head": git("rev-parse", "HEAD"), "commit": None, "pythonpath": None}
    if commit is None:
        info["worktree_changes"] = git("status", "--short", "--", "mlcrun").splitlines()
        return info
    sha = git("rev-parse", "--verify", f"{commit}^{{commit}}")
    dest = CACHE / f"code-{sha[:12]}"
    if not (dest / "mlcrun" / "__init__.py").exists():
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT.parent), "archive", sha, "mlcrun"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    sys.path.insert(0, str(dest))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(dest), os.environ.get("PYTHONPATH")) if p
    )
    return info | {"commit": sha, "pythonpath": str(dest)}


# ------------------------------------------------------------------ preparing the models
def mlcrun_compile(gguf: Path, out: Path, quantization: str, draft: str | None = None) -> float:
    """`mlcrun compile GGUF -o OUT -q Q [--draft-quantization D]`; seconds taken (0 when
    already up to date: the CLI's own check)."""
    from mlcrun.compiler.build import is_up_to_date
    from mlcrun.compiler.options import CompileOptions

    cmd = [sys.executable, "-m", "mlcrun", "compile", str(gguf), "-o", str(out)]
    cmd += ["-q", quantization] + (["--draft-quantization", draft] if draft else [])
    if out.exists() and not is_up_to_date(str(gguf), out, CompileOptions(quantization)):
        cmd.append("--force")  # stale (an older mlcrun or source): rebuild
    start = time.perf_counter()
    # Not run from the repository root: `python -m` puts the current directory first on the
    # path, which would shadow --commit's mlcrun with the working tree's.
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=CACHE)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
    return 0.0 if "up to date" in proc.stderr else time.perf_counter() - start


def prepare(models: list[str], engines: list[str]) -> tuple[list[Variant], dict]:
    """Compile / convert what is missing; the variants to run."""
    from mlcrun.default_model import default_model_path

    CACHE.mkdir(parents=True, exist_ok=True)
    source = default_model_path()
    info: dict = {"source": str(source), "steps": {}, "paths": {}}

    def step(name: str, fn, *a):
        compare.log(f"prepare: {name}")
        start = time.perf_counter()
        out = fn(*a)
        info["steps"][name] = round(time.perf_counter() - start, 1)
        return out

    q4 = CACHE / "mlcrun-q4"  # also the tokenizer of the prompts and the F32 model's draft
    step("mlcrun compile q4 (-q auto)", mlcrun_compile, source, q4, "auto")
    f32 = CACHE / "mlcrun-f32"
    compare_dir = compare.CACHE / "smollm2"  # shared with compare.py
    f32_gguf = compare_dir / "smollm2-F32.gguf"
    hf = compare_dir / "hf-f32"
    if "f32" in models:
        if "mlcrun" in engines:
            step(
                f"mlcrun compile f32 (-q q0f32 --draft-quantization {DRAFT_QUANTIZATION})",
                mlcrun_compile,
                source,
                f32,
                "q0f32",
                DRAFT_QUANTIZATION,
            )
        if {"llama.cpp", "transformers"} & set(engines):
            compare_dir.mkdir(parents=True, exist_ok=True)
            if not f32_gguf.exists():
                step("F32 GGUF", compare.write_f32_gguf_from_gguf, source, f32_gguf)
        if "transformers" in engines and not hf.exists():
            step("transformers fp32 checkpoint", compare.hf_from_gguf, f32_gguf, hf)

    variants = []
    for model in models:
        if "mlcrun" in engines:
            target = q4 if model == "q4" else f32
            for mode, options in mlcrun_modes(model, q4):
                tput = mode == "plain" or adaptive(options)
                variants.append(Variant("mlcrun", model, mode, str(target), options, tput))
        if "llama.cpp" in engines:
            path = source if model == "q4" else f32_gguf
            for mode in ("plain", "prompt lookup"):
                variants.append(Variant("llama.cpp", model, mode, str(path)))
        if "transformers" in engines and model == "f32":
            for mode in ("plain", "prompt lookup"):
                variants.append(Variant("transformers", model, mode, str(hf)))
    drafts = {
        "self-draft": f32 / f"draft-{DRAFT_QUANTIZATION}" / "mlcrun-config.json",
        "q4 artifact": q4 / "mlcrun-config.json",
    }
    info["params_sha256"] = {
        name: json.loads(path.read_text())["params_sha256"]
        for name, path in drafts.items()
        if path.exists()
    }
    info["paths"] = {
        "mlcrun q4": str(q4),
        "mlcrun f32": str(f32),
        "llama.cpp q4": str(source),
        "llama.cpp f32": str(f32_gguf),
        "transformers f32": str(hf),
    }
    return variants, info


# ------------------------------------------------------------------ summary
def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def kind_stats(sample: dict, prompts: list[dict], kind: str) -> dict:
    """One sample's aggregate over the prompts of `kind`: decode tokens over decode seconds
    (all prompts together), and the drafts' totals."""
    rows = [r for r, p in zip(sample["prompts"], prompts) if p["kind"] == kind]
    if not rows:
        return {}
    tokens = sum(r["decode_tokens"] for r in rows)
    seconds = sum(r["decode_s"] for r in rows)
    accepted = sum(r.get("accepted_tokens") or 0 for r in rows)
    drafted = sum(r.get("draft_tokens") or 0 for r in rows)
    forwards = sum(r["forwards"] for r in rows)
    steps = sum(r.get("spec_steps") or 0 for r in rows)
    out = {
        "decode_tps": tokens / seconds if seconds > 0 else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        # generated tokens after the first per target forward (1.0 for plain decoding)
        "tokens_per_forward": sum(len(r["tokens"]) - 1 for r in rows) / forwards
        if forwards
        else None,
    }
    if drafted:
        out["acceptance_rate"] = accepted / drafted
    if steps:  # mlcrun: mean_accepted_length over the steps that drafted
        out["spec_steps"] = steps
        out["tokens_per_spec_step"] = (accepted + steps) / steps
    return out


def lookup_ceiling(prompt: list[int], output: list[int], max_draft: int) -> int:
    """Forwards an oracle prompt-lookup drafter needs to produce `output` after its first
    token: at each step it drafts, of the continuations of every earlier occurrence of the
    pending token, the one that agrees longest with what follows in `output` (up to
    max_draft tokens, copied from the tokens seen so far). Every longer n-gram match is
    one of these occurrences, so no drafter that copies from the history needs fewer."""
    seq = [*prompt, *output]
    seen: dict[int, list[int]] = {}  # token -> its positions in the history
    for i, token in enumerate(prompt):
        seen.setdefault(token, []).append(i)
    p, forwards = len(prompt), 0  # seq[p]: the pending token (sampled, not yet fed)
    while p < len(seq) - 1:
        best = 0
        for s in seen.get(seq[p], ()):
            n = 0
            while (
                n < max_draft
                and s + 1 + n <= p
                and p + 1 + n < len(seq)
                and seq[s + 1 + n] == seq[p + 1 + n]
            ):
                n += 1
            best = max(best, n)
        for i in range(p, p + 1 + best):  # fed this step: now part of the history
            seen.setdefault(seq[i], []).append(i)
        p += 1 + best
        forwards += 1
    return forwards


def _max_draft() -> int:
    """The prompt-lookup ceiling's longest draft: mlcrun's default spec_max_draft_length."""
    from mlcrun.engine.config import EngineConfig

    return EngineConfig.spec_max_draft_length


def summarize(variants: list[Variant], prompts: list[dict]) -> list[dict]:
    ok = {v.key: [s for s in v.samples if "error" not in s] for v in variants}
    by = {(v.engine, v.model, v.mode): v for v in variants}
    rows = []
    for v in variants:
        samples = ok[v.key]
        plain = by.get((v.engine, v.model, "plain"))
        reference = by.get(("mlcrun", v.model, "plain"))
        row = {
            "engine": v.engine,
            "model": v.model,
            "mode": v.mode,
            "target": v.target,
            "options": v.options,
            "load_s": [round(s["load_s"], 2) for s in samples],
            "peak_rss_mib": _median([s.get("peak_rss_mib") for s in samples]),
            "settings": (samples[0].get("settings") or samples[0].get("resolved"))
            if samples
            else None,
            "errors": [s["error"] for s in v.samples if "error" in s],
        }
        for kind in KINDS:
            per_round = [kind_stats(s, prompts, kind) for s in samples]
            if not any(per_round):
                continue
            stats = {
                "decode_tps": _median([r.get("decode_tps") for r in per_round]),
                "decode_tps_rounds": [r.get("decode_tps") for r in per_round],
            }
            for key in ("acceptance_rate", "tokens_per_forward", "tokens_per_spec_step"):
                stats[key] = _median([r.get(key) for r in per_round])
            stats["draft_tokens"] = per_round[0].get("draft_tokens") if per_round else None
            stats["accepted_tokens"] = per_round[0].get("accepted_tokens") if per_round else None
            if plain is not None and plain is not v:
                base = [kind_stats(s, prompts, kind) for s in ok[plain.key]]
                stats["speedup"] = _ratio(
                    stats["decode_tps"], _median([b.get("decode_tps") for b in base])
                )
                stats["speedup_rounds"] = [
                    _ratio(r.get("decode_tps"), b.get("decode_tps"))
                    for r, b in zip(per_round, base)
                ]
                stats["speedup_per_prompt"] = {
                    p["name"]: _ratio(
                        _median([s["prompts"][i]["decode_tps"] for s in samples]),
                        _median([s["prompts"][i]["decode_tps"] for s in ok[plain.key]]),
                    )
                    for i, p in enumerate(prompts)
                    if p["kind"] == kind
                }
            if v.engine == "mlcrun" and v.mode == "plain" and samples:
                answers = [
                    (p["ids"], r["tokens"])
                    for p, r in zip(prompts, samples[0]["prompts"])
                    if p["kind"] == kind
                ]
                stats["lookup_ceiling"] = sum(len(out) - 1 for _, out in answers) / sum(
                    lookup_ceiling(ids, out, _max_draft()) for ids, out in answers
                )
            row[kind] = stats
        row["tokens_match"] = {}
        for name, ref in (("same engine plain", plain), ("mlcrun plain", reference)):
            if ref is None or ref is v or not ok[ref.key] or not samples:
                continue
            prefixes = [
                _common_prefix(mine["tokens"], theirs["tokens"])
                for mine, theirs in zip(samples[0]["prompts"], ok[ref.key][0]["prompts"])
            ]
            row["tokens_match"][name] = {
                "identical_prompts": sum(
                    n == len(ref_p["tokens"])
                    for n, ref_p in zip(prefixes, ok[ref.key][0]["prompts"])
                ),
                "prompts": len(prefixes),
                "common_prefix": prefixes,
            }
        tputs = [s["throughput"] for s in samples if s.get("throughput")]
        if tputs:
            t = {
                "tput_tps": _median([x["tput_tps"] for x in tputs]),
                "tput_tps_rounds": [x["tput_tps"] for x in tputs],
                "draft_tokens": tputs[0]["draft_tokens"],
                "accepted_tokens": tputs[0]["accepted_tokens"],
                "spec_steps": tputs[0]["spec_steps"],
                "preemptions": tputs[0]["preemptions"],
            }
            for key in ("draft_seconds", "verify_seconds"):  # recorded since f1dcf4b
                if all(key in x for x in tputs):
                    t[key] = _median([x[key] for x in tputs])
            base = [s["throughput"] for s in ok[plain.key] if s.get("throughput")] if plain else []
            if plain is not v and base:
                t["ratio"] = _ratio(t["tput_tps"], _median([x["tput_tps"] for x in base]))
                t["ratio_rounds"] = [
                    _ratio(x["tput_tps"], y["tput_tps"]) for x, y in zip(tputs, base)
                ]
            if all("paired" in x for x in tputs):  # plain's 16-way run in the same process
                t["paired_ratio_rounds"] = [x["paired"]["ratio"] for x in tputs]
                t["paired_ratio"] = _median(t["paired_ratio_rounds"])
                if all("latency_ratio" in x["paired"] for x in tputs):
                    rounds = [x["paired"]["latency_ratio"] for x in tputs]
                    t["latency_ratio_rounds"] = rounds
                    t["latency_ratio"] = _median(rounds)
            row["throughput"] = t
        rows.append(row)
    return rows


TARGETS = [  # id, text, threshold
    ("ngram-grounded", "`ngram` >= 1.5x plain on the input-grounded tasks", 1.5),
    ("self-f32", "`self` on an F32 target >= 1.3x plain (open chat prompts)", 1.3),
    ("open-floor", "no mode below 0.97x plain on open chat prompts", 0.97),
    ("tput16", "16-way throughput with speculation on not below plain", 1.0),
]
NGRAM_TARGET = next(t[2] for t in TARGETS if t[0] == "ngram-grounded")  # spec_replay.py


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """Each target against the measured ratios of mlcrun's modes. What counts is the default
    (adaptive) draft length; the fixed-K runs are listed beside it (`counted` false)."""
    out = []
    for tid, text, threshold in TARGETS:
        cases = []
        for r in rows:
            mode = r["options"].get("speculative_mode")
            if r["engine"] != "mlcrun" or not mode:
                continue
            if tid == "ngram-grounded" and mode == "ngram":
                value = r.get("grounded", {}).get("speedup")
            elif tid == "self-f32" and mode == "self" and r["model"] == "f32":
                value = r.get("open", {}).get("speedup")
            elif tid == "open-floor":
                value = r.get("open", {}).get("speedup")
            elif tid == "tput16" and "throughput" in r:  # paired in one process since 2026-12
                value = r["throughput"].get("paired_ratio", r["throughput"].get("ratio"))
            else:
                continue
            cases.append(
                {
                    "model": r["model"],
                    "mode": r["mode"],
                    "value": value,
                    "met": None if value is None else value >= threshold,
                    "counted": adaptive(r["options"]),
                }
            )
        met = [c["met"] for c in cases if c["counted"]]
        out.append(
            {
                "id": tid,
                "text": text,
                "threshold": threshold,
                "cases": cases,
                "met": None if not met or None in met else all(met),
            }
        )
    return out


def first_eos(rows: list[dict], variants: list[Variant], eos: list[int]) -> dict:
    """Where mlcrun plain's greedy answer first generates EOS (it goes on past it), per model
    and prompt: the tokens after it are the model continuing a finished conversation."""
    out = {}
    for v in variants:
        if v.engine == "mlcrun" and v.mode == "plain":
            ok = [s for s in v.samples if "error" not in s]
            if ok:
                out[v.model] = [
                    next((i for i, t in enumerate(p["tokens"]) if t in eos), None)
                    for p in ok[0]["prompts"]
                ]
    return out


def _cell(value, spec: str = "{:.2f}", width: int = 9) -> str:
    return f"{(spec.format(value) if value is not None else '-'):>{width}}"


def print_table(rows: list[dict], targets: list[dict], settings: Settings) -> None:
    print(
        f"\nbatch 1, {settings.tokens} greedy tokens per prompt (EOS ignored); speedup = decode "
        "tok/s over the same engine's plain decoding, same model; tok/fwd = generated tokens "
        "per target forward"
    )
    head = f"{'engine':13}{'model':6}{'mode':15}"
    for kind in KINDS:
        head += f"{kind + ' t/s':>14}{'speedup':>9}{'accept':>9}{'tok/fwd':>9}"
    head += f"{'16-way t/s':>12}{'ratio':>8}{'paired':>8}  same tokens as mlcrun plain"
    print(head)
    for r in rows:
        line = f"{r['engine']:13}{r['model']:6}{r['mode']:15}"
        for kind in KINDS:
            k = r.get(kind, {})
            line += _cell(k.get("decode_tps"), "{:.1f}", 14) + _cell(k.get("speedup"))
            line += _cell(k.get("acceptance_rate")) + _cell(k.get("tokens_per_forward"))
        t = r.get("throughput", {})
        line += _cell(t.get("tput_tps"), "{:.1f}", 12) + _cell(t.get("ratio"), "{:.2f}", 8)
        line += _cell(t.get("paired_ratio"), "{:.2f}", 8)
        match = r["tokens_match"].get("mlcrun plain")
        if match:
            line += f"  {match['identical_prompts']}/{match['prompts']}"
        if r["errors"]:
            line += f"  ({len(r['errors'])} failed: {r['errors'][0][:80]!r})"
        print(line)
    print("\ntargets (mlcrun's default adaptive draft length):")
    for t in targets:
        cases = ", ".join(
            f"{c['model']} {c['mode']} {_cell(c['value'], '{:.2f}x', 0)}"
            + ("" if c["counted"] else " (fixed K, not counted)")
            for c in t["cases"]
        )
        state = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"  {t['text']}: {state} ({cases})")


# ------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="default: %(default)s")
    parser.add_argument("--engines", default=",".join(ENGINES), help="default: %(default)s")
    parser.add_argument("--rounds", type=int, help="interleaved; median reported (default 2)")
    parser.add_argument(
        "--seed", type=int, help="seed of the rounds' orders (default: drawn, recorded in the JSON)"
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="every engine (default: all CPUs)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 prompts per kind, 32 tokens, 1 round: a smoke run"
    )
    parser.add_argument(
        "--json",
        type=Path,
        help=f"default {DEFAULT_JSON.relative_to(ROOT.parent)}; with --quick "
        f"{QUICK_JSON.relative_to(ROOT.parent)}, so that a smoke run never replaces the results",
    )
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument(
        "--commit",
        help="run mlcrun as committed at this revision (git archive into the cache, first on "
        "every process's path) instead of the working tree",
    )
    parser.add_argument("--from-raw", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)

    models = [m for m in args.models.split(",") if m]
    engines = [e for e in args.engines.split(",") if e]
    for name, chosen, known in (("model", models, MODELS), ("engine", engines, ENGINES)):
        unknown = set(chosen) - set(known)
        if unknown:
            parser.error(
                f"unknown {name}(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}"
            )
    settings = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 2)
    out_json = args.json or (QUICK_JSON if args.quick else DEFAULT_JSON)
    if args.from_raw:  # summarize a finished run again (e.g. after changing the summary)
        return write_report(json.loads(args.from_raw.read_text()), out_json)

    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    code = mlcrun_code(args.commit)  # before anything imports mlcrun
    import mlcrun

    code["mlcrun_file"] = mlcrun.__file__
    compare.log(f"mlcrun: {mlcrun.__file__} ({code['commit'] or 'working tree'})")
    variants, info = prepare(models, engines)
    info["mlcrun_code"] = code
    prompts = build_prompts(CACHE / "mlcrun-q4", settings)
    prompts_file = CACHE / ("prompts-quick.json" if args.quick else "prompts.json")
    prompts_file.write_text(json.dumps(prompts))

    # Step costs are measured afresh in this run's warm-up starts (a cached table may come from
    # another machine state, e.g. a busy one), then every measured process reads them.
    shutil.rmtree(HOME / "spec-costs", ignore_errors=True)
    warmups = {}
    for v in variants:  # first starts: adaptive step costs measured and cached here
        if v.engine == "mlcrun" and adaptive(v.options):
            result = run_worker("mlcrun-warmup", v.spec(), prompts_file, args.threads, args.quick)
            warmups[v.key] = result
            log_result("warm-up", v.key, result)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    orders = compare.round_orders([v.key for v in variants], rounds, seed)
    by_key = {v.key: v for v in variants}
    for r, order in enumerate(orders):
        for key in order:
            v = by_key[key]
            spec = v.spec() | {"plain_first": r % 2 == 1}  # the paired 16-way runs' order
            sample = run_worker(v.engine, spec, prompts_file, args.threads, args.quick)
            v.samples.append(sample)
            log_result(f"round {r + 1}/{rounds}", v.key, sample)
    raw = {
        "started": started,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "threads": args.threads,
        "rounds": rounds,
        "seed": seed,
        "orders": orders,
        "quick": args.quick,
        "settings": asdict(settings),
        "preparation": info,
        "prompts": prompts,
        "warmups": warmups,
        "variants": [asdict(v) for v in variants],
    }
    # Everything measured, tokens included, before any summary (kept in the cache only:
    # `--from-raw FILE` summarizes it again).
    raw_file = CACHE / f"raw-{out_json.stem}.json"
    raw_file.write_text(json.dumps(raw))
    compare.log(f"raw samples: {raw_file}")
    write_report(raw, out_json)


def write_report(raw: dict, out_json: Path) -> None:
    from spec_replay import replay_report  # imports mlcrun: after mlcrun_code set the path

    from mlcrun.tokenizer import Tokenizer

    variants = [Variant(**v) for v in raw["variants"]]
    prompts = raw["prompts"]
    rows = summarize(variants, prompts)
    targets = evaluate_targets(rows)
    eos = list(Tokenizer.from_dir(CACHE / "mlcrun-q4").eos_token_ids)
    llama = [r["settings"] for r in rows if r["engine"] == "llama.cpp" and r["settings"]]
    report = {
        "benchmark": "speculative",
        **{k: raw[k] for k in ("created", "started", "command", "load_before", "load_after")},
        "machine": compare.machine(),
        **{k: raw[k] for k in ("threads", "rounds", "quick", "settings")},
        **{k: raw[k] for k in ("seed", "orders") if k in raw},  # runs before: fixed order
        "versions": compare.versions(),
        "llama_cpp_system_info": llama[0]["system_info"] if llama else None,
        "preparation": raw["preparation"],
        "prompts": [
            {k: p[k] for k in ("name", "kind", "text")} | {"prompt_tokens": len(p["ids"])}
            for p in prompts
        ],
        "eos_token_ids": eos,
        "lookup_ceiling_draft": _max_draft(),
        "first_eos": first_eos(rows, variants, eos),
        "warmups": raw["warmups"],
        "targets": targets,
        "results": rows,
        # plain decoding's grounded answers replayed through prompt lookup (spec_replay.py)
        "replay": replay_report(raw, NGRAM_TARGET),
        "samples": {v.key: [strip_tokens(s) for s in v.samples] for v in variants},
    }
    print_table(rows, targets, Settings(**raw["settings"]))
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out_json}")


def strip_tokens(sample: dict) -> dict:
    """A sample without its token ids (the matches are summarized in the results)."""
    if "prompts" not in sample:
        return sample
    prompts = [{k: v for k, v in p.items() if k != "tokens"} for p in sample["prompts"]]
    return {**sample, "prompts": prompts}


def log_result(when: str, key: str, sample: dict) -> None:
    if "error" in sample:
        compare.log(f"{when}: {key:34} ERROR {sample['error']}")
        return
    rates = [p["decode_tps"] for p in sample.get("prompts", [])]
    shown = f"decode t/s {statistics.median(rates):.1f} (median of prompts)" if rates else ""
    if sample.get("throughput"):
        shown += f", 16-way {sample['throughput']['tput_tps']:.1f} t/s"
    compare.log(f"{when}: {key:34} load {sample['load_s']:.1f}s {shown}")


if __name__ == "__main__":
    main()
