"""Where a decode step's time goes: every call the VM makes, timed through its instrument hook.

The relax VM calls a Python hook before and after each Call instruction (compiled kernels, and
builtins such as the paged KV cache's attention); an entry is the time from the clock read at
the end of the first to the clock read at the start of the second. That interval holds the
call and part of the hook's own cost: returning from the first hook, and entering the second,
whose arguments tvm_ffi converts to Python objects first (a few tenths of a microsecond, more
with more arguments). The rest of the hook's cost (a few microseconds per call, which would
swamp the ~2,000 tiny VM builtins of a step: shapes, tuples, allocations) falls outside the
intervals, and the step itself is timed without the hook.

So each entry is corrected by the in-interval cost, a + b * (number of arguments), fitted in
the same run on builtins that do nothing measurable (`vm.builtin.null_value`,
`tuple_getitem`, `make_shape`: their whole interval is hook cost). (Subtracting the hook's
whole per-call cost instead, as this profile first did, took about 2 us too much from every
kernel call and moved ~0.3-0.6 ms of kernel time into "other".) The builtins are reported
together as "VM builtins"; "other" is what the entries leave of the unhooked step: the VM
interpreter, embedding the input, the KV cache's begin/end of the forward, handing the logits
out. Unhooked and hooked runs alternate over several rounds and each entry is the median over
the rounds, so that a busy machine moves the result less.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from ..runtime import Model
from .kernel import prefill_chunks

# Builtins whose work is negligible next to the hook's: their intervals calibrate its cost.
CALIBRATION = ("vm.builtin.null_value", "vm.builtin.tuple_getitem", "vm.builtin.make_shape")


def profile_decode(
    model: Model,
    batch: int = 1,
    depth: int = 128,
    steps: int = 16,
    rounds: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    tokens: int = 1,
) -> dict:
    """Decode `steps` tokens for `batch` sequences of `depth` tokens, timing each VM call, in
    `rounds` alternating unhooked/hooked runs; with `tokens` > 1 each step is instead a verify
    of a `tokens`-node chain per sequence and its commit (a speculative step that accepts every
    draft). Returns {"step_ms", "batch", "depth", "tokens",
    "hook_us": [a, b] (the fitted in-interval hook cost: a + b per argument, microseconds),
    "kernels": [{"name", "calls", "ms", "share"}]}: per-step milliseconds (medians over the
    rounds), largest first; shares of the unhooked step time. `clock`: e.g. time.thread_time
    with a one-thread pool, to leave out the time a busy machine keeps the thread waiting."""
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    num_args: dict[str, int] = defaultdict(int)
    samples: dict[int, list[float]] = defaultdict(list)  # calibration: arguments -> intervals
    started: list[float] = []

    def instrument(func, name, before, ret, *args):
        if before:
            started.append(clock())
        else:
            elapsed = clock() - started.pop()  # first: what follows is outside the interval
            totals[name] += elapsed
            calls[name] += 1
            num_args[name] += len(args)
            if name in CALIBRATION:
                samples[len(args)].append(elapsed)
        return 0  # VMInstrumentReturnKind.kNoOp

    # Every round adds 2 * steps * tokens tokens (then pops them), after one warm-up step.
    page = model.artifact.page_size
    grown = depth + (2 * steps + 1) * tokens
    capacity = batch * (-(-grown // page) + 1) * page  # whole pages each
    model.create_kv_cache(max_num_sequence=batch, max_total_sequence_length=capacity)
    rng = np.random.default_rng(0)
    seqs = list(range(batch))
    for s in seqs:
        model.add_new_sequence(s)
        prefill_chunks(model, s, rng.integers(0, 100, depth).tolist())
    ids = rng.integers(0, 100, batch * tokens).tolist()
    chain = list(range(-1, tokens - 1)) * batch  # each sequence's parent pointers

    def one_step() -> None:
        if tokens == 1:
            model.batch_decode(model.token_embed(ids), seqs)
            return
        model.batch_verify(model.token_embed(ids), seqs, [tokens] * batch, chain)
        model.commit_accepted_token_tree_nodes(seqs, [tokens - 1] * batch)

    def run() -> float:
        start = clock()
        for _ in range(steps):
            one_step()
        return (clock() - start) / steps

    unhooked: list[float] = []
    hooks: list[tuple[float, float]] = []
    rows: list[dict[str, tuple[float, int]]] = []  # per round: name -> (s per step, calls)
    try:
        one_step()  # warm-up
        for _ in range(rounds):
            step = run()
            for table in (totals, calls, num_args, samples):
                table.clear()
            model.set_vm_instrument(instrument)
            try:
                run()
            finally:
                model.set_vm_instrument(None)
            for s in seqs:
                model.popn(s, 2 * steps * tokens)
            hook = _fit(samples)
            unhooked.append(step)
            hooks.append(hook)
            rows.append(_entries(totals, calls, num_args, steps, step, hook))
    finally:
        for s in seqs:
            model.remove_sequence(s)
    step = statistics.median(unhooked)
    names = {name for row in rows for name in row}
    median = {n: statistics.median(row.get(n, (0.0, 0))[0] for row in rows) for n in names}
    count = {n: max(row.get(n, (0.0, 0))[1] for row in rows) for n in names}
    kernels = [
        {"name": n, "calls": count[n], "ms": 1e3 * median[n], "share": median[n] / step}
        for n in sorted(names, key=median.get, reverse=True)
    ]
    hook_us = [1e6 * statistics.median(h[i] for h in hooks) for i in (0, 1)]
    return {
        "step_ms": 1e3 * step,
        "batch": batch,
        "depth": depth,
        "tokens": tokens,
        "hook_us": hook_us,
        "kernels": kernels,
    }


def _fit(samples: dict[int, list[float]]) -> tuple[float, float]:
    """(a, b): the in-interval hook cost a + b * arguments, least squares over the median
    interval of each argument count of the calibration builtins."""
    points = [(n, statistics.median(v)) for n, v in samples.items() if v]
    if not points:
        return 0.0, 0.0
    if len(points) == 1:
        return points[0][1], 0.0
    xs = np.array([n for n, _ in points], dtype=np.float64)
    ys = np.array([t for _, t in points], dtype=np.float64)
    b, a = np.polyfit(xs, ys, 1)
    return float(a), max(float(b), 0.0)


def _entries(totals, calls, num_args, steps: int, step: float, hook) -> dict:
    """One round: name -> (seconds per step, calls per step), the in-interval hook cost
    subtracted, the builtins summed up, and "other"."""
    a, b = hook
    out = {n: max(0.0, totals[n] - a * calls[n] - b * num_args[n]) / steps for n in totals}
    count = {n: calls[n] // steps for n in totals}
    builtins = [n for n in out if n.startswith("vm.builtin.") and "attention" not in n]
    out["VM builtins"] = sum(out.pop(n) for n in builtins)
    count["VM builtins"] = sum(count.pop(n) for n in builtins)
    out["other"] = max(0.0, step - sum(out.values()))
    count["other"] = 0
    return {n: (out[n], count[n]) for n in out}
