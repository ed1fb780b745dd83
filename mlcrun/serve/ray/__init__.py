"""mlcrun under Ray Serve: N engine replicas behind one OpenAI ingress, routed by prefix.

    from ray import serve
    from mlcrun.serve.ray import deployment

    serve.run(deployment("path/to/artifact", replicas=2, threads=1), route_prefix="/")

Two deployments: `Ingress` (the OpenAI routes of `mlcrun serve`: parsing, templates,
tokenizing, checks, metrics) and `Engine` (an LLM and its AsyncEngine per replica, one
process each, `threads` CPU threads each). The ingress calls the engine through a handle whose
request router is Ray's PrefixCacheAffinityRouter: prompts that share a token prefix go to the
replica that served it while the replicas' queue lengths differ by at most
`imbalanced_threshold`, else to the less loaded of two (power of two choices). Ray places the
replicas, checks their health and restarts them. `pip install 'mlcrun[ray]'` installs Ray
Serve; nothing here imports Ray until it is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...engine.config import EngineConfig
from ...errors import MlcrunError
from ..service import ServeOptions

# Ray's prefix-aware router. Its public alias (ray.serve.llm.request_router) imports Ray
# Serve LLM, which needs vLLM or SGLang; the class itself needs neither.
ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
    "PrefixCacheAffinityRouter"
)
APP_NAME = "mlcrun"
# Ray's per-request INFO lines would double the ingress's own access log (one line a request).
LOGGING = {"log_level": "WARNING", "enable_access_log": False}


def require_ray():
    """`ray.serve`, or a one-line error saying what to install."""
    try:
        from ray import serve
    except ImportError as err:
        raise MlcrunError(f"replicas need Ray Serve ({err}): pip install 'mlcrun[ray]'") from None
    return serve


@dataclass(frozen=True)
class ReplicaOptions:
    replicas: int = 2
    threads: int | None = None  # CPU threads per replica (None: the model's default)
    imbalanced_threshold: int = 8  # queue-length gap past which load beats prefix affinity
    max_ongoing_requests: int = 1024  # per deployment replica; the ingress admits first

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise MlcrunError(f"replicas must be >= 1, got {self.replicas}")
        if self.threads is not None and self.threads < 1:
            raise MlcrunError(f"threads must be >= 1, got {self.threads}")
        if self.imbalanced_threshold < 0:
            raise MlcrunError("imbalanced_threshold must be >= 0")


def deployment(
    folder: str | Path,
    *,
    replicas: int = 2,
    threads: int | None = None,
    engine_config: EngineConfig | None = None,
    options: ServeOptions | None = None,
    imbalanced_threshold: int = 8,
):
    """The Ray Serve application (for `serve.run`) serving the compiled artifact `folder`
    with `replicas` engine replicas. The folder must exist at the same path on every node
    that runs a replica (one machine, or a shared file system)."""
    folder = Path(folder).expanduser().resolve()
    if not (folder / "mlcrun-config.json").is_file():
        raise MlcrunError(f"{folder}: not a compiled mlcrun artifact (compile it first)")
    opts = ReplicaOptions(replicas, threads, imbalanced_threshold)
    options = options or ServeOptions(model_name=folder.name)
    serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    from .ingress import ingress_class
    from .replica import EngineReplica

    engine = serve.deployment(
        EngineReplica,
        name="Engine",
        num_replicas=opts.replicas,
        ray_actor_options={"num_cpus": opts.threads or 1},
        max_ongoing_requests=opts.max_ongoing_requests,
        health_check_period_s=2,
        logging_config=LOGGING,
        graceful_shutdown_timeout_s=options.shutdown_timeout,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER,
            request_router_kwargs={"imbalanced_threshold": opts.imbalanced_threshold},
        ),
    )
    ingress = serve.deployment(
        ingress_class(),
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=opts.max_ongoing_requests,
        graceful_shutdown_timeout_s=options.shutdown_timeout + 5,
        logging_config=LOGGING,
    )
    engine_config = engine_config or EngineConfig()
    return ingress.bind(
        engine.bind(str(folder), engine_config, opts.threads), str(folder), options, opts.replicas
    )
