"""The engine replica: one LLM and its AsyncEngine in a Ray Serve replica (its own process).

The ingress calls `generate` through a DeploymentHandle (streaming); each output travels with
the replica's load snapshot, which is how the ingress learns per-replica load and prefix-cache
hit rates for /metrics without a side channel. Ray restarts a replica whose process dies or
whose `check_health` raises (the engine thread stopped).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator

from ...engine.async_engine import AsyncEngine
from ...engine.config import EngineConfig
from ...engine.types import RequestOutput
from ...llm import LLM
from ..grammar import Grammars
from ..service import model_facts
from .protocol import EngineRequest, ReplicaLoad

log = logging.getLogger(__name__)


class EngineReplica:
    def __init__(self, folder: str, engine_config: EngineConfig, threads: int | None) -> None:
        from ray import serve

        self.llm = LLM(folder, engine_config=engine_config, num_threads=threads)
        self.engine = AsyncEngine(self.llm.engine)
        self.grammars = Grammars(self.llm.tokenizer, self.llm.engine.runner.vocab_size,
                                 self.llm.eos_token_ids)  # fmt: skip
        threading.Thread(target=self.grammars.warm_up, name="mlcrun-grammar", daemon=True).start()
        self.name = serve.get_replica_context().replica_id.unique_id
        self.pid = os.getpid()
        self.seq = self.in_flight = self.requests = self.prompt_tokens = self.cached_tokens = 0

    def facts(self) -> dict:
        """ModelInfo's plain fields (the ingress loads the tokenizer itself)."""
        return model_facts(self.llm)

    def load(self) -> ReplicaLoad:
        self.seq += 1
        return ReplicaLoad(self.name, self.pid, self.seq, self.in_flight, self.requests,
                           self.prompt_tokens, self.cached_tokens, self.engine.stats())  # fmt: skip

    async def generate(
        self, req: EngineRequest
    ) -> AsyncIterator[tuple[RequestOutput, ReplicaLoad]]:
        """The request's outputs, each with this replica's load; leaving early (the ingress
        cancelled: its client went away) aborts the request."""
        constraint = None
        if req.schema is not None:  # compiled here: a matcher does not cross processes
            constraint = self.grammars.schema_constraint(req.schema, req.schema_param)
        self.in_flight += 1
        self.requests += 1
        open_choices = req.params.n
        try:
            async for out in self.engine.generate(req.ids, req.params, req.request_id, constraint):
                if out.finished:
                    open_choices -= 1
                    if out.index == 0:
                        self.prompt_tokens += len(req.ids)
                        self.cached_tokens += out.metrics.cached_tokens if out.metrics else 0
                    if not open_choices:  # the snapshot sent with the last output counts it done
                        self.in_flight -= 1
                out.prompt_token_ids = []  # the ingress has them: not sent with every token
                yield out, self.load()
        finally:
            if open_choices:
                self.in_flight -= 1

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine thread stopped is replaced."""
        if not self.engine.healthy:
            raise RuntimeError(f"the model engine stopped: {self.engine.error}")

    def __del__(self) -> None:  # Ray Serve calls it when it stops the replica
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
