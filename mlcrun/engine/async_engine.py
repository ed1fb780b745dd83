"""AsyncEngine: many asyncio callers share one Engine stepped by a background thread.

engine = AsyncEngine(llm.engine)
async for out in engine.generate(prompt_ids, params, request_id):
    print(out.delta_text, end="")
await engine.abort(request_id)

The event loop never waits for a model step. Callers do not touch the Engine: adding and
aborting requests are commands the engine thread applies between steps, and `stats()` reads
a snapshot the thread publishes after each step. Outputs come back through one asyncio queue
per request.

If the engine thread dies (a bug outside any single request or forward, which the Engine
isolates itself), every request in flight gets the error, new requests are refused, and
`error` says why, so that a server can report itself unhealthy instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future

from ..errors import MlcrunError
from .engine import Engine, EngineStats
from .types import RequestOutput, SamplingParams, TokenConstraint

log = logging.getLogger(__name__)


class EngineDeadError(MlcrunError):
    """The engine thread stopped: no request can be served any more."""


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _outputs and the dead flag, never held long
        self._outputs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None  # why the engine thread died
        self._stats = engine.stats.snapshot()
        self._thread = threading.Thread(target=self._loop, name="mlcrun-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    # ------------------------------------------------------------------ the caller's side
    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str,
        constraint: Callable[[], TokenConstraint] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced (all `n` choices interleaved)."""
        prompt = self.engine.check_request(prompt, params)  # bad input raises here
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._check_alive()
            if request_id in self._outputs:
                raise MlcrunError(f"request_id {request_id!r} is already in use")
            self._outputs[request_id] = (asyncio.get_running_loop(), outputs)
        self._send(("add", request_id, prompt, params, constraint))
        remaining = params.n
        try:
            while remaining:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    remaining -= 1
                yield out
        finally:
            with self._lock:
                self._outputs.pop(request_id, None)
            if remaining:  # the caller went away (or the engine failed): free its KV pages
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort"."""
        self._send(("abort", request_id))

    async def abort_all(self) -> None:
        """Abort every request in flight; the engine keeps serving new ones."""
        self._send(("abort_all",))

    async def reset_prefix_cache(self) -> int:
        future: Future = Future()
        with self._lock:  # a dead thread would never answer: refuse instead
            self._check_alive()
            self._send(("reset_prefix_cache", future))
        return await asyncio.wrap_future(future)

    def stats(self) -> EngineStats:
        """The counters as of the last step (a snapshot: no lock, never waits)."""
        return self._stats

    def shutdown(self) -> None:
        """Abort what is in flight and stop the thread."""
        self._send(("shutdown",))
        self._thread.join(timeout=10)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _check_alive(self) -> None:
        if self.error is not None or self._stopped:
            raise EngineDeadError(f"the engine is not running: {self.error or 'shut down'}")

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._apply_commands()
                if self._stopped:
                    break
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
                self._stats = self.engine.stats.snapshot()
        except BaseException as err:  # an engine bug: its state cannot be trusted any more
            log.exception("the engine thread died")
            self._die(err)
        else:
            self._die(EngineDeadError("the engine is shut down"), error=False)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            kind, *args = command
            if kind == "add":
                self._add(*args)
            elif kind == "abort":
                self._deliver(self.engine.abort(args[0]))
            elif kind == "abort_all":
                self._abort_all()
            elif kind == "reset_prefix_cache":
                args[0].set_result(self.engine.reset_prefix_cache())
            elif kind == "shutdown":
                self._abort_all()
                self._stopped = True
        self._stats = self.engine.stats.snapshot()

    def _add(self, request_id, prompt, params, constraint) -> None:
        with self._lock:
            gone = request_id not in self._outputs  # the caller left before it was added
        if gone:
            return
        try:
            self.engine.add_request(request_id, prompt, params, constraint)
        except Exception as err:  # e.g. the grammar factory failed: this request only
            self._send_to(request_id, err)

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            self._deliver(self.engine.abort(request_id))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._send_to(out.request_id, out)

    def _send_to(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._outputs.get(request_id)
        if entry is not None:
            loop, outputs = entry
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _die(self, err: BaseException, error: bool = True) -> None:
        """Refuse new requests, then fail every caller still waiting."""
        failure = (
            err
            if isinstance(err, MlcrunError)
            else EngineDeadError(f"the engine failed: {type(err).__name__}: {err}")
        )
        with self._lock:  # from here on callers are refused (they check under this lock)
            if error:
                self.error = err
            self._stopped = True
            waiting = list(self._outputs)
            commands = []
            while not self._commands.empty():
                commands.append(self._commands.get_nowait())
        for request_id in waiting:
            self._send_to(request_id, failure)
        for command in commands:  # never to run: answer the ones that wait for it
            if command[0] == "reset_prefix_cache":
                command[1].set_exception(failure)
