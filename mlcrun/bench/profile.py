"""Where a decode step's time goes: every call the VM makes, timed through its instrument hook.

The relax VM calls the hook before and after each Call instruction (compiled kernels, and
builtins such as the paged KV cache's attention). The hook itself costs about a microsecond
per call, which would swamp the ~2,000 tiny VM builtins of a step (shapes, tuples,
allocations). So the step is timed twice, without and with the hook; the difference over the
number of calls is the hook's cost per call, subtracted from every entry. The builtins are
reported together as "VM builtins"; "other" is what the entries leave of the unhooked step:
the VM interpreter, embedding the input, copying the logits out.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from ..runtime import Model


def profile_decode(model: Model, batch: int = 1, depth: int = 128, steps: int = 16) -> dict:
    """Decode `steps` tokens for `batch` sequences of `depth` tokens, timing each VM call.
    Returns {"step_ms", "batch", "depth", "kernels": [{"name", "calls", "ms", "share"}]}:
    per-step milliseconds, largest first; shares of the unhooked step time."""
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    started: list[float] = []

    def instrument(func, name, before, ret, *args):
        if before:
            started.append(time.perf_counter())
        else:
            totals[name] += time.perf_counter() - started.pop()
            calls[name] += 1
        return 0  # VMInstrumentReturnKind.kNoOp

    capacity = batch * (depth + steps + 1) + 4 * model.artifact.page_size
    model.create_kv_cache(max_num_sequence=batch, max_total_sequence_length=capacity)
    rng = np.random.default_rng(0)
    seqs = list(range(batch))
    for s in seqs:
        model.add_new_sequence(s)
        if depth:
            model.batch_prefill(
                model.token_embed(rng.integers(0, 100, depth).tolist()), [s], [depth]
            )
    ids = rng.integers(0, 100, batch).tolist()
    try:
        model.batch_decode(model.token_embed(ids), seqs)  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            model.batch_decode(model.token_embed(ids), seqs)
        step = (time.perf_counter() - start) / steps
        model.set_vm_instrument(instrument)
        try:
            start = time.perf_counter()
            for _ in range(steps):
                model.batch_decode(model.token_embed(ids), seqs)
            hooked = (time.perf_counter() - start) / steps
        finally:
            model.set_vm_instrument(None)
    finally:
        for s in seqs:
            model.remove_sequence(s)
    per_call = max(0.0, (hooked - step) * steps / max(sum(calls.values()), 1))
    for name in totals:
        totals[name] = max(0.0, totals[name] - per_call * calls[name])
    builtins = [n for n in totals if n.startswith("vm.builtin.") and "attention" not in n]
    totals["VM builtins"] = sum(totals.pop(n) for n in builtins)
    calls["VM builtins"] = sum(calls.pop(n) for n in builtins)
    totals["other"] = max(0.0, step * steps - sum(totals.values()))
    calls["other"] = 0
    rows = sorted(totals, key=totals.get, reverse=True)
    kernels = [
        {
            "name": name,
            "calls": calls[name] // steps,
            "ms": 1e3 * totals[name] / steps,
            "share": totals[name] / (step * steps),
        }
        for name in rows
    ]
    return {"step_ms": 1e3 * step, "batch": batch, "depth": depth, "kernels": kernels}
