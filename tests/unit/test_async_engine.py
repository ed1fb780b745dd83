"""AsyncEngine: callers never wait for a model step, and a dead engine thread fails every
caller instead of leaving it hanging."""

import asyncio
import threading

import pytest
from fake_runner import FakeRunner
from test_engine import alone, make_engine, prompt_of

from mlcrun.engine.async_engine import AsyncEngine, EngineDeadError
from mlcrun.engine.types import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0)


class GatedRunner(FakeRunner):
    """Its forwards wait for `gate` once `closed` is set: a step that takes as long as we say."""

    def __init__(self):
        super().__init__()
        self.gate, self.in_forward = threading.Event(), threading.Event()
        self.closed = False

    def batch_decode(self, embeddings, seq_ids):
        if self.closed:
            self.in_forward.set()
            assert self.gate.wait(60), "the test never opened the gate"
        return super().batch_decode(embeddings, seq_ids)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def test_add_abort_and_stats_do_not_wait_for_a_running_step():
    async def main():
        engine, runner = make_engine(runner=GatedRunner())
        async_engine = AsyncEngine(engine)
        try:
            # Closed before the request: its prefill passes, its first decode waits at the gate
            # (closing after the first output raced the engine, which could finish all 50).
            runner.closed = True
            slow = async_engine.generate(prompt_of(5, 1), SamplingParams(max_tokens=50), "slow")
            first = await slow.__anext__()  # prefilled; decoding from now on
            assert first.token_ids
            await asyncio.to_thread(runner.in_forward.wait, 60)
            # The engine thread is inside a forward and stays there until the gate opens.
            # Everything below must complete meanwhile (the gate is still closed after it).
            stats = async_engine.stats()
            assert stats.running == 1
            other = async_engine.generate(prompt_of(4, 2), PARAMS, "other")
            await async_engine.abort("slow")
            await async_engine.abort("unknown")
            assert not runner.gate.is_set()
            runner.gate.set()
            outs = [o async for o in other]
            rest = [o async for o in slow]
            return outs[-1], rest[-1]
        finally:
            runner.gate.set()
            async_engine.shutdown()

    other, slow = run(main())
    assert other.token_ids == alone(prompt_of(4, 2), PARAMS)
    assert slow.finish_reason == "abort"


class DyingScheduler:
    """Replaces the scheduler's decision with a bug: the engine thread dies."""

    def __call__(self):
        raise RuntimeError("scheduler bug")


def test_a_dead_engine_thread_fails_waiting_and_new_requests():
    async def main():
        engine, runner = make_engine(runner=GatedRunner())
        async_engine = AsyncEngine(engine)
        try:
            assert async_engine.healthy
            stream = async_engine.generate(prompt_of(5, 1), SamplingParams(max_tokens=50), "a")
            runner.closed = True  # the next decode waits at the gate
            await stream.__anext__()
            await asyncio.to_thread(runner.in_forward.wait, 60)
            engine.scheduler.schedule = DyingScheduler()  # the step after this one dies
            runner.gate.set()
            with pytest.raises(EngineDeadError, match="scheduler bug"):
                async for _ in stream:
                    pass
            assert not async_engine.healthy and "scheduler bug" in str(async_engine.error)
            with pytest.raises(EngineDeadError):
                async for _ in async_engine.generate(prompt_of(3, 2), PARAMS, "b"):
                    pass
            with pytest.raises(EngineDeadError):
                await async_engine.reset_prefix_cache()
        finally:
            async_engine.shutdown()

    run(main())


def test_bad_input_is_refused_before_it_reaches_the_engine_thread():
    async def main():
        engine, _ = make_engine(window=16)
        async_engine = AsyncEngine(engine)
        try:
            with pytest.raises(ValueError, match="context window"):
                async for _ in async_engine.generate(prompt_of(20, 1), PARAMS, "long"):
                    pass
            with pytest.raises(ValueError, match="stop_token_ids"):
                params = SamplingParams(stop_token_ids=[999])
                async for _ in async_engine.generate(prompt_of(3, 1), params, "vocab"):
                    pass
            outs = [o async for o in async_engine.generate(prompt_of(3, 1), PARAMS, "ok")]
            assert async_engine.healthy
            return outs[-1]
        finally:
            async_engine.shutdown()

    assert run(main()).token_ids == alone(prompt_of(3, 1), PARAMS)
