"""A benchmark's results: the JSON document (schema "mlcrun-bench/1"), tables and a plot.

A document is {"schema", "mode", "created", "command", "mlcrun_version", "machine", "model",
"config", "runs"}. Mode "kernel" has kernel runs (one per test, like llama-bench's pp/tg rows,
plus tv rows: verify runs, which add "verify_len" and "tg_step_ratio") and may have "skipped"
(the tests that did not fit the context window, with why), "profile" and, with verify tests,
"verify_profile" (bench/profile.py: a decode step's and a verify step's kernels); any other
mode has serving runs (one per concurrency or request rate). `validate` spells out each run's keys.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from rich.table import Table

from .. import __version__
from ..errors import MlcrunError
from .metrics import LATENCY_KEYS, STAT_KEYS, SUMMARY_KEYS

SCHEMA = "mlcrun-bench/1"
KERNEL_MODE = "kernel"
KERNEL_KINDS = ("prefill", "decode", "verify")
SAMPLE_KEYS = (
    "index",
    "prompt_len",
    "output_len",
    "cached_tokens",
    "error",
    "ttft_s",
    "e2el_s",
    "itl_s",
)

_NUMBER = (int, float)
_TOP_KEYS: dict[str, tuple[type, ...]] = {
    "schema": (str,),
    "mode": (str,),
    "created": (str,),
    "command": (list,),
    "mlcrun_version": (str,),
    "machine": (dict,),
    "model": (dict,),
    "config": (dict,),
    "runs": (list,),
}
_SERVE_RUN_KEYS: dict[str, tuple[type, ...]] = {
    "concurrency": (int, type(None)),
    "request_rate": (*_NUMBER, type(None)),
    "summary": (dict,),
    "engine": (dict,),
    "samples": (list,),
}
_KERNEL_RUN_KEYS: dict[str, tuple[type, ...]] = {
    "test": (str,),
    "kind": (str,),
    "prompt_len": (int, type(None)),
    "batch": (int,),
    "depth": (int,),
    "tokens_per_s": (dict,),
    "samples": (list,),
}
_VERIFY_RUN_KEYS: dict[str, tuple[type, ...]] = {
    "verify_len": (int,),  # tokens verified per sequence per call: K+1
    "tg_step_ratio": (*_NUMBER, type(None)),  # a call's time in decode steps; null: no tg run
}
_SKIPPED_KEYS: dict[str, tuple[type, ...]] = {
    "test": (str,),
    "kind": (str,),
    "batch": (int,),
    "depth": (int,),
    "reason": (str,),
}


def _proc_field(path: str, key: str) -> str | None:
    """The value of the first `key: value` line of a /proc file, if there is one."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def _memory_bytes() -> int | None:
    total = _proc_field("/proc/meminfo", "MemTotal")  # "16318412 kB"
    if total is not None and total.endswith("kB"):
        return int(total.split()[0]) * 1024
    return None


