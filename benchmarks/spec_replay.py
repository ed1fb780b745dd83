"""Prompt lookup replayed without the model: what each draft-length policy makes of plain
decoding's answers at the step costs a speculative.py run measured.

    .venv/bin/python benchmarks/spec_replay.py [RAW]

RAW: a speculative.py run's raw samples (default benchmarks/.cache/speculative/raw-speculative.json,
which every full run writes). speculative.py's report calls `replay_report` too, so its JSON and
docs/performance.md carry these figures; run this file alone to print them.

For each model with an adaptive `ngram` run, mlcrun's plain answers to the input-grounded prompts
(greedy, the first round) are decoded again by mlcrun's own engine, with a runner whose greedy
choice at every position is the recorded answer (tests/unit/fake_runner.py with a script): the
engine drafts, verifies, accepts and adapts exactly as it did, only the model is replaced. A
replay's time is the sum of its forwards' costs from the cost table that run measured at
warm-up (a chain verify of n tokens at batch 1 at the sequence's depth; a plain step is n = 1),
so it counts the kernels' step costs only, not the lookup and bookkeeping in Python; its
speedup is the plain answers' steps at the plain cost over that. Policies:

* adaptive: the engine's default (the draft length that maximises expected tokens per second).
* K = 1 .. spec_max_draft_length: a fixed draft length.
* hindsight: at every step, the draft length (0 included) that makes that step's tokens per
  second the highest, knowing which drafted tokens the model keeps; the same lookup
  (NgramDrafter.lookup). No policy that chooses the length before the verify does better with
  this drafter at these costs.

`increment_scale`: the factor on every verify's cost above a plain step (1: as measured) at
which the adaptive replay reaches the target speedup, found by bisection; the cost the kernels
of a multi-token step would need for the target, with the drafter as it is.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests" / "unit"))  # fake_runner.FakeRunner

from fake_runner import FakeRunner  # noqa: E402

from mlcrun.engine.config import EngineConfig  # noqa: E402
from mlcrun.engine.engine import Engine  # noqa: E402
from mlcrun.engine.spec.adaptive import CostModel  # noqa: E402
from mlcrun.engine.spec.ngram import NgramDrafter  # noqa: E402
from mlcrun.engine.types import SamplingParams  # noqa: E402

DEFAULT_RAW = ROOT / ".cache" / "speculative" / "raw-speculative.json"
PAGE, CHUNK = 16, 512  # the replay's KV page and prefill chunk (they do not change a decode)
KIND = "grounded"


class ScriptRunner(FakeRunner):
    """FakeRunner whose logits are one-hot at the script's token (no random draws: the real
    vocabulary is large)."""

    def logits(self, history) -> np.ndarray:
        out = np.zeros(self.vocab_size, np.float32)
        k = len(history) - self.script_from
        out[self.script[k] if 0 <= k < len(self.script) else 0] = 1.0
        return out

    def batch_decode(self, embeddings, seq_ids):
        self.depths.append(len(self.seqs[seq_ids[0]]))
        return super().batch_decode(embeddings, seq_ids)

    def batch_verify(self, embeddings, seq_ids, lengths, token_tree_parent_ptr):
        self.depths.append(len(self.seqs[seq_ids[0]]))
        return super().batch_verify(embeddings, seq_ids, lengths, token_tree_parent_ptr)


def _forward_costs(runner: FakeRunner, costs: CostModel) -> tuple[float, int]:
    """(seconds, forwards) of the decode and verify calls a replay made (a prefill comes before
    the first token, which no decode rate counts)."""
    steps = [(kind, lengths) for kind, _, lengths in runner.calls if kind in ("decode", "verify")]
    seconds = sum(
        costs.verify_cost(1, sum(lengths), depth)
        for (_, lengths), depth in zip(steps, runner.depths, strict=True)
    )
    return seconds, len(steps)


def _engine_replay(answers: list, costs: CostModel, draft_length: int = 0) -> dict:
    """The engine's ngram decoding of every answer (batch 1), timed on `costs`."""
    vocab = 1 + max(max(ids + out) for ids, out in answers)
    seconds = forwards = 0
    for ids, out in answers:
        runner = ScriptRunner(vocab_size=vocab, script=out, script_from=len(ids))
        runner.depths = []  # the sequence's cached tokens at each decode or verify
        window = -(-(len(ids) + len(out) + 1) // PAGE) * PAGE
        config = EngineConfig(
            max_total_sequence_length=window,
            speculative_mode="ngram",
            spec_draft_length=draft_length,
        ).resolve(
            context_window=window,
            max_batch=1,
            prefill_chunk=CHUNK,
            page_size=PAGE,
            kv_bytes_per_token=1,
        )
        engine = Engine(runner, config, context_window=window, cost_model=costs)
        greedy = SamplingParams(max_tokens=len(out), temperature=0, ignore_eos=True)
        engine.add_request("replay", ids, greedy)
        got = []
        while engine.has_unfinished():
            got += [o for o in engine.step() if o.finished]
        if got[0].token_ids != out:
            raise RuntimeError("the replay did not reproduce the recorded answer")
        s, f = _forward_costs(runner, costs)
        seconds, forwards = seconds + s, forwards + f
    return _result(answers, costs, seconds, forwards)


def _hindsight(answers: list, costs: CostModel, max_k: int, ngram_max: int) -> dict:
    """Each step's best draft length, knowing the outcome (see the module doc)."""
    drafter = NgramDrafter(ngram_max)
    seconds = forwards = 0
    for ids, out in answers:
        p = 0  # out[p]: the pending token
        while p < len(out) - 1:
            depth = len(ids) + p  # cached tokens: the prompt and the answer before out[p]
            best = (1 / costs.verify_cost(1, 1, depth), 0, 1)  # (tokens/s, kept, nodes)
            for k in range(1, min(max_k, len(out) - 1 - p) + 1):
                chain = drafter.lookup([*ids, *out[: p + 1]], k).tokens
                kept = 0
                while kept < len(chain) and chain[kept] == out[p + 1 + kept]:
                    kept += 1
                nodes = 1 + len(chain)
                best = max(best, ((1 + kept) / costs.verify_cost(1, nodes, depth), kept, nodes))
            seconds += costs.verify_cost(1, best[2], depth)
            forwards += 1
            p += 1 + best[1]
    return _result(answers, costs, seconds, forwards)


def _result(answers, costs: CostModel, seconds: float, forwards: int) -> dict:
    """Speedup over plain decoding's steps at the plain cost (at each step's depth), and tokens
    per forward (the tokens after the first of every answer)."""
    tokens = sum(len(out) - 1 for _, out in answers)
    plain = sum(
        costs.verify_cost(1, 1, len(ids) + p) for ids, out in answers for p in range(len(out) - 1)
    )
    return {
        "speedup": plain / seconds,
        "tokens_per_forward": tokens / forwards,
    }


def _scaled(costs: CostModel, scale: float) -> CostModel:
    """`costs` with every verify's cost above the plain step's (at either depth) times
    `scale`."""

    def scaled(row: dict[int, float]) -> dict[int, float]:
        return {n: row[1] + scale * (t - row[1]) for n, t in row.items()}

    verify = {b: scaled(row) for b, row in costs.verify.items()}
    deep = scaled(costs.deep) if costs.deep else {}
    return replace(costs, verify=verify, draft=dict(costs.draft), deep=deep)


def increment_scale(
    answers: list, costs: CostModel, target: float, measured: float
) -> float | None:
    """The scale of the verifies' extra cost at which the adaptive replay reaches `target`
    (1.0: it does at the measured costs, where it makes `measured`; None: not even free
    verifies would)."""
    if measured >= target:
        return 1.0
    if _engine_replay(answers, _scaled(costs, 0.0))["speedup"] < target:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(12):
        mid = (lo + hi) / 2
        if _engine_replay(answers, _scaled(costs, mid))["speedup"] >= target:
            lo = mid
        else:
            hi = mid
    return lo


def replay_model(answers: list, costs: CostModel, target: float) -> dict:
    defaults = EngineConfig()
    max_k, ngram_max = defaults.spec_max_draft_length, defaults.ngram_max
    adaptive = _engine_replay(answers, costs)
    fixed = {k: _engine_replay(answers, costs, k) for k in range(1, max_k + 1)}
    best_k = max(fixed, key=lambda k: fixed[k]["speedup"])
    return {
        "adaptive": adaptive,
        "fixed": {str(k): r for k, r in fixed.items()},
        "best_fixed": best_k,
        "hindsight": _hindsight(answers, costs, max_k, ngram_max),
        "target": target,
        "increment_scale": increment_scale(answers, costs, target, adaptive["speedup"]),
        # the sequences' lengths when the cost table was measured (the second: at batch 1)
        "cost_depths": [costs.depth, costs.deep_depth] if costs.deep else [costs.depth],
        "plain_step_s": costs.verify_cost(1, 1),
        "verify_steps_s": {str(n): costs.verify_cost(1, n) for n in range(2, max_k + 2)},
    }


def replay_report(raw: dict, target: float) -> dict:
    """{model: replay_model(...)} for every model whose adaptive ngram run measured its costs
    at warm-up and whose mlcrun plain run has answers."""
    kinds = [p["kind"] for p in raw["prompts"]]
    out = {}
    for v in raw["variants"]:
        if (v["engine"], v["mode"]) != ("mlcrun", "plain"):
            continue
        warm = raw.get("warmups", {}).get(f"mlcrun/{v['model']}/ngram") or {}
        samples = [s for s in v["samples"] if "error" not in s]
        if not warm.get("costs") or not samples:
            continue
        answers = [
            (p["ids"], r["tokens"])
            for p, r, kind in zip(raw["prompts"], samples[0]["prompts"], kinds)
            if kind == KIND
        ]
        out[v["model"]] = replay_model(answers, CostModel.from_dict(warm["costs"]), target)
    return out


def main() -> None:
    from speculative import NGRAM_TARGET

    raw_file = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_RAW
    report = replay_report(json.loads(raw_file.read_text()), NGRAM_TARGET)
    for model, r in report.items():
        fixed = r["fixed"][str(r["best_fixed"])]
        scale = r["increment_scale"]
        print(
            f"{model}: adaptive {r['adaptive']['speedup']:.2f}x "
            f"({r['adaptive']['tokens_per_forward']:.2f} tok/fwd), best fixed K={r['best_fixed']} "
            f"{fixed['speedup']:.2f}x, hindsight {r['hindsight']['speedup']:.2f}x "
            f"({r['hindsight']['tokens_per_forward']:.2f} tok/fwd); {r['target']}x at "
            + ("no verify cost" if scale is None else f"{scale:.2f} of the verifies' extra cost")
        )


if __name__ == "__main__":
    main()
