"""`mlcrun serve`: an OpenAI-compatible HTTP server over one shared engine.

protocol.py (pydantic request schema, the only pydantic in mlcrun), service.py (admission,
prompt checks, merged engine streams), responses.py (response bodies and SSE), grammar.py
(response_format via llguidance), metrics.py (Prometheus text), app.py (FastAPI routes and the
request guard), server.py (uvicorn with graceful shutdown).
"""

from __future__ import annotations

__all__ = ["ServeOptions", "create_app", "run_server"]


def __getattr__(name: str):
    # Lazy: `import mlcrun.serve` must not pull FastAPI (or TVM) in.
    if name == "ServeOptions":
        from .service import ServeOptions

        return ServeOptions
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "run_server":
        from .server import run_server

        return run_server
    raise AttributeError(name)
