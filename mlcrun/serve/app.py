"""The FastAPI application: OpenAI routes, errors in OpenAI's shape, and the request guard (API
key, body size limit, one access-log line per request).

Errors: 400 invalid values (also for schema errors, which FastAPI would answer with 422), 401
missing or wrong key, 404 unknown model or route, 413 oversized body, 429 queue full, 503
shutting down; a 500 only for a bug.

Tokenizing and chat-template rendering run in worker threads: a prompt of megabytes takes
seconds, and on the event loop it would stall every stream and /health meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from ..errors import MlcrunError
from ..tokenizer import Tokenizer
from .metrics import CONTENT_TYPE
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_value,
    error_body,
    plain_messages,
)
from .responses import ChatCall, CompletionCall
from .service import Prompt, Service

access_log = logging.getLogger("mlcrun.serve.access")
log = logging.getLogger(__name__)


def plain_access_log() -> None:
    """One plain line per request on stderr (not through the process's root handlers: rich
    would wrap it, Ray would turn it into JSON)."""
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    access_log.handlers[:] = [handler]
    access_log.setLevel(logging.INFO)
    access_log.propagate = False


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="mlcrun", version="1", docs_url=None, redoc_url=None)
    app.state.service = service
    _errors(app)
    _routes(app, service)
    app.add_middleware(RequestGuard, service=service)
    return app


def _json_error(status: int, message: str, type: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(MlcrunError)
    async def mlcrun_error(_: Request, err: MlcrunError):
        return await api_error(_, bad_value(err))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError):
        first: dict[str, Any] = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = str(first.get("msg", "invalid request"))
        return _json_error(400, f"{param}: {message}" if param else message, _INVALID, param)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException):
        kind = _INVALID if err.status_code < 500 else "server_error"
        return _json_error(err.status_code, str(err.detail), kind)

    @app.exception_handler(Exception)
    async def bug(_: Request, err: Exception):
        log.exception("internal error")
        return _json_error(500, f"internal error: {type(err).__name__}", "server_error")


_INVALID = "invalid_request_error"


def _routes(app: FastAPI, svc: Service) -> None:
    @app.get("/health")
    async def health():
        if svc.draining:
            return _json_error(503, "shutting down", "server_error", code="draining")
        if not svc.engine.healthy:
            message = f"the model engine stopped: {svc.engine.error}"
            return _json_error(503, message, "server_error", code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(svc.metrics.render(svc.engine.stats()), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(svc)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        svc.check_model(model)
        return _model_card(svc)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _accept(svc, body)
        body.check()
        prompts = await asyncio.to_thread(svc.encode, body.prompt)
        max_tokens = svc.max_tokens(prompts, body.max_tokens, svc.options.default_max_tokens)
        params = body.sampling_params(max_tokens, body.logprobs, svc.info.generation_defaults)
        return await _run(request, svc, CompletionCall, body, prompts, params)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _accept(svc, body)
        body.check()
        prompts = [await asyncio.to_thread(_chat_prompt, svc, body)]
        asked, field = body.asked_max_tokens
        max_tokens = svc.max_tokens(prompts, asked, None, param=field)
        params = body.sampling_params(
            max_tokens, body.engine_logprobs, svc.info.generation_defaults
        )
        return await _run(request, svc, ChatCall, body, prompts, params)

    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest):
        _accept(svc, body)
        tok = svc.need_tokenizer("tokenize")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        ids = await asyncio.to_thread(_tokenize, tok, body)
        return {"tokens": ids, "count": len(ids), "max_model_len": svc.context_window}

    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _accept(svc, body)
        tok = svc.need_tokenizer("detokenize")
        if body.tokens:
            svc.check_ids(body.tokens, "tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Drop the finished sequences kept for prefix reuse (frees their KV pages)."""
        svc.check_alive()
        return {"dropped": await svc.engine.reset_prefix_cache()}


def _model_card(svc: Service) -> dict[str, Any]:
    return {
        "id": svc.options.model_name,
        "object": "model",
        "created": svc.created,
        "owned_by": "mlcrun",
        "max_model_len": svc.context_window,
    }


def _accept(svc: Service, body) -> None:
    """The first checks of every body: text that is not valid Unicode (which would break even
    the error answer that names it), then the model."""
    body.check_text()
    svc.check_model(body.model)


def _chat_prompt(svc: Service, body: ChatCompletionRequest) -> Prompt:
    """Runs in a worker thread."""
    tok = svc.need_tokenizer("chat")
    text = _render_chat(
        tok,
        body.plain_messages(),
        add_generation_prompt=True,
        tools=body.tools or None,
        template_kwargs=body.chat_template_kwargs,
    )
    return Prompt(tok.encode(text, add_special_tokens=False), None)


