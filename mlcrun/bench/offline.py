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
    before = engine.stats.preemptions
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
    counters = {"preemptions": engine.stats.preemptions - before}
    return [records[i] for i in sorted(records)], duration, counters


def _prompt_ids(llm: LLM, req: BenchRequest) -> list[int]:
    if isinstance(req.prompt, str):
        return llm.tokenizer.encode(req.prompt)
    return list(req.prompt)


def _record(out: RequestOutput) -> RequestRecord:
    m = out.metrics
    index = int(out.request_id.removeprefix("bench-"))
    times = list(m.token_times) if m else []
    return RequestRecord(
        index=index,
        prompt_len=len(out.prompt_token_ids),
        start=m.arrival if m else 0.0,
        chunk_times=times,
        output_len=len(out.token_ids),
        end=times[-1] if times else None,
        cached_tokens=m.cached_tokens if m else 0,
        error=None if out.finish_reason in ("length", "stop") else f"finished: {out.finish_reason}",
    )
