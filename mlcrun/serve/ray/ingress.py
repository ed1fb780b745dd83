"""The Ray Serve ingress: the OpenAI app of `mlcrun serve`, over engine replicas.

The HTTP proxy hands the ingress raw requests; the ingress parses them, renders and tokenizes
prompts, checks them (the same routes and checks as the one-process server: `create_app` over
a `Service`), and calls the engine deployment through a DeploymentHandle with one
`EngineRequest` per prompt. The handle's request router (Ray's PrefixCacheAffinityRouter)
reads the request's `prompt`, so prompts that share a prefix go to the replica that served
it, unless the replicas' queues differ by more than a threshold.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ... import artifact
from ...engine.async_engine import EngineDeadError
from ...engine.engine import EngineStats
from ...engine.types import RequestOutput, SamplingParams
from ...errors import MlcrunError
from ...llm import artifact_tokenizer
from ..grammar import SchemaConstraints
from ..metrics import PREFIX
from ..protocol import APIError
from ..service import ModelInfo, ServeOptions, Service
from .protocol import EngineRequest, ReplicaLoad, route_key

log = logging.getLogger(__name__)


class Replicas:
    """The AsyncEngine interface `Service` uses, over the engine deployment's handle. Health is
    Ray's business (it restarts replicas), so this side is always healthy; a request whose
    replica dies fails alone with a 503."""

    healthy = True
    error = None

    def __init__(self, handle) -> None:
        self.handle = handle.options(stream=True)
        self.aborting = False  # abort_all() cancelled the streams (shutdown)
        self.loads: dict[str, ReplicaLoad] = {}  # replica -> its newest snapshot
        self._streams: set = set()

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str, constraint=None
    ) -> AsyncIterator[RequestOutput]:
        import ray.exceptions

        if constraint is not None and not isinstance(constraint, SchemaConstraints):
            raise MlcrunError("a constraint must be a JSON schema to reach a replica")
        schema = {} if constraint is None else {"schema": constraint.schema,
                                                 "schema_param": constraint.param}  # fmt: skip
        request = EngineRequest(route_key(prompt), list(prompt), params, request_id, **schema)
        # A fresh context makes the call a request of its own, not a child of the HTTP
        # request: Ray gives a request's children its id, and two streams of one id on one
        # replica never deliver (Ray 2.60; the prompts of one request would hang).
        stream = contextvars.Context().run(self.handle.generate.remote, request)
        self._streams.add(stream)
        replica = None
        try:
            async for out, load in stream:
                replica = load.replica
                self._record(load)
                out.prompt_token_ids = request.ids
                yield out
        except ray.exceptions.RayTaskError as err:  # raised by our code in the replica
            cause = err.cause
            if isinstance(cause, EngineDeadError):
                raise _replica_error(f"its engine stopped: {cause}") from None
            raise cause from None
        except ray.exceptions.RayError as err:  # the replica's process died, or Ray gave up
            if self.aborting:
                raise APIError(503, "The server is shutting down; the request was aborted",
                               type="server_error", code="draining") from None  # fmt: skip
            if replica is not None:
                self.loads.pop(replica, None)
            raise _replica_error(f"{type(err).__name__}: {str(err).splitlines()[0]}") from None
        finally:
            self._streams.discard(stream)
            stream.cancel()  # a no-op once it has ended; else the replica aborts the request

    def _record(self, load: ReplicaLoad) -> None:
        known = self.loads.get(load.replica)
        if known is None or known.seq < load.seq:
            self.loads[load.replica] = load

    def stats(self) -> EngineStats:
        """The replicas' engine stats added up (as of each one's newest snapshot)."""
        total = EngineStats()
        for load in self.loads.values():
            for key, value in vars(load.stats).items():
                if key == "step_sizes":
                    for size, steps in value.items():
                        total.step_sizes[size] = total.step_sizes.get(size, 0) + steps
                else:
                    setattr(total, key, getattr(total, key) + value)
        return total

    async def abort_all(self) -> None:
        self.aborting = True
        for stream in list(self._streams):
            stream.cancel()

    async def reset_prefix_cache(self) -> int:
        raise APIError(
            501,
            "reset_prefix_cache is not available with replicas (a request reaches one of them)",
            type="server_error",
            code="not_implemented",
        )

    def shutdown(self) -> None:
        pass


def _replica_error(why: str) -> APIError:
    return APIError(
        503,
        f"The replica serving this request stopped ({why}); retry the request",
        type="server_error",
        code="replica_died",
    )


class ReplicaMetrics:
    """/metrics' per-replica series (a prometheus collector): load and prefix-cache hits."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        loads = sorted(self.replicas.loads.values(), key=lambda load: load.replica)
        for kind, name, help, value in _REPLICA_SERIES:
            family = kind(f"{PREFIX}_replica_{name}", help, labels=["replica"])
            for load in loads:
                family.add_metric([load.replica], value(load))
            yield family
        info = GaugeMetricFamily(
            f"{PREFIX}_replica_info", "A replica's process (1 per replica).",
            labels=["replica", "pid"],
        )  # fmt: skip
        for load in loads:
            info.add_metric([load.replica, str(load.pid)], 1)
        yield info


_REPLICA_SERIES = (
    (GaugeMetricFamily, "requests_in_flight", "Engine requests the replica is serving.",
     lambda load: load.in_flight),
    (GaugeMetricFamily, "num_requests_running", "Sequences in the replica's running batch.",
     lambda load: load.stats.running),
    (CounterMetricFamily, "requests", "Engine requests the replica received.",
     lambda load: load.requests),
    (CounterMetricFamily, "prompt_tokens", "Prompt tokens of the replica's finished requests.",
     lambda load: load.prompt_tokens),
    (CounterMetricFamily, "prompt_tokens_cached", "Of those, tokens its prefix cache supplied.",
     lambda load: load.cached_tokens),
    (GaugeMetricFamily, "prefix_cache_hit_rate", "Cached / prompt tokens on the replica.",
     lambda load: load.hit_rate),
)  # fmt: skip


def ingress_class():
    """The ingress deployment's class (built here so that importing this module needs no
    Ray): the routes of `create_app` over a `Service` whose engine is the replicas."""
    from ray import serve

    from ..app import create_app, plain_access_log

    @serve.ingress()
    class Ingress:
        async def __init__(self, engine, folder: str, options: ServeOptions, replicas: int):
            plain_access_log()
            facts = await engine.facts.remote()
            facts["max_num_sequence"] *= replicas  # what the ingress admits before a 429
            tokenizer = artifact_tokenizer(folder, artifact.read(Path(folder)))
            self.replicas = Replicas(engine)
            self.service = Service(ModelInfo(tokenizer, **facts), self.replicas, options)
            self.service.metrics.registry.register(ReplicaMetrics(self.replicas))

        def __serve_build_asgi_app__(self):
            return create_app(self.service)

        async def drain(self) -> None:
            """Before shutdown: 503 for new requests, `shutdown_timeout` seconds for those in
            flight, then abort the rest (as the one-process server does on SIGTERM)."""
            await self.service.drain()

    return Ingress