def machine_info() -> dict:
    """What the numbers were measured on."""
    return {
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or None,
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def document(mode: str, command: list[str], model: dict, config: dict, runs: list[dict]) -> dict:
    """The JSON document of one `mlcrun bench` invocation."""
    return {
        "schema": SCHEMA,
        "mode": mode,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": list(command),
        "mlcrun_version": __version__,
        "machine": machine_info(),
        "model": model,
        "config": config,
        "runs": runs,
    }


def _check_keys(obj: object, spec: dict[str, tuple[type, ...]], where: str) -> None:
    if not isinstance(obj, dict):
        raise MlcrunError(f"bench document: {where} must be an object")
    for key, types in spec.items():
        if key not in obj:
            raise MlcrunError(f"bench document: {where} is missing {key!r}")
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise MlcrunError(f"bench document: {where}.{key} must be {names}")


def _number_keys(keys: tuple[str, ...], optional: bool) -> dict[str, tuple[type, ...]]:
    return dict.fromkeys(keys, (*_NUMBER, type(None)) if optional else _NUMBER)


def _summary_spec() -> dict[str, tuple[type, ...]]:
    """Counts are ints, the duration a number, throughputs and the hit rate a number or null
    (no time passed, no input), latencies objects of stats."""
    spec: dict[str, tuple[type, ...]] = {}
    for key in SUMMARY_KEYS:
        if key in LATENCY_KEYS:
            spec[key] = (dict,)
        elif key == "duration_s":
            spec[key] = _NUMBER
        elif key.endswith(("throughput", "rate")):
            spec[key] = (*_NUMBER, type(None))
        else:
            spec[key] = (int,)
    return spec


def _check_serve_run(run: dict, where: str) -> None:
    _check_keys(run, _SERVE_RUN_KEYS, where)
    summary = run["summary"]
    _check_keys(summary, _summary_spec(), f"{where}.summary")
    for key in LATENCY_KEYS:
        _check_keys(summary[key], _number_keys(STAT_KEYS, True), f"{where}.summary.{key}")
    for i, sample in enumerate(run["samples"]):
        if not isinstance(sample, dict) or not set(SAMPLE_KEYS) <= sample.keys():
            raise MlcrunError(f"bench document: {where}.samples[{i}] needs keys {SAMPLE_KEYS}")


def _check_kernel_run(run: dict, where: str) -> None:
    _check_keys(run, _KERNEL_RUN_KEYS, where)
    if run["kind"] not in KERNEL_KINDS:
        raise MlcrunError(f"bench document: {where}.kind must be one of {KERNEL_KINDS}")
    _check_keys(run["tokens_per_s"], _number_keys(("mean", "std"), False), f"{where}.tokens_per_s")
    if run["kind"] == "verify":
        _check_keys(run, _VERIFY_RUN_KEYS, where)
    if not all(isinstance(s, _NUMBER) and not isinstance(s, bool) for s in run["samples"]):
        raise MlcrunError(f"bench document: {where}.samples must be numbers (seconds)")


def validate(doc: object) -> None:
    """Raise MlcrunError naming the first way `doc` differs from the schema."""
    _check_keys(doc, _TOP_KEYS, "the document")
    if doc["schema"] != SCHEMA:
        raise MlcrunError(f"bench document: schema is {doc['schema']!r}, expected {SCHEMA!r}")
    if not all(isinstance(part, str) for part in doc["command"]):
        raise MlcrunError("bench document: command must be a list of strings")
    check_run = _check_kernel_run if doc["mode"] == KERNEL_MODE else _check_serve_run
    for i, run in enumerate(doc["runs"]):
        check_run(run, f"runs[{i}]")
    if doc["mode"] == KERNEL_MODE and "skipped" in doc:
        if not isinstance(doc["skipped"], list):
            raise MlcrunError("bench document: skipped must be a list")
        for i, test in enumerate(doc["skipped"]):
            _check_keys(test, _SKIPPED_KEYS, f"skipped[{i}]")


def _write_atomic(path: str | Path, mode: str, write: Callable[[IO[Any]], None]) -> None:
    """Write through a temporary file in the same folder, then rename it over `path`, so that
    readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with open(fd, mode) as f:
            write(f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)  # mkstemp makes it 0600; a result is for everyone
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def write_json(path: str | Path, doc: dict) -> None:
    """Write the document as indented, strict JSON (atomically)."""
    text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
    _write_atomic(path, "w", lambda f: f.write(text))


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _run_label(run: dict) -> str:
    parts = []
    if run["concurrency"] is not None:
        parts.append(f"concurrency {run['concurrency']}")
    if run["request_rate"] is not None:
        parts.append(f"{run['request_rate']:g} req/s")
    return ", ".join(parts) or "all at once"


def _engine_value(value: object) -> str:
    if value is None:
        return "-"
    return format(value, ".3g") if isinstance(value, float) else str(value)


_LATENCY_ROWS = (
    ("TTFT", "ttft_ms", ("mean", "median", "p90", "p99")),
    ("TPOT", "tpot_ms", ("mean", "median", "p99")),
    ("ITL", "itl_ms", ("mean", "median", "p99")),
    ("E2EL", "e2el_ms", ("mean", "median", "p99")),
)


def _serve_cells(summary: dict) -> list[tuple[str, str]]:
    """(row label, cell) of one run's column in a serving table."""
    cells = [
        ("requests ok / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", _fmt(summary["duration_s"], ".2f")),
        ("requests/s", _fmt(summary["request_throughput"], ".2f")),
        ("input tok/s", _fmt(summary["input_throughput"], ".1f")),
        ("output tok/s", _fmt(summary["output_throughput"], ".1f")),
    ]
    for name, key, stat_keys in _LATENCY_ROWS:
        cells += [(f"{name} {stat} (ms)", _fmt(summary[key][stat], ".2f")) for stat in stat_keys]
    cells.append(("prefix-cache hit rate", _fmt(summary["prefix_cache_hit_rate"], ".1%")))
    return cells


def serve_table(doc: dict) -> Table:
    """A serving document as a table: one row per metric, one column per run."""
    runs = doc["runs"]
    table = Table(title=doc["model"].get("name"))
    table.add_column("metric")
    for run in runs:
        table.add_column(_run_label(run), justify="right")
    columns = [_serve_cells(run["summary"]) for run in runs]
    for row in zip(*columns):
        table.add_row(row[0][0], *(cell for _, cell in row))
    engine_keys = dict.fromkeys(key for run in runs for key in run["engine"])
    for key in engine_keys:
        table.add_row(key, *(_engine_value(run["engine"].get(key)) for run in runs))
    return table


def _kernel_label(run: dict) -> str:
    return run["test"] if run["batch"] == 1 else f"{run['test']} x{run['batch']}"


def kernel_table(doc: dict) -> Table:
    """A kernel document as a table, like llama-bench: one row per test. With verify (tv)
    rows, a "tg steps" column gives each verify call's time in decode steps at the same batch
    and depth."""
    table = Table(title=doc["model"].get("name"))
    for name in ("test", "batch", "depth"):
        table.add_column(name, justify="left" if name == "test" else "right")
    table.add_column("t/s", justify="right")
    verify = any(run["kind"] == "verify" for run in doc["runs"])
    if verify:
        table.add_column("tg steps", justify="right")
    for run in doc["runs"]:
        speed = run["tokens_per_s"]
        cells = [
            run["test"],
            str(run["batch"]),
            str(run["depth"]),
            f"{speed['mean']:.2f} ± {speed['std']:.2f}",
        ]
        if verify:
            cells.append(_fmt(run.get("tg_step_ratio"), ".2f"))
        table.add_row(*cells)
    return table


def profile_table(profile: dict) -> Table:
    """bench/profile.py's profile of a decode (or verify) step: milliseconds by kernel."""
    tokens = profile.get("tokens", 1)
    step = "one decode step" if tokens == 1 else f"one verify step of {tokens} tokens"
    title = (
        f"{step}: {profile['step_ms']:.2f} ms (batch {profile['batch']}, depth {profile['depth']})"
    )
    table = Table(title=title)
    for name in ("kernel", "calls", "ms", "share"):
        table.add_column(name, justify="left" if name == "kernel" else "right")
    for k in profile["kernels"]:
        calls = str(k["calls"]) if k["calls"] else ""
        table.add_row(k["name"], calls, f"{k['ms']:.3f}", f"{100 * k['share']:.1f}%")
    return table


def _plot_cdf(ax, values: list[float], label: str) -> None:
    data = sorted(values)
    if data:
        fractions = [(i + 1) / len(data) for i in range(len(data))]
        ax.step([data[0], *data], [0.0, *fractions], where="post", label=label)


def _sweep(runs: list[dict]) -> tuple[str, list[float]]:
    """The x axis of a sweep: concurrency, else request rate, else the run's position."""
    for key, label in (("concurrency", "concurrency"), ("request_rate", "request rate (req/s)")):
        if all(run[key] is not None for run in runs):
            return label, [run[key] for run in runs]
    return "run", list(range(1, len(runs) + 1))


def _draw_serve(fig, doc: dict) -> None:
    runs = doc["runs"]
    axes = fig.subplots(1, 2 if len(runs) > 1 else 1, squeeze=False)[0]
    cdf = axes[0]
    for run in runs:
        done = [s for s in run["samples"] if s["error"] is None and s["e2el_s"] is not None]
        label = _run_label(run)
        ttfts = [s["ttft_s"] * 1000 for s in done if s["ttft_s"] is not None]
        _plot_cdf(cdf, ttfts, f"TTFT, {label}")
        _plot_cdf(cdf, [s["e2el_s"] * 1000 for s in done], f"E2EL, {label}")
    cdf.set(xlabel="latency (ms)", ylabel="fraction of requests", title="latency CDF")
    cdf.legend(fontsize="small")
    if len(runs) > 1:
        xlabel, xs = _sweep(runs)
        ys = [run["summary"]["output_throughput"] or 0.0 for run in runs]
        axes[1].plot(xs, ys, marker="o")
        axes[1].set(xlabel=xlabel, ylabel="output tok/s", title="output throughput")
        if xlabel == "concurrency":
            axes[1].set_xscale("log", base=2)  # sweeps usually double


def _draw_kernel(fig, doc: dict) -> None:
    runs = doc["runs"]
    ax = fig.subplots()
    means = [run["tokens_per_s"]["mean"] for run in runs]
    stds = [run["tokens_per_s"]["std"] for run in runs]
    ax.bar([_kernel_label(run) for run in runs], means, yerr=stds, capsize=4)
    ax.set(ylabel="tokens/s", title="kernel throughput")


def write_plot(path: str | Path, doc: dict) -> None:
    """Plot the document (format from the file suffix, png by default), atomically."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MlcrunError("--plot needs matplotlib: pip install 'mlcrun[plot]'") from None
    fig = Figure(figsize=(12, 5), layout="constrained")
    canvas = FigureCanvasAgg(fig)
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    if fmt not in canvas.get_supported_filetypes():
        raise MlcrunError(f"--plot cannot write .{fmt} files; use .png, .svg or .pdf")
    (_draw_kernel if doc["mode"] == KERNEL_MODE else _draw_serve)(fig, doc)
    _write_atomic(path, "wb", lambda f: fig.savefig(f, format=fmt))
