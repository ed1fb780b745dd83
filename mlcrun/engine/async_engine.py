"""AsyncEngine: many asyncio callers share one Engine stepped by a background thread.

engine = AsyncEngine(llm)            # or AsyncEngine.from_engine(Engine(...), encode=...)
async for out in engine.generate(prompt_ids, params, request_id):
    print(out.delta_text, end="")
await engine.abort(request_id)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from ..errors import MlcrunError
from .engine import Engine, EngineStats
from .request import RequestOutput, TokenConstraint
from .types import SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # guards the engine: add/abort vs step
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="mlcrun-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str,
        constraint: Callable[[], TokenConstraint] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced (all `n` choices interleaved)."""
        if self._stopped:
            raise MlcrunError("the engine is shut down")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, params, constraint)  # raises on bad input
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        remaining = params.n
        try:
            while remaining:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    remaining -= 1
                yield out
        finally:
            if remaining:  # the caller went away: free the request's KV pages
                await self.abort(request_id)
            with self._lock:
                self._queues.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            outputs = self.engine.abort(request_id)
        for out in outputs:
            self._deliver(out)

    async def abort_all(self) -> None:
        """Abort every request in flight; the engine keeps serving new ones."""
        with self._lock:
            outputs = [out for rid in list(self.engine.requests) for out in self.engine.abort(rid)]
        for out in outputs:
            self._deliver(out)

    def reset_prefix_cache(self) -> int:
        with self._lock:
            return self.engine.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """A snapshot, safe to read while the engine keeps stepping."""
        with self._lock:
            s = self.engine.stats
            return replace(s, step_sizes=dict(s.step_sizes))

    def shutdown(self) -> None:
        """Abort what is in flight and stop the thread."""
        with self._lock:
            for rid in list(self.engine.requests):
                for out in self.engine.abort(rid):
                    self._deliver(out)
            self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                if self._stopped:
                    return
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except BaseException as err:  # keep serving: fail the requests in flight
                    outputs = []
                    self._fail_all(err)
            for out in outputs:
                self._deliver(out)

    def _fail_all(self, err: BaseException) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            entry = self._queues.get(rid)
            if entry:
                entry[0].call_soon_threadsafe(entry[1].put_nowait, err)

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._queues.get(out.request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, out)
