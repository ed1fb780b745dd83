"""Running the app under uvicorn, with a graceful shutdown.

On SIGINT/SIGTERM the server first drains: new requests get 503, requests in flight get
`shutdown_timeout` seconds to finish and are then aborted (their streams still end properly
with a finish_reason and `data: [DONE]`); only then does uvicorn close its sockets and exit.
A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import uvicorn

from .app import create_app
from .service import ServeOptions, Service

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service, on_ready) -> None:
        super().__init__(config)
        self.service, self.on_ready = service, on_ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_ready(host, port)

    def handle_exit(self, sig: int, frame) -> None:
        # Not uvicorn's: that one re-raises the signal after shutdown (a non-zero exit).
        if self._drain_started and sig == signal.SIGINT:
            self.force_exit = True
            self.should_exit = True
            return
        if self._drain_started:
            return
        self._drain_started = True
        log.warning("shutting down: draining requests in flight")
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.service.drain()
        finally:
            self.should_exit = True


def run_server(
    llm,
    options: ServeOptions,
    host: str = "127.0.0.1",
    port: int = 8000,
    on_ready: Callable[[str, int], None] | None = None,
) -> None:
    """Serve `llm` until SIGINT/SIGTERM; returns after a clean shutdown."""
    service = Service.local(llm, options)
    config = uvicorn.Config(
        create_app(service),
        host=host,
        port=port,
        log_config=None,  # the CLI's logging
        access_log=False,  # the app logs one line per request itself
        timeout_graceful_shutdown=options.shutdown_timeout + 5,
        timeout_keep_alive=5,
        # uvicorn's pure-Python parser and asyncio's loop, whatever else is installed (Ray
        # Serve brings httptools, which answers unknown methods itself with a 400 the app
        # never counts, and uvloop)
        http="h11",
        loop="asyncio",
    )
    try:
        _Server(config, service, on_ready).run()
    finally:
        service.engine.shutdown()
