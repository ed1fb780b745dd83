"""`mlcrun serve [MODEL]`: an OpenAI-compatible server (see docs/serve.md)."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from ..errors import MlcrunError
from .common import (
    DRAFT_MODEL,
    DRAFT_QUANTIZATION,
    MODEL_ARGUMENT,
    NGRAM_MAX,
    REVISION,
    SPEC_DRAFT_LENGTH,
    SPEC_MODE,
    SPEC_TREE_WIDTH,
    err_console,
    handle_errors,
    resolve_model,
    setup_logging,
    speculation_options,
)

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)i?[bB]?\s*$")


def parse_kv_memory(text: str | None) -> float | None:
    """ "0.25" (a fraction of RAM), "2G", "512MiB", or a plain number of bytes."""
    if text is None:
        return None
    match = _SIZE.match(text)
    if not match:
        raise MlcrunError(f"--kv-memory: expected e.g. 0.25, 512M or 2G, got {text!r}")
    value, unit = float(match.group(1)), match.group(2).upper()
    value *= 1024 ** " KMGT".index(unit or " ")
    if value <= 0:
        raise MlcrunError(f"--kv-memory must be positive, got {text!r}")
    return value


@handle_errors
def serve_command(
    model: str = MODEL_ARGUMENT,
    revision: str = REVISION,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback default)."),
    port: int = typer.Option(8000, "--port", help="Port (0: any free port)."),
    api_key: str = typer.Option(
        None, "--api-key", envvar="MLCRUN_API_KEY", help="Require `Authorization: Bearer KEY`."
    ),
    served_model_name: str = typer.Option(
        None, "--served-model-name", help="The model id clients use (default: from MODEL)."
    ),
    mode: str = typer.Option("server", "--mode", help="Engine preset: server, local, interactive."),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs", help="Sequences run together."),
    kv_memory: str = typer.Option(
        None, "--kv-memory", help="KV cache budget: bytes (2G, 512M) or a fraction of RAM (0.25)."
    ),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache"),
    max_queue: int = typer.Option(
        256, "--max-queue", help="Sequences queued beyond the batch before 429."
    ),
    max_request_bytes: int = typer.Option(
        4 * 2**20, "--max-request-bytes", help="Larger request bodies get 413."
    ),
    shutdown_timeout: float = typer.Option(
        10.0, "--shutdown-timeout", help="Seconds requests in flight get to finish on SIGTERM."
    ),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    quantization: str = typer.Option(None, "--quantization", "-q", help="Preset when compiling."),
    threads: int = typer.Option(
        None, "--threads", help="CPU threads for the model (per replica with --replicas)."
    ),
    replicas: int = typer.Option(
        None,
        "--replicas",
        help="Run N engine replicas under Ray Serve (needs mlcrun[ray]); default: one process.",
        min=1,
    ),
    ray_address: str = typer.Option(
        None, "--ray-address", help="Join this Ray cluster (default: start a local one)."
    ),
    speculative_mode: str = SPEC_MODE,
    spec_draft_length: int = SPEC_DRAFT_LENGTH,
    spec_tree_width: int = SPEC_TREE_WIDTH,
    draft_model: str = DRAFT_MODEL,
    ngram_max: int = NGRAM_MAX,
    draft_quantization: str = DRAFT_QUANTIZATION,
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Serve a model over the OpenAI API (completions, chat, streaming, structured output)."""
    setup_logging(verbose)
    from ..serve.app import plain_access_log

    plain_access_log()
    from ..default_model import DEFAULT_NAME
    from ..engine.config import EngineConfig

    if max_queue < 0 or max_request_bytes <= 0 or shutdown_timeout < 0:
        raise MlcrunError("--max-queue, --max-request-bytes and --shutdown-timeout: must be >= 0")
    on_ray = replicas is not None or ray_address is not None
    if on_ray:
        from ..serve.ray import require_ray

        require_ray()  # before a compile that may take minutes
    spec = speculation_options(
        speculative_mode,
        spec_draft_length,
        spec_tree_width,
        draft_model,
        ngram_max,
        draft_quantization,
        device,
    )
    config = EngineConfig(
        mode=mode,
        max_num_sequence=max_num_seqs,
        kv_memory=parse_kv_memory(kv_memory),
        prefix_cache=prefix_cache,
        **spec,
    )
    folder = resolve_model(model, revision, quantization=quantization, device=device)
    from ..serve.service import ServeOptions

    name = served_model_name or (DEFAULT_NAME if model is None else _name(model))
    options = ServeOptions(
        model_name=name,
        api_key=api_key,
        max_queue=max_queue,
        max_request_bytes=max_request_bytes,
        shutdown_timeout=shutdown_timeout,
    )

    def ready(bound_host: str, bound_port: int) -> None:
        err_console.print(
            f"mlcrun serve: listening on http://{bound_host}:{bound_port} (model {name!r})",
            highlight=False,
            soft_wrap=True,
        )

    if on_ray:
        replicas = replicas or 1
        _serve_replicas(folder, config, options, replicas, threads, host, port, ray_address, ready)
        return
    from ..llm import LLM
    from ..serve.server import run_server

    llm = LLM(folder, engine_config=config, num_threads=threads)
    run_server(llm, options, host=host, port=port, on_ready=ready)


def _serve_replicas(folder, config, options, replicas, threads, host, port, address, ready):
    import os

    from ..serve.ray import ReplicaOptions
    from ..serve.ray.cluster import serve_replicas

    threads = threads or max(1, (os.cpu_count() or 1) // replicas)  # the CPUs shared out
    err_console.print(
        f"mlcrun serve: starting {replicas} replica(s) of {threads} thread(s) on "
        f"{'Ray at ' + address if address else 'a local Ray cluster'}",
        highlight=False,
        soft_wrap=True,
    )
    serve_replicas(
        folder,
        config,
        options,
        ReplicaOptions(replicas=replicas, threads=threads),
        host,
        port,
        ray_address=address,
        on_ready=ready,
        on_stop=lambda: err_console.print("mlcrun serve: shutting down: draining requests"),
    )


def _name(model: str) -> str:
    path = Path(model).expanduser()
    return path.name if path.exists() else model
