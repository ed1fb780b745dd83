"""Measuring what a speculative step costs on this machine, for the adaptive draft length.

Scratch sequences are prefilled to a moderate depth, then at each batch size the target runs a
plain decode step and chain verifies of n tokens per sequence, and the draft model (if any) a
decode step; last, DEEP_BATCH sequences DEEP tokens deep (or as deep as the context window
allows) run the target's steps and the draft model's decode step again, for what each token of
depth adds (CostModel.deep, CostModel.deep_draft). A few sequences rather than one: at depth 512
one SmolLM2 q4 sequence's decode step takes about 1 ms more than its 3.3 ms at 64, so a
one-sequence point is mostly noise. A table from 2 Xeon cores held 5.5 ms for it (4.3 ms timed
alone), so it priced each token of depth at twice its cost, verifies deep in the cache looked
cheap beside plain steps, and 16 requests under prompt lookup drafted where it cost throughput
(0.92x plain decoding).

Each point is the fastest of a few timed calls after a warm-up (other work on the machine only
ever adds time, and a cost table measured slow would stop speculation where it pays). The calls
go round by round, one of each step per round, so that a burst of other work slows every step
of a round alike rather than all calls of one step: a table whose plain step alone was timed
during a burst makes verifies look cheap beside it, and drafts then run where they cost
throughput (on 2 busy cores, a batch-16 decode step timed at twice its cost made 16 requests
under prompt lookup 15% slower than plain decoding). The rounds go up the verify sizes and down
again in turn, so that every step is timed right after a step no larger than itself: a step right
after the largest verify runs slower (a decode step of one sequence 512 tokens deep 4.2-4.6 ms
after a 9-token verify, 3.8 ms after a 2-token one, 2 Xeon cores), and with one order for every
round the plain step always came right after it. The caches are left as they were. Done once
per model and machine (the caller caches the result).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

from ..kv_manager import KVManager
from ..runner import ModelRunner
from .adaptive import CostModel

VERIFY_SIZES = (1, 2, 3, 5, 9)
DEPTH = 64
DEEP = 512  # the second depth: about where answers of a few hundred tokens decode
DEEP_BATCH = 4  # sequences at the second depth (fewer where the cache has no room)
REPEATS = 5


def measure_costs(
    runner: ModelRunner,
    kv: KVManager,
    batch_sizes: Sequence[int],
    *,
    draft: ModelRunner | None = None,
    max_tokens: int = 9,
    chunk: int = 512,
    context_window: int = DEEP + 16,
) -> CostModel:
    sizes = sorted({n for n in VERIFY_SIZES if n <= max_tokens} | {1, max_tokens})
    batch_sizes = sorted(set(batch_sizes))
    costs = CostModel(depth=DEPTH)
    seqs = []
    try:
        for _ in range(batch_sizes[-1]):
            seqs.append(_scratch(kv, (runner, draft), DEPTH, chunk))
        for b in batch_sizes:
            ids = seqs[:b]
            steps = {n: partial(_time_verify, runner, ids, n) for n in sizes if b * n <= chunk}
            if draft is not None:  # key 0: the draft model's decode step
                steps[0] = partial(_time_decode, draft, ids)
            best = _fastest_by_rounds(steps)
            costs.verify[b] = {n: t for n, t in best.items() if n}
            if draft is not None:
                costs.draft[b] = best[0]
    finally:
        for seq_id in seqs:
            kv.close(seq_id)
    deep = min(DEEP, context_window - max_tokens)
    fits = kv.free_pages() // kv.pages(deep + max_tokens) if deep >= 2 * DEPTH else 0
    batch = max((b for b in costs.verify if b <= min(DEEP_BATCH, fits)), default=0)
    if batch:
        seqs = []
        try:
            for _ in range(batch):
                seqs.append(_scratch(kv, (runner, draft), deep, chunk))
            steps = {n: partial(_time_verify, runner, seqs, n) for n in costs.verify[batch]}
            if draft is not None:
                steps[0] = partial(_time_decode, draft, seqs)
            best = _fastest_by_rounds(steps)
            costs.deep = {n: t for n, t in best.items() if n}
            costs.deep_draft = best.get(0, 0.0)
            costs.deep_depth, costs.deep_batch = deep, batch
        finally:
            for seq_id in seqs:
                kv.close(seq_id)
    return costs


def _scratch(kv: KVManager, caches, depth: int, chunk: int) -> int:
    """A new sequence `depth` tokens deep in every cache given (None: skipped)."""
    prompt = [(7 * i + 3) % 97 + 1 for i in range(depth)]
    seq_id, _, _ = kv.open([])
    for cache in caches:
        if cache is None:
            continue
        for start in range(0, depth, chunk):
            part = prompt[start : start + chunk]
            cache.batch_prefill(cache.token_embed(part), [seq_id], [len(part)])
    return seq_id


def _fastest_by_rounds(steps: dict) -> dict:
    """Each step's fastest call over REPEATS rounds of one call each, after a warm-up round;
    the rounds go through the steps in their order and back."""
    keys = list(steps)
    times: dict = {key: [] for key in keys}
    for r in range(REPEATS + 1):
        for key in reversed(keys) if r % 2 else keys:
            times[key].append(steps[key]())
    return {key: min(t[1:]) for key, t in times.items()}


def _time_verify(runner: ModelRunner, ids: list[int], n: int) -> float:
    """One chain verify of n tokens per sequence and its commit (n = 1: a decode step), then
    the sequences back to their depth."""
    if n == 1:
        return _time_decode(runner, ids)
    parents = [-1, *range(n - 1)] * len(ids)
    emb = runner.token_embed([5] * (n * len(ids)))
    start = time.perf_counter()
    runner.batch_verify(emb, ids, [n] * len(ids), parents)
    runner.commit_accepted_token_tree_nodes(ids, [0] * len(ids))
    elapsed = time.perf_counter() - start
    for seq_id in ids:  # back to the same depth
        runner.popn(seq_id, 1)
    return elapsed


def _time_decode(runner: ModelRunner, ids: list[int]) -> float:
    emb = runner.token_embed([5] * len(ids))
    start = time.perf_counter()
    runner.batch_decode(emb, ids)
    elapsed = time.perf_counter() - start
    for seq_id in ids:
        runner.popn(seq_id, 1)
    return elapsed
