"""Regenerate docs/performance.md (and docs/performance.png) from the latest benchmark JSON.

    .venv/bin/python benchmarks/compare.py                     # -> benchmarks/results/compare.json
    .venv/bin/mlcrun bench --mode kernel -p 128,512 -b 1,4,16 -d 0,512 -r 3 --profile \\
        --json benchmarks/results/kernel.json                   # the default model, kernel view
    .venv/bin/python benchmarks/performance_doc.py             # -> docs/performance.md + .png

The "Speculative decoding" section comes from benchmarks/results/speculative.json
(`.venv/bin/python benchmarks/speculative.py`) when that file exists.

Everything on the page comes from those files; the only hand-written parts are the
explanations of known gaps below (`GAPS`, `SPEC_GAPS`), printed when the measured ratio says
mlcrun is behind or a target is missed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"

COLUMNS = [  # (metric key, column title, format)
    ("decode_tps", "decode tok/s", "{:.1f}"),
    ("prefill_tps", "prefill tok/s", "{:.0f}"),
    ("ttft_ms", "TTFT ms", "{:.0f}"),
    ("tput_tps", "throughput tok/s", "{:.0f}"),
    ("peak_rss_mib", "peak RSS MiB", "{:.0f}"),
]

TIE = 0.03  # ratios this close to 1 are ties: run-to-run noise on this VM is larger

# Why mlcrun trails where it does (format, metric) -> the kernel or overhead responsible.
GAPS = {
    ("Q4_0", "decode_tps"): (
        "llama.cpp repacks Q4_0 weights into interleaved blocks at load and multiplies them with "
        "int8-quantized activations using AVX-512 VNNI integer dot products (64 multiply-adds "
        "per instruction). mlcrun's fused dequantize-GEMV (`dequantize_matmul*` in the profile) "
        "keeps the activations in fp32 and the results exact: per 16 weights it issues a "
        "permute, a shift, a mask, an int-to-float convert and two FMAs, and at 2 threads it is "
        "bound by the vector FP pipes (about 3 FP operations per 16 weights), not by memory "
        "(it reads ~20 GB/s of the ~50 available). Its Q4_1 path has no such repacking, which "
        "is why the Q4_1 ratio is different."
    ),
    ("Q4_1", "decode_tps"): (
        "Same kernel as Q4_0 above: the fp32 dequantize-GEMV is compute-bound (vector FP pipes), "
        "while llama.cpp's Q4_1 x Q8_1 dot products run on integer units."
    ),
    ("Q4_0", "prefill_tps"): (
        "Prefill runs the dequantize-then-GEMM kernels in fp32; llama.cpp's repacked Q4_0 GEMM "
        "uses int8 VNNI dot products, about twice the multiply-adds per instruction."
    ),
    ("Q4_0", "tput_tps"): (
        "Batched decode uses the same fp32 dequantize-GEMM as prefill (see above)."
    ),
    ("F32", "prefill_tps"): (
        "Profiled on SmolLM2's F32 weights (one 512-token prefill, 583 ms with the per-call "
        "hook): 66% GEMMs (fp32 3-row tiles at ~285 GFLOP/s on 2 threads; llama.cpp's tiled "
        "sgemm is faster) and 25% attention (`batch_prefill_ragged_kv` scores one query row "
        "per task, without blocking several query rows over the same keys). The 0.5B shape "
        "runs the same kernels on larger matrices."
    ),
    ("*", "decode_tps"): (
        "Decode is the fused dequantize-GEMVs (for quantized weights compute-bound on the vector "
        "FP pipes: exact fp32 math, about 3 FP operations per 16 weights, where llama.cpp uses "
        "int8 dot products) plus about 0.8 ms per step outside the kernels (`other` in the "
        "profile: the VM interpreter, embedding the input, copying the logits out)."
    ),
    ("*", "prefill_tps"): (
        "Prefill is matmuls plus attention: our GEMMs (fp32 3-row tiles; quantized weights "
        "dequantized once per L2-sized block) and `batch_prefill_ragged_kv`, which scores one "
        "query row per task instead of blocking several query rows over the same keys; "
        "llama.cpp's 512-token ubatch runs tiled GEMMs with int8 dot products for quantized "
        "weights."
    ),
    ("*", "tput_tps"): (
        "Batched decode runs the fp32 GEMM kernels with only a few rows (M = the batch), "
        "where they reach about half their peak."
    ),
    ("*", "peak_rss_mib"): (
        "mlcrun's resident memory is the weights plus about 200 MiB of TVM runtime and "
        "libraries (libtvm, LLVM, numpy), against llama.cpp's ~10 MiB of native code; the KV "
        "cache is fp32 (llama.cpp's is fp16), so long contexts double its share."
    ),
}


# Why a speculative-decoding target is missed (target id from speculative.py's TARGETS) ->
# the explanation, printed under the target when the run misses it.
SPEC_GAPS: dict[str, str] = {}


def fmt(value, spec: str) -> str:
    return "—" if value is None else spec.format(value)


def ratio_cell(value) -> str:
    return "—" if value is None else f"{value:.2f}"


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
    out += ["", "Ratios (mlcrun / peer, same format; TTFT and RSS: lower is better):", ""]
    out += [
        "| pair | " + " | ".join(t for _, t, _ in COLUMNS) + " | same greedy tokens |",
        "| --- |" + " ---: |" * (len(COLUMNS) + 1),
    ]
    for pair, ratios in model["ratios"].items():
        same = ratios.get("same_first_tokens")
        out.append(
            f"| {pair} | "
            + " | ".join(ratio_cell(ratios.get(k)) for k, _, _ in COLUMNS)
            + f" | {'—' if same is None else same} |"
        )
    if model.get("errors"):
        errors = "; ".join(f"{k}: {v}" for k, v in model["errors"].items())
        out += ["", f"Errors recorded: {errors}"]
    out.append("")
    return out


def behind(doc: dict) -> list[str]:
    """Bullets for every (model, format, metric) where mlcrun trails llama.cpp, with the reason;
    a reason shared by all formats (`GAPS[("*", metric)]`) is given once per model."""
    lines = []
    for name, model in doc["models"].items():
        shared: dict[str, list[str]] = {}
        for pair, ratios in model["ratios"].items():
            if "llama.cpp" not in pair:
                continue
            fmt_name = pair.split()[0]
            for key, title, _ in COLUMNS:
                value = ratios.get(key)
                lower_better = key in ("ttft_ms", "peak_rss_mib")
                if key == "ttft_ms" or value is None:
                    continue  # TTFT mirrors prefill speed
                if (value <= 1 + TIE) if lower_better else (value >= 1 - TIE):
                    continue
                if (fmt_name, key) not in GAPS and ("*", key) in GAPS:
                    shared.setdefault(key, []).append(f"{fmt_name} {value:.2f}x")
                    continue
                reason = GAPS.get((fmt_name, key), "")
                lines.append(f"- **{name}, {fmt_name}, {title}: {value:.2f}x.** {reason}")
        for key, cases in shared.items():
            title = next(t for k, t, _ in COLUMNS if k == key)
            lines.append(f"- **{name}, {title}: {', '.join(cases)}.** {GAPS[('*', key)]}")
    return lines


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


def profile_section(kernel: dict | None) -> list[str]:
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
        f"{profile['depth']}: **{profile['step_ms']:.2f} ms**. The weight matmuls (fused "
        f"dequantize-GEMVs, one per linear layer, plus the lm_head) take {matmul:.0f}% of it, "
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
        + " The matmuls are compute-bound on the vector FP pipes at 2 threads (see the gaps"
        " above), so fewer instructions per weight, not fewer bytes, is the next lever.",
        "",
        "| kernel | calls | ms | share |",
        "| --- | ---: | ---: | ---: |",
    ]
    for k in rows[:12]:
        calls = k["calls"] or ""
        out.append(f"| `{k['name']}` | {calls} | {k['ms']:.3f} | {100 * k['share']:.1f}% |")
    out.append("")
    return out


MODEL_NAMES = {"q4": "q4", "f32": "F32"}


def _x(value) -> str:
    return "—" if value is None else f"{value:.2f}x"


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
            if SPEC_GAPS.get(t["id"]):
                line += " " + SPEC_GAPS[t["id"]]
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


def spec_section(spec: dict | None) -> list[str]:
    """Speedups, acceptance and 16-way throughput of speculative decoding (speculative.json)."""
    if spec is None:
        return []
    m, st = spec["machine"], spec["settings"]
    prompts = spec["prompts"]
    kinds = {k: [p for p in prompts if p["kind"] == k] for k in ("grounded", "open")}
    versions = ", ".join(f"{k} {v}" for k, v in spec["versions"].items() if v)
    rows = spec["results"]
    out = [
        "## Speculative decoding",
        "",
        "*From `benchmarks/results/speculative.json`, written by this run of "
        "`benchmarks/speculative.py`:*",
        "",
        f"    {spec['command']}",
        "",
        f"On {spec['created']}, {code_version(spec)}: {m['cpu']}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB; "
        f"**{spec['threads']} threads for every engine**, median of {spec['rounds']} "
        "interleaved rounds, each (engine, model, mode) in a fresh process. Versions: "
        f"{versions}.",
        "",
        "SmolLM2-135M-Instruct at **q4** (the default model's GGUF, Q4_1 layers and Q8_0 "
        "embedding: mlcrun compiles it `-q auto` to q4f16_1+q8f32, llama.cpp runs the file) and "
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
    out += spec_targets(spec)
    out += [
        "",
        "Modes: mlcrun `ngram` (prompt lookup), `self` (the F32 model's own weights at "
        "q4f16_1+q8f32) and `draft` (the q4 artifact as the draft model: the only smaller "
        "model sharing SmolLM2's tokenizer available offline, i.e. the same weights at 4 bits); "
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
        "adaptive modes against its plain decoding.",
        "",
        "| model | mode | tok/s | ratio to plain | drafted | accepted |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        t = r.get("throughput")
        if not t:
            continue
        out.append(
            f"| {MODEL_NAMES[r['model']]} | {r['mode']} | {t['tput_tps']:.1f} | "
            f"{_x(t.get('ratio')) if r['mode'] != 'plain' else '1.00x'} | "
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
            "- The F32 model's self-draft (q4f16_1+q8f32, re-quantized from its weights) and the "
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


def render(doc: dict, kernel: dict | None, spec: dict | None = None) -> str:
    m = doc["machine"]
    bw = doc["bandwidth"]["median"]
    versions = ", ".join(f"{k} {v}" for k, v in doc["versions"].items())
    lines = [
        "# Performance",
        "",
        "*Generated by `benchmarks/performance_doc.py` from `benchmarks/results/compare.json` "
        "and `benchmarks/results/kernel.json`; do not edit by hand.*",
        "",
        "Reproduce (about 30 minutes; see [benchmarks/README.md](../benchmarks/README.md)):",
        "",
        "    .venv/bin/python benchmarks/compare.py",
        "    .venv/bin/mlcrun bench --mode kernel -p 128,512 -b 1,4,16 -d 0,512 -r 3 --profile \\",
        "        --json benchmarks/results/kernel.json",
        "    .venv/bin/python benchmarks/performance_doc.py",
        "",
        f"This run: `{doc['command']}` on {doc['created']}.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['platform']}; "
        f"**{doc['threads']} threads for every engine**, median of {doc['rounds']} interleaved "
        f"rounds (A B C A B C ...), each engine in a fresh process. Versions: {versions}.",
        "",
        f"Memory bandwidth measured in the same run with the same threads (median): STREAM "
        f"triad {bw['triad_gbps']:.1f} GB/s, read-only sweep {bw['read_gbps']:.1f} GB/s. The "
        "read-bound decode rate is that bandwidth over the bytes of weights read per token; "
        "this VM's bandwidth drifts by up to 2x within minutes, so trust the ratios measured "
        "side by side more than absolute tokens/s.",
        "",
        "![decode tokens/s per format and engine](performance.png)",
        "",
        "## mlcrun against llama.cpp and transformers, same weights",
        "",
    ]
    for name, model in doc["models"].items():
        lines += model_section(name, model, doc)
    gaps = behind(doc)
    lines += [
        "## Where mlcrun is behind llama.cpp, and why",
        "",
        f"(Ratios within {100 * TIE:.0f}% of 1 count as ties: the same command run twice on "
        "this VM moves single results by up to 10%.)",
        "",
    ]
    lines += gaps or ["Nowhere in this run."]
    lines.append("")
    lines += profile_section(kernel)
    lines += kernel_section(kernel)
    lines += spec_section(spec)
    lines += [
        "## Method",
        "",
        "- Benchmarks are never tests: nothing here asserts a speed; tests check correctness.",
        "- Every engine gets the same token ids (random, no tokenizer), greedy decoding with EOS "
        "ignored, so all generate exactly the same number of tokens. `same greedy tokens` counts "
        "the leading generated tokens both engines agree on: identical at F32; quantized "
        "llama.cpp multiplies with int8-quantized activations, mlcrun in fp32, so they part "
        "after a few tokens.",
        "- Peak RSS is the process's own high-water mark (`VmHWM`), read in the worker.",
        "- llama.cpp runs through llama-cpp-python 0.3.36 built from source with AVX-512 and "
        "VNNI, AMX off (benchmarks/README.md); its KV cache is fp16, mlcrun's fp32.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, default=RESULTS / "compare.json")
    parser.add_argument("--kernel", type=Path, default=RESULTS / "kernel.json")
    parser.add_argument("--speculative", type=Path, default=RESULTS / "speculative.json")
    parser.add_argument("--out", type=Path, default=DOC, help="the page (the plot goes beside)")
    args = parser.parse_args()
    doc = json.loads(args.compare.read_text())
    kernel = json.loads(args.kernel.read_text()) if args.kernel.exists() else None
    spec = json.loads(args.speculative.read_text()) if args.speculative.exists() else None
    args.out.write_text(render(doc, kernel, spec))
    plot(doc, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
