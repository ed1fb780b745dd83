"""`mlcrun serve --replicas N [--ray-address ADDR]`: start or join a Ray cluster, deploy the
app, serve until SIGINT/SIGTERM, then drain and leave.

Local (no address): a fresh single-machine cluster inside the command (`ray start --head`
semantics), shut down on exit. With an address: the app joins that cluster, and on exit only
the app is deleted (the cluster and any other Serve apps stay).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from ...engine.config import EngineConfig
from ..service import ServeOptions
from . import APP_NAME, LOGGING, ReplicaOptions, deployment, require_ray

log = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 256 * 2**20  # the replicas exchange small messages, never tensors


def serve_replicas(
    folder: Path,
    engine_config: EngineConfig,
    options: ServeOptions,
    replicas: ReplicaOptions,
    host: str,
    port: int,
    ray_address: str | None = None,
    on_ready: Callable[[str, int], None] | None = None,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """`on_ready(host, port)` once the app serves; `on_stop()` when a signal arrives (the
    caller says so: Ray reformats this process's log records)."""
    serve = require_ray()
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reports to the internet
    if ray_address is None:
        # Logical CPUs: one per replica thread, plus one for Ray's own actors (the router's
        # prefix tree), which need a free CPU to be placed even though they use none after.
        cpus = replicas.replicas * (replicas.threads or 1) + 1
        ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES, logging_level=logging.WARNING)  # fmt: skip
    else:
        ray.init(address=ray_address, logging_level=logging.WARNING)
    try:
        port = port or _free_port(host)
        serve.start(http_options={"host": host, "port": port}, logging_config=LOGGING)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the driver's own lines
        app = deployment(
            folder,
            replicas=replicas.replicas,
            threads=replicas.threads,
            engine_config=engine_config,
            options=options,
            imbalanced_threshold=replicas.imbalanced_threshold,
        )
        ingress = serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        if on_ready is not None:
            on_ready(host, port)
        _wait_for_signal()
        if on_stop is not None:
            on_stop()
        try:
            ingress.drain.remote().result(timeout_s=options.shutdown_timeout + 30)
        except Exception as err:  # the ingress is gone: nothing left to drain
            log.warning("drain failed: %s", err)
    finally:
        if ray_address is None:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP_NAME)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM; a second one exits at once."""
    stop = threading.Event()

    def handler(sig, frame) -> None:
        if stop.is_set():
            os._exit(130 if sig == signal.SIGINT else 143)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not stop.wait(0.5):
        pass
