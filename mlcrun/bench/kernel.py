"""`mlcrun bench --mode kernel`: the model's own speed, like llama-bench.

Prefill tests (`pp{P}@d{D}`) time appending P tokens to one sequence that already holds D;
decode tests (`tg{N}x{B}@d{D}`) time N decode steps of B sequences of D tokens each; verify
tests (`tv{K}x{B}@d{D}`) time one `batch_verify` of a chain of K+1 tokens per sequence (the
last accepted token and K drafts, as a speculative-decoding step scores them) and its commit,
for B sequences of D tokens each. Token ids are random and decode feeds fixed ids back, so
neither tokenization nor sampling is timed: only embedding, the model functions, the KV
cache's bookkeeping and copying logits out. Each test runs once to warm up, then `reps` times;
prefill and decode tests empty the KV cache between runs, verify tests pop what they appended.

A test whose depth leaves no room for its tokens in the context window is skipped (`fit`);
lengths over the window on their own, and batches over the artifact's max batch, are
input errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import abi
from ..errors import MlcrunError
from ..runtime import Model


@dataclass(frozen=True)
class KernelTest:
    kind: str  # "prefill" | "decode" | "verify"
    tokens: int  # per sequence: prompt length, decode steps, or verified chain length (K+1)
    batch: int
    depth: int

    @property
    def name(self) -> str:
        if self.kind == "prefill":
            return f"pp{self.tokens}@d{self.depth}"
        if self.kind == "verify":
            return f"tv{self.tokens - 1}x{self.batch}@d{self.depth}"
        return f"tg{self.tokens}x{self.batch}@d{self.depth}"


def plan(
    prompt_lens: list[int],
    batches: list[int],
    depths: list[int],
    decode_tokens: int,
    verify: list[int] | tuple[int, ...] = (),
) -> list[KernelTest]:
    """Prefill tests, then for each depth and batch its decode test followed by its verify
    tests (`verify` lists the K of each; K+1 tokens per sequence are verified)."""
    tests = [KernelTest("prefill", p, 1, d) for d in depths for p in prompt_lens]
    for d in depths:
        for b in batches:
            tests.append(KernelTest("decode", decode_tokens, b, d))
            tests += [KernelTest("verify", k + 1, b, d) for k in verify]
    return tests


def _length_flag(test: KernelTest) -> str:
    if test.kind == "prefill":
        return f"--prompt-lens {test.tokens}"
    if test.kind == "verify":
        return f"--verify {test.tokens - 1} ({test.tokens} tokens)"
    return f"--decode-tokens {test.tokens}"


def fit(model: Model, tests: list[KernelTest]) -> tuple[list[KernelTest], list[dict]]:
    """Split `tests` into those the artifact can run and the skipped ones, as JSON records
    {"test", "kind", "batch", "depth", "reason"}: a test is skipped when its depth leaves no
    room for its tokens in the context window. Raises MlcrunError, before anything runs, for
    what no depth can fix (a batch over the artifact's max batch, a length over the window on
    its own, verification on a sliding-window model) and when no test fits at all."""
    art = model.artifact
    window = art.context_window
    runnable, skipped = [], []
    for t in tests:
        if t.batch > art.max_batch:
            raise MlcrunError(f"batch {t.batch} exceeds the artifact's max batch {art.max_batch}")
        if t.tokens > window:
            raise MlcrunError(f"{_length_flag(t)} exceeds the context window ({window})")
        if t.kind == "verify":
            _check_verify(model, t)
        if t.depth + t.tokens > window:
            reason = f"depth {t.depth} + {t.tokens} tokens exceed the context window ({window})"
            record = {"test": t.name, "kind": t.kind, "batch": t.batch, "depth": t.depth}
            skipped.append({**record, "reason": reason})
        else:
            runnable.append(t)
    if not runnable:
        depths = ",".join(str(d) for d in sorted({t.depth for t in tests}))
        raise MlcrunError(f"no test fits the context window ({window}) at --depths {depths}")
    return runnable, skipped


def _check_verify(model: Model, t: KernelTest) -> None:
    """What no depth can fix for a verify test: the model, the tree size, one forward."""
    chunk = model.artifact.prefill_chunk
    if model.config.sliding_window:
        raise MlcrunError("--verify: TVM's tree attention does not support sliding-window models")
    if t.tokens > abi.MAX_TREE_NODES:
        raise MlcrunError(
            f"{_length_flag(t)} exceeds the {abi.MAX_TREE_NODES} tokens the KV cache "
            "verifies per sequence"
        )
    if t.batch * t.tokens > chunk:
        raise MlcrunError(
            f"{_length_flag(t)} at batch {t.batch}: {t.batch * t.tokens} tokens in one "
            f"forward exceed the artifact's prefill chunk ({chunk})"
        )


def check_fits(model: Model, tests: list[KernelTest]) -> None:
    """Refuse, before any is run, tests the artifact cannot hold (none is skipped)."""
    _, skipped = fit(model, tests)
    if skipped:
        raise MlcrunError(f"{skipped[0]['test']}: {skipped[0]['reason']}")


def run_tests(
    model: Model,
    tests: list[KernelTest],
    reps: int,
    on_rep: Callable[[], None] | None = None,
    seed: int = 0,
) -> list[dict]:
    """Each test's report run: {"test", "kind", "prompt_len", "batch", "depth",
    "tokens_per_s": {"mean", "std"}, "samples": [seconds per run]}; verify runs add
    "verify_len" (K+1) and "tg_step_ratio" (one verify call's mean time over one decode step's
    at the same batch and depth, or None). Every test must fit (`fit`)."""
    if reps <= 0:
        raise MlcrunError("--repetitions must be positive")
    check_fits(model, tests)
    page = model.artifact.page_size
    pages = max(t.batch * -(-(t.depth + t.tokens) // page) for t in tests)  # whole pages a seq
    capacity = (pages + 2) * page
    batch = max(t.batch for t in tests)
    model.create_kv_cache(max_num_sequence=batch, max_total_sequence_length=capacity)
    rng = np.random.default_rng(seed)
    runs = []
    step_s: dict[tuple[int, int], float] = {}  # (batch, depth) -> mean seconds of a tg step
    for test in tests:
        if test.kind == "verify":
            samples = _time_verify(model, test, rng, reps, on_rep)
        else:
            _time_once(model, test, rng)  # warm-up
            samples = []
            for _ in range(reps):
                samples.append(_time_once(model, test, rng))
                if on_rep:
                    on_rep()
        rates = [test.batch * test.tokens / s for s in samples]
        run = {
            "test": test.name,
            "kind": test.kind,
            "prompt_len": test.tokens if test.kind == "prefill" else None,
            "batch": test.batch,
            "depth": test.depth,
            "tokens_per_s": {"mean": float(np.mean(rates)), "std": float(np.std(rates))},
            "samples": samples,
        }
        if test.kind == "decode":
            step_s[test.batch, test.depth] = float(np.mean(samples)) / test.tokens
        if test.kind == "verify":
            run["verify_len"] = test.tokens
        runs.append(run)
    for run in runs:
        if run["kind"] == "verify":
            # One verify call's time in decode steps at the same batch and depth (None when
            # that decode test did not run): speculation pays when a verify yields more tokens
            # (accepted drafts + 1) than this, plus what drafting them costs.
            step = step_s.get((run["batch"], run["depth"]))
            run["tg_step_ratio"] = float(np.mean(run["samples"])) / step if step else None
    return runs


def _time_once(model: Model, test: KernelTest, rng: np.random.Generator) -> float:
    """Seconds of the timed part of one run of `test` (sequences set up and removed here)."""
    vocab = model.vocab_size
    seqs = list(range(test.batch))
    for s in seqs:
        model.add_new_sequence(s)
    try:
        for s in seqs:
            prefill_chunks(model, s, rng.integers(0, vocab, test.depth).tolist())
        if test.kind == "prefill":
            ids = rng.integers(0, vocab, test.tokens).tolist()
            start = time.perf_counter()
            prefill_chunks(model, 0, ids)
            return time.perf_counter() - start
        ids = rng.integers(0, vocab, test.batch).tolist()
        start = time.perf_counter()
        for _ in range(test.tokens):
            model.batch_decode(model.token_embed(ids), seqs)
        return time.perf_counter() - start
    finally:
        for s in seqs:
            model.remove_sequence(s)


def _time_verify(
    model: Model,
    test: KernelTest,
    rng: np.random.Generator,
    reps: int,
    on_rep: Callable[[], None] | None,
) -> list[float]:
    """Seconds of each of `reps` verify calls of `test`, after one to warm up, all on the same
    B sequences of D tokens (set up once, removed here)."""
    seqs = list(range(test.batch))
    n = test.tokens
    parents = list(range(-1, n - 1)) * test.batch  # one chain per sequence
    leaves = [n - 1] * test.batch  # the chain's last node: every draft accepted
    for s in seqs:
        model.add_new_sequence(s)
    try:
        for s in seqs:
            prefill_chunks(model, s, rng.integers(0, model.vocab_size, test.depth).tolist())
        ids = rng.integers(0, model.vocab_size, test.batch * n).tolist()
        samples = []
        for rep in range(reps + 1):
            start = time.perf_counter()
            model.batch_verify(model.token_embed(ids), seqs, [n] * test.batch, parents)
            model.commit_accepted_token_tree_nodes(seqs, leaves)
            elapsed = time.perf_counter() - start
            # Keeping the whole chain is the case the rate counts (K+1 tokens per sequence);
            # it is already contiguous, so the commit copies nothing. Popping it again, outside
            # the timed part, puts every sequence back at exactly D tokens, so each repetition
            # verifies at the same depth over the same cache: without it the depth would creep
            # up by K+1 per repetition.
            for s in seqs:
                model.popn(s, n)
            if rep:  # the first call is the warm-up
                samples.append(elapsed)
                if on_rep:
                    on_rep()
        return samples
    finally:
        for s in seqs:
            model.remove_sequence(s)


def prefill_chunks(model: Model, seq: int, ids: list[int]) -> None:
    """Feed `ids` to sequence `seq` in forwards of at most the artifact's prefill chunk."""
    chunk = model.artifact.prefill_chunk
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        model.batch_prefill(model.token_embed(part), [seq], [len(part)])
