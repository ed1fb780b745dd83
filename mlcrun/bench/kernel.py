"""`mlcrun bench --mode kernel`: the model's own speed, like llama-bench.

Prefill tests (`pp{P}@d{D}`) time appending P tokens to one sequence that already holds D;
decode tests (`tg{N}x{B}@d{D}`) time N decode steps of B sequences of D tokens each. Token ids
are random and decode feeds fixed ids back, so neither tokenization nor sampling is timed: only
embedding, the model functions and copying logits out. Each test runs once to warm up, then
`reps` times; the KV cache is emptied between runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import MlcrunError
from ..runtime import Model


@dataclass(frozen=True)
class KernelTest:
    kind: str  # "prefill" | "decode"
    tokens: int  # prompt length (prefill) or decode steps (decode)
    batch: int
    depth: int

    @property
    def name(self) -> str:
        if self.kind == "prefill":
            return f"pp{self.tokens}@d{self.depth}"
        return f"tg{self.tokens}x{self.batch}@d{self.depth}"


def plan(
    prompt_lens: list[int], batches: list[int], depths: list[int], decode_tokens: int
) -> list[KernelTest]:
    tests = [KernelTest("prefill", p, 1, d) for d in depths for p in prompt_lens]
    tests += [KernelTest("decode", decode_tokens, b, d) for d in depths for b in batches]
    return tests


def check_fits(model: Model, tests: list[KernelTest]) -> None:
    """Refuse tests the artifact cannot hold, before any is run."""
    art = model.artifact
    for t in tests:
        if t.batch > art.max_batch:
            raise MlcrunError(f"batch {t.batch} exceeds the artifact's max batch {art.max_batch}")
        if t.depth + t.tokens > art.context_window:
            raise MlcrunError(
                f"{t.name}: {t.depth + t.tokens} tokens exceed the context window "
                f"({art.context_window})"
            )


def run_tests(
    model: Model,
    tests: list[KernelTest],
    reps: int,
    on_rep: Callable[[], None] | None = None,
    seed: int = 0,
) -> list[dict]:
    """Each test's report run: {"test", "kind", "prompt_len", "batch", "depth",
    "tokens_per_s": {"mean", "std"}, "samples": [seconds per run]}."""
    if reps <= 0:
        raise MlcrunError("--repetitions must be positive")
    check_fits(model, tests)
    capacity = max(t.batch * (t.depth + t.tokens) for t in tests) + 2 * model.artifact.page_size
    batch = max(t.batch for t in tests)
    model.create_kv_cache(max_num_sequence=batch, max_total_sequence_length=capacity)
    rng = np.random.default_rng(seed)
    runs = []
    for test in tests:
        _time_once(model, test, rng)  # warm-up
        samples = []
        for _ in range(reps):
            samples.append(_time_once(model, test, rng))
            if on_rep:
                on_rep()
        rates = [test.batch * test.tokens / s for s in samples]
        runs.append(
            {
                "test": test.name,
                "kind": test.kind,
                "prompt_len": test.tokens if test.kind == "prefill" else None,
                "batch": test.batch,
                "depth": test.depth,
                "tokens_per_s": {"mean": float(np.mean(rates)), "std": float(np.std(rates))},
                "samples": samples,
            }
        )
    return runs


def _time_once(model: Model, test: KernelTest, rng: np.random.Generator) -> float:
    """Seconds of the timed part of one run of `test` (sequences set up and removed here)."""
    vocab = model.vocab_size
    seqs = list(range(test.batch))
    for s in seqs:
        model.add_new_sequence(s)
    try:
        for s in seqs:
            _prefill(model, s, rng.integers(0, vocab, test.depth).tolist())
        if test.kind == "prefill":
            ids = rng.integers(0, vocab, test.tokens).tolist()
            start = time.perf_counter()
            _prefill(model, 0, ids)
            return time.perf_counter() - start
        ids = rng.integers(0, vocab, test.batch).tolist()
        start = time.perf_counter()
        for _ in range(test.tokens):
            model.batch_decode(model.token_embed(ids), seqs)
        return time.perf_counter() - start
    finally:
        for s in seqs:
            model.remove_sequence(s)


def _prefill(model: Model, seq: int, ids: list[int]) -> None:
    chunk = model.artifact.prefill_chunk
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        model.batch_prefill(model.token_embed(part), [seq], [len(part)])
