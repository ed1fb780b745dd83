"""`mlcrun serve` as a real process on a free loopback port, for the server tests."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

MODEL = "tiny"
READY = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


# Generous bounds for waits on a real condition: they only matter when something is broken,
# and then the test fails saying what it waited for. A loaded 2-core CI machine must never
# reach them.
READY_TIMEOUT = 600
WAIT_TIMEOUT = 300
POLL = 0.05


class ServerProcess:
    def __init__(self, folder: Path, log: Path, *args: str) -> None:
        self.log_path = log
        self._log = open(log, "w")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlcrun", "serve", str(folder), "--port", "0", *args],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            env={**os.environ, "TVM_NUM_THREADS": "1"},
        )
        self.port = self._wait_ready(timeout=READY_TIMEOUT)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> int:
        """The port from the server's "listening on" line (it only binds once it can serve)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = READY.search(self.log_path.read_text())
            if match:
                return int(match.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            time.sleep(POLL)
        self.proc.kill()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        """Prometheus samples: 'name{labels}' -> value."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=WAIT_TIMEOUT).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def wait_for(
        self,
        condition: Callable[[dict[str, float]], bool],
        what: str,
        timeout: float = WAIT_TIMEOUT,
    ) -> dict[str, float]:
        """Metrics once `condition(metrics)` holds; fails the test, showing the last metrics
        and the server's log, if it does not within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if condition(m):
                return m
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited waiting for {what}:\n{self.log()}")
            if time.monotonic() > deadline:
                shown = "\n".join(f"  {k} {v:g}" for k, v in sorted(m.items()))
                raise AssertionError(
                    f"waited {timeout}s for {what}; last metrics:\n{shown}\n"
                    f"server log (end):\n{self.log()[-4000:]}"
                )
            time.sleep(POLL)

    def wait_idle(self, timeout: float = WAIT_TIMEOUT) -> dict[str, float]:
        """Metrics once nothing is running, waiting or in flight (fails the test otherwise)."""
        return self.wait_for(
            lambda m: (
                m["mlcrun_num_requests_running"] == 0
                and m["mlcrun_num_requests_waiting"] == 0
                and m["mlcrun_requests_in_flight"] == 0
            ),
            "the server to be idle (nothing running, waiting or in flight)",
            timeout,
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = WAIT_TIMEOUT) -> int:
        """Signal the server and return its exit code; killed (-9) if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(artifacts, tmp_path_factory):
    """The shared server: 16 sequences per batch, prefix cache on."""
    folder = artifacts("llama")
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = ServerProcess(folder, log, "--served-model-name", MODEL, "--max-num-seqs", "16")
    yield proc
    code = proc.stop()
    assert code == 0, f"the server exited with {code}:\n{proc.log()}"
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="session")
def client(server):
    import openai

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def arun(server):
    """arun(f) runs `async def f(aclient)` with an AsyncOpenAI client on a fresh event loop."""
    import openai

    def run(fn, **client_args):
        async def main():
            args = {"api_key": "unused", "max_retries": 0, **client_args}
            async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", **args) as c:
                return await fn(c)

        return asyncio.run(main())

    return run
