"""`mlcrun bench --mode serve-sim`: a serving workload against the in-process engine.

Requests enter the engine at their arrival times (at most `concurrency` at once) and are
generated greedily to exactly their output length (EOS ignored), so every run does the same
work. Timings come from the engine's own per-token clock (RequestMetrics), the numbers an
HTTP client would see minus the network and detokenization.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from ..engine.types import RequestOutput, SamplingParams
from ..llm import LLM
from .metrics import RequestRecord
from .workload import BenchRequest


def run_offline(
    llm: LLM,
    requests: list[BenchRequest],
    concurrency: int | None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float, dict]:
    """Run the workload; returns (records by index, wall seconds, engine counters)."""
    engine = llm.engine
    before = replace(engine.stats)
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    prompts = {r.index: _prompt_ids(llm, r) for r in requests}
    records: dict[int, RequestRecord] = {}
    limit = concurrency or len(requests)
    in_flight = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and in_flight < limit and pending[0].arrival <= now:
            req = pending.popleft()
            params = SamplingParams(max_tokens=req.output_len, temperature=0, ignore_eos=True)
            engine.add_request(f"bench-{req.index}", prompts[req.index], params)
            in_flight += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(pending[0].arrival - now, 0.05)))
            continue
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                record = _record(out)
                records[record.index] = record
                if on_done:
                    on_done(record)
    duration = time.perf_counter() - start
    return [records[i] for i in sorted(records)], duration, _counters(before, engine.stats)


def _counters(before, after) -> dict:
    """The engine's counters over the run; speculation's when it drafted."""
    out = {"preemptions": after.preemptions - before.preemptions}
    steps = after.spec_steps - before.spec_steps
    if steps:
        drafted = after.spec_drafted - before.spec_drafted
        accepted = after.spec_accepted - before.spec_accepted
        out.update(
            draft_tokens=drafted,
            accepted_tokens=accepted,
            acceptance_rate=accepted / drafted if drafted else None,
            mean_accepted_length=(accepted + steps) / steps,
            draft_s=after.draft_seconds - before.draft_seconds,
            verify_s=after.verify_seconds - before.verify_seconds,
        )
    return out


def _prompt_ids(llm: LLM, req: BenchRequest) -> list[int]:
    if isinstance(req.prompt, str):
        return llm.tokenizer.encode(req.prompt)
    return list(req.prompt)


def _record(out: RequestOutput) -> RequestRecord:
    m = out.metrics
    index = int(out.request_id.removeprefix("bench-"))
    times = list(m.token_times) if m else []
    # A client sees one chunk per step: the tokens one step accepted arrive together.
    chunks = [t for i, t in enumerate(times) if i == 0 or t != times[i - 1]]
    return RequestRecord(
        index=index,
        prompt_len=len(out.prompt_token_ids),
        start=m.arrival if m else 0.0,
        chunk_times=chunks,
        output_len=len(out.token_ids),
        end=times[-1] if times else None,
        cached_tokens=m.cached_tokens if m else 0,
        error=None if out.finish_reason in ("length", "stop") else f"finished: {out.finish_reason}",
    )
