"""`mlcrun bench [MODEL]`: kernel timings, or a serving workload offline or over HTTP."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..errors import MlcrunError
from .common import (
    DRAFT_MODEL,
    DRAFT_QUANTIZATION,
    MODEL_ARGUMENT,
    NGRAM_MAX,
    SPEC_DRAFT_LENGTH,
    SPEC_MODE,
    SPEC_TREE_WIDTH,
    err_console,
    handle_errors,
    resolve_model,
    setup_logging,
    speculation_options,
)

MODES = ("serve-sim", "kernel")


def parse_counts(text: str, name: str, allow_zero: bool = False) -> list[int]:
    """ "1,4,16" -> [1, 4, 16]; every entry a positive (or, with allow_zero, >= 0) integer."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    low = 0 if allow_zero else 1
    if not values or any(v < low for v in values):
        kind = "non-negative" if allow_zero else "positive"
        raise MlcrunError(f"{name} must be a comma-separated list of {kind} integers, got {text!r}")
    return values


@handle_errors
def bench_command(
    model: str = MODEL_ARGUMENT,
    mode: str = typer.Option("serve-sim", "--mode", help="serve-sim (default) or kernel."),
    url: str = typer.Option(
        None,
        "--url",
        help="Run serve-sim against this OpenAI-compatible server instead (MODEL, or the "
        "default model, supplies the vocabulary and tokenizer: use the served one).",
    ),
    # serve-sim
    num_prompts: int = typer.Option(64, "--num-prompts", help="Requests in the workload."),
    input_len: str = typer.Option("128", "--input-len", help="Prompt tokens: N or MIN:MAX."),
    output_len: str = typer.Option(
        None, "--output-len", help="Output tokens: N or MIN:MAX (default 128, or the dataset's)."
    ),
    dataset: Path = typer.Option(
        None, "--dataset", help="JSONL of {'prompt': ...} or ShareGPT-style conversations."
    ),
    concurrency: str = typer.Option(
        "16", "--concurrency", "-c", help="Max requests in flight; a list (1,4,16) sweeps."
    ),
    request_rate: float = typer.Option(
        None, "--request-rate", help="Poisson arrivals per second (default: all at once)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of prompts, lengths and arrivals."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache"),
    served_model: str = typer.Option(None, "--served-model", help="Model id sent with --url."),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="For --url."),
    # kernel
    prompt_lens: str = typer.Option("128,512", "-p", "--prompt-lens", help="Prefill tests."),
    batches: str = typer.Option("1,4,16", "-b", "--batches", help="Decode batch sizes."),
    depths: str = typer.Option("0,512", "-d", "--depths", help="Tokens already in the KV."),
    decode_tokens: int = typer.Option(32, "-n", "--decode-tokens", help="Steps per decode test."),
    repetitions: int = typer.Option(3, "-r", "--repetitions", help="Timed runs per test."),
    verify: str = typer.Option(
        None,
        "-k",
        "--verify",
        help="Verify tests: K draft tokens per list entry (2,4,8), each timing one verify of "
        "K+1 tokens at every batch size and depth, next to tg (default: none).",
    ),
    profile: bool = typer.Option(
        False,
        "--profile",
        help="Also time every kernel of one decode step (kernel mode); with --verify, also of "
        "one verify step of the largest K+1 tokens.",
    ),
    # common
    threads: int = typer.Option(None, "--threads", help="CPU threads for the model."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (when compiling)."),
    quantization: str = typer.Option(None, "--quantization", "-q", help="Preset when compiling."),
    json_path: Path = typer.Option(None, "--json", help="Write every sample and summary here."),
    plot_path: Path = typer.Option(None, "--plot", help="Latency CDF / throughput plot (PNG)."),
    # serve-sim, in process
    speculative_mode: str = SPEC_MODE,
    spec_draft_length: int = SPEC_DRAFT_LENGTH,
    spec_tree_width: int = SPEC_TREE_WIDTH,
    draft_model: str = DRAFT_MODEL,
    ngram_max: int = NGRAM_MAX,
    draft_quantization: str = DRAFT_QUANTIZATION,
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Benchmark a model: prefill/decode speed (--mode kernel) or a serving workload with
    TTFT, TPOT, ITL and throughput (--mode serve-sim, in-process or against --url)."""
    setup_logging(verbose)
    from ..bench import report

    if mode not in MODES:
        raise MlcrunError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if url and mode != "serve-sim":
        raise MlcrunError("--url runs the serve-sim workload; drop --mode kernel")
    if threads is not None and threads <= 0:
        raise MlcrunError("--threads must be positive")
    command = ["mlcrun", "bench", *sys.argv[2:]] if len(sys.argv) > 1 else ["mlcrun", "bench"]
    if mode == "kernel":
        args = (prompt_lens, batches, depths, decode_tokens, repetitions, verify, profile)
        doc = _kernel(model, args, threads, device, quantization, command)
    else:
        workload = (num_prompts, input_len, output_len, dataset, seed)
        levels = parse_counts(concurrency, "--concurrency")
        if request_rate is not None and not request_rate > 0:
            raise MlcrunError(f"--request-rate must be positive, got {request_rate}")
        if url and speculative_mode != "none":
            raise MlcrunError("--speculative-mode is the in-process engine's; drop it with --url")
        spec = speculation_options(
            speculative_mode,
            spec_draft_length,
            spec_tree_width,
            draft_model,
            ngram_max,
            draft_quantization,
            device,
        )
        run = dict(
            levels=levels,
            rate=request_rate,
            prefix_cache=prefix_cache,
            threads=threads,
            spec=spec,
        )
        where = dict(url=url, served_model=served_model, api_key=api_key)
        doc = _serve_sim(model, workload, run, where, device, quantization, command)
    report.validate(doc)
    table = report.kernel_table(doc) if mode == "kernel" else report.serve_table(doc)
    from rich.console import Console

    Console().print(table)
    for key in ("profile", "verify_profile"):
        if doc.get(key):
            Console().print(report.profile_table(doc[key]))
    if json_path:
        report.write_json(json_path, doc)
        err_console.print(f"wrote {json_path}", highlight=False)
    if plot_path:
        report.write_plot(plot_path, doc)
        err_console.print(f"wrote {plot_path}", highlight=False)


def _model_info(folder: Path, model: str | None) -> dict:
    from .. import artifact
    from ..default_model import DEFAULT_NAME

    art = artifact.read(folder)
    return {
        "name": DEFAULT_NAME if model is None else Path(model).name,
        "path": str(folder),
        "quantization": art.quantization,
        "device": art.device,
        "params_sha256": art.params_sha256,
    }


def _progress(total: int, label: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress(
        label,
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        disable=not sys.stderr.isatty(),
    )
    return bar, total


def _kernel(model, args, threads, device, quantization, command) -> dict:
    from ..bench import kernel, report
    from ..runtime import Model

    prompt_lens, batches, depths, decode_tokens, reps, verify, profile = args
    drafts = parse_counts(verify, "--verify") if verify is not None else []
    tests = kernel.plan(
        parse_counts(prompt_lens, "--prompt-lens"),
        parse_counts(batches, "--batches"),
        parse_counts(depths, "--depths", allow_zero=True),
        decode_tokens,
        drafts,
    )
    if decode_tokens <= 0 or reps <= 0:
        raise MlcrunError("--decode-tokens and --repetitions must be positive")
    folder = resolve_model(model, quantization=quantization, device=device)
    m = Model(folder, num_threads=threads)
    runnable, skipped = kernel.fit(m, tests)  # raises when nothing fits
    for test in skipped:
        err_console.print(f"skipped {test['test']}: {test['reason']}", highlight=False)
    bar, total = _progress(len(runnable) * reps, "kernel tests")
    with bar:
        task = bar.add_task("", total=total)
        runs = kernel.run_tests(m, runnable, reps, on_rep=lambda: bar.advance(task))
    config = {
        "threads": threads,
        "repetitions": reps,
        "decode_tokens": decode_tokens,
        "verify": drafts,
    }
    doc = report.document("kernel", command, _model_info(folder, model), config, runs)
    doc["skipped"] = skipped
    if profile:
        from ..bench.profile import profile_decode

        depth = min(max(t.depth for t in tests) or 128, m.artifact.context_window // 2)
        doc["profile"] = profile_decode(m, batch=1, depth=depth)
        if drafts:  # a verify step of the largest K + 1 tokens, at the same depth
            tokens = max(drafts) + 1
            # profile_decode grows each sequence by (2 * steps + 1) * tokens
            steps = min(16, ((m.artifact.context_window - depth) // tokens - 1) // 2)
            if steps > 0:
                doc["verify_profile"] = profile_decode(
                    m, batch=1, depth=depth, steps=steps, tokens=tokens
                )
    return doc


def _serve_sim(model, workload, run, where, device, quantization, command) -> dict:
    from ..bench import metrics, report
    from ..bench.workload import load_dataset, parse_len, reseeded, synthetic, with_arrivals
    from ..tokenizer import Tokenizer

    num_prompts, input_len, output_len, dataset, seed = workload
    if num_prompts <= 0:
        raise MlcrunError(f"--num-prompts must be positive, got {num_prompts}")
    in_span = parse_len(input_len, "--input-len")
    out_span = parse_len(output_len, "--output-len") if output_len is not None else None
    folder = resolve_model(model, quantization=quantization, device=device)
    from .. import artifact

    art = artifact.read(folder)
    vocab = int(art.model["vocab_size"])
    if dataset is not None:
        tokenizer = Tokenizer.from_dir(folder)
        requests = load_dataset(
            dataset, num_prompts, lambda text: len(tokenizer.encode(text)), out_span, seed
        )
    else:
        requests = synthetic(num_prompts, in_span, out_span or (128, 128), vocab, seed)
    requests = with_arrivals(requests, run["rate"], seed)
    longest = max(r.prompt_len + r.output_len for r in requests)
    if longest > art.context_window and not where["url"]:
        raise MlcrunError(
            f"a request needs {longest} tokens, over the model's context window "
            f"({art.context_window}); lower --input-len/--output-len"
        )
    info = _model_info(folder, model)
    runner = _url_runner(where, info) if where["url"] else _offline_runner(folder, run)
    runs = []
    for i, level in enumerate(run["levels"]):
        # Each level starts with an empty prefix cache (the runner resets it) and, for synthetic
        # workloads, its own prompts: the same lengths, fresh token ids, so that a server whose
        # cache cannot be reset still cannot serve a level from an earlier level's prompts.
        level_requests = requests if dataset is not None else reseeded(requests, vocab, seed, i)
        bar, total = _progress(len(level_requests), f"concurrency {level}")
        with bar:
            task = bar.add_task("", total=total)
            advance = lambda _, bar=bar, task=task: bar.advance(task)  # noqa: E731
            records, duration, counters = runner(level_requests, level, advance)
        runs.append(
            {
                "concurrency": level,
                "request_rate": run["rate"],
                "summary": metrics.summarize(records, duration),
                "engine": counters,
                "samples": [metrics.record_dict(r) for r in records],
            }
        )
    config = {
        "num_prompts": len(requests),
        "input_len": list(in_span) if dataset is None else None,
        "output_len": list(out_span) if out_span else None,
        "dataset": str(dataset) if dataset else None,
        "seed": seed,
        "threads": run["threads"],
        "prefix_cache": run["prefix_cache"],
        "fresh_prompts_per_level": dataset is None,
        "url": where["url"],
        "speculation": run["spec"],
    }
    return report.document("serve-sim", command, info, config, runs)


def _offline_runner(folder: Path, run: dict):
    from ..bench.offline import run_offline
    from ..engine.config import EngineConfig
    from ..llm import LLM

    config = EngineConfig(
        mode="server",
        max_num_sequence=max(run["levels"]),
        prefix_cache=run["prefix_cache"],
        **run["spec"],
    )
    llm = LLM(folder, engine_config=config, num_threads=run["threads"])

    def runner(requests, level, on_done):
        llm.engine.reset_prefix_cache()  # each level starts cold
        return run_offline(llm, requests, level, on_done)

    return runner


def _url_runner(where: dict, info: dict):
    from ..bench.client import base_url, reset_prefix_cache, resolve_model, run_url

    served = resolve_model(where["url"], where["served_model"], where["api_key"], timeout=10)
    info.update(name=served, url=base_url(where["url"]))

    def runner(requests, level, on_done):
        # each level starts cold, as offline; "HTTP 404" etc. when the server cannot
        reset = reset_prefix_cache(where["url"], where["api_key"], timeout=10)
        if reset != "reset":
            err_console.print(
                f"concurrency {level}: the server did not reset its prefix cache ({reset})",
                highlight=False,
            )
        records, duration, _ = run_url(
            where["url"],
            requests,
            model=served,
            concurrency=level,
            api_key=where["api_key"],
            on_done=on_done,
        )
        return records, duration, {"prefix_cache_reset": reset}

    return runner