def _tokenize(tok: Tokenizer, body: TokenizeRequest) -> list[int]:
    """Runs in a worker thread."""
    if body.messages is None:
        return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    text = _render_chat(tok, plain_messages(body.messages), body.add_generation_prompt)
    return tok.encode(text, add_special_tokens=False)  # the template has the special tokens


def _render_chat(
    tok: Tokenizer,
    messages: list[dict],
    add_generation_prompt: bool,
    tools: list | None = None,
    template_kwargs: dict | None = None,
) -> str:
    try:
        return tok.apply_chat_template(
            messages, add_generation_prompt, tokenize=False, tools=tools, **(template_kwargs or {})
        )
    except MlcrunError as err:  # the model's template refused or failed on these messages
        raise APIError(400, f"messages: {err}", param="messages") from None


async def _run(request: Request, svc: Service, call_cls, body, prompts, params):
    svc.check_params(params)
    constraint = None
    if body.response_format is not None:
        constraint = await asyncio.to_thread(svc.grammars.constraint, body.response_format)
    tools = getattr(body, "tool_request", None)
    if tools is not None and tools.constrained:
        if constraint is not None:
            raise APIError(
                400, "response_format cannot be combined with a forced tool", param="tool_choice"
            )
        constraint = await asyncio.to_thread(
            svc.grammars.schema_constraint, tools.schema(), "tool_choice"
        )
    ticket = svc.admit(len(prompts), params.n)
    call = call_cls(svc, body, prompts, params, constraint, ticket, request.state)
    if body.stream:
        return StreamingResponse(
            call.stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(ticket.release),  # in case the stream never started
        )
    try:
        return JSONResponse(await _unless_disconnected(request, call.collect()))
    except _ClientGone:
        request.state.summary = "client disconnected: aborted"
        return Response(status_code=499)
    finally:
        ticket.release()


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelling it (which aborts its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # let it abort its requests
    raise _ClientGone


class RequestGuard:
    """Pure ASGI middleware: API key (on /v1 and admin routes), body size, access log."""

    def __init__(self, app, service: Service) -> None:
        self.app, self.svc = app, service
        key = service.options.api_key
        self.key = key.encode() if key else None
        self.max_bytes = service.options.max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]
        path, method = scope["path"], scope["method"]
        state = scope.setdefault("state", {})

        async def send_logged(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self.refuse(scope)
            if refusal is not None:
                await refusal(scope, receive, send_logged)
            else:
                await self.app(scope, self.limited(receive), send_logged)
        except Exception:
            status[0] = status[0] or 500  # answered by Starlette's error middleware
            raise
        finally:
            ms = (time.perf_counter() - start) * 1000
            self.svc.metrics.count_request(method, _route(path), status[0])
            client = scope.get("client") or ("-", 0)
            extra = state.get("summary", "")
            access_log.info(
                '%s:%s "%s %s" %d %.1fms %s',
                client[0],
                client[1],
                method,
                path,
                status[0],
                ms,
                extra,
            )

    def refuse(self, scope) -> JSONResponse | None:
        headers = dict(scope["headers"])
        protected = scope["path"].startswith("/v1") or scope["path"] == "/reset_prefix_cache"
        if self.key and protected and not self.authorized(headers.get(b"authorization", b"")):
            return _json_error(401, "Invalid or missing API key", _INVALID, code="invalid_api_key")
        length = headers.get(b"content-length", b"0")
        # (a length of 19+ digits is too large anyway, and int() refuses over 4300 digits)
        if length.isdigit() and (len(length) > 18 or int(length) > self.max_bytes):
            return self.too_large()
        return None

    def authorized(self, header: bytes) -> bool:
        # RFC 7235: the scheme is case-insensitive ("bearer KEY" is as good as "Bearer KEY")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def too_large(self) -> JSONResponse:
        limit = self.max_bytes
        return _json_error(
            413, f"Request body over the limit of {limit} bytes", _INVALID, code="too_large"
        )

    def limited(self, receive):
        limit, seen = self.max_bytes, [0]

        async def wrapped():
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > limit:
                    raise HTTPException(413, f"Request body over the limit of {limit} bytes")
            return message

        return wrapped


def _route(path: str) -> str:
    """A bounded label for metrics: known routes as is, anything else as "other"."""
    if path in _KNOWN:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


_KNOWN = frozenset(
    ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
    + ("/v1/tokenize", "/v1/detokenize", "/reset_prefix_cache")
)
