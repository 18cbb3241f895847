"""The FastAPI app: OpenAI-compatible generation routes plus models, tokenizer, health, readiness
and metrics. `create_app(client, settings)` is all a server (or a test) needs.

    GET  /health                 liveness: the process answers (no key needed)
    GET  /ready                  readiness: a one-token generation succeeds (no key needed)
    GET  /metrics                Prometheus text (no key needed)
    GET  /v1/models              the served model
    GET  /v1/models/{id}         the same, by its name (404 for any other)
    POST /v1/completions         see completions.py
    POST /v1/chat/completions    see chat.py
    POST /tokenize, /detokenize  the served model's tokenizer
    /admin/...                   the pools (see admin.py)
"""

from __future__ import annotations

import importlib.metadata
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from coordinator.api import admin, chat, completions
from coordinator.api.client import EngineClient
from coordinator.api.context import ServerContext, ServerSettings, context_of
from coordinator.api.errors import ApiError, install_error_handlers, invalid
from coordinator.api.prompts import chat_prompt
from coordinator.api.protocol import DetokenizeRequest, TokenizeRequest
from coordinator.api.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from coordinator.api.sse import SERVER_SEND

# Probes and scrapers carry no key (/ping and /version: vLLM's, which load balancers call).
OPEN_PATHS = frozenset({"/health", "/ping", "/ready", "/metrics", "/version"})

router = APIRouter()


def create_app(client: EngineClient, settings: ServerSettings | None = None) -> FastAPI:
    """The app serving `client`. Its lifespan waits for `client.ready()` before taking requests
    and calls `client.shutdown()` when the server stops."""
    ctx = ServerContext(client, settings or ServerSettings())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.ready()
        yield
        await client.shutdown()

    app = App(title="tandem", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tandem = ctx
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(admin.router)
    app.add_middleware(BodyLimit, max_bytes=ctx.settings.max_body_bytes)
    if ctx.settings.api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=ctx.settings.api_key)
    if ctx.settings.allowed_origins:
        # Outermost (added last): a browser's preflight OPTIONS carries no API key.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(ctx.settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app


class App(FastAPI):
    """FastAPI, handing the server's own `send` down in the scope: event streams send their
    body chunks with it, past the middlewares (coordinator/api/sse.py, SERVER_SEND)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


class BodyLimit:
    """Answers 413 for a request body over `max_bytes`, by its Content-Length or, for a chunked
    body, as soon as the bytes read pass the limit (nothing larger is ever buffered)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # an HTTPException passes FastAPI's body reader as is
                raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> ApiError:
        return ApiError(
            413, f"the request body is larger than {self.max_bytes} bytes", code="body_too_large"
        )


class ApiKeyCheck:
    """Refuses requests without `Authorization: Bearer <key>` before anything reads their body,
    so a caller without the key learns nothing else (not even that its JSON is malformed)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            # The scheme is case-insensitive (RFC 9110): "bearer KEY" is as good as "Bearer KEY".
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            valid = scheme.lower() == b"bearer" and secrets.compare_digest(given, self.expected)
            if not valid:
                error = ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that read no body
@router.api_route("/ping", methods=["GET", "POST"])
async def health() -> dict:
    return {"status": "ok"}


@router.get("/version")
async def version() -> dict:
    try:
        return {"version": importlib.metadata.version("tandem")}
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return {"version": "unknown"}


@router.api_route("/ready", methods=["GET", "HEAD"])
async def ready(request: Request) -> dict:
    """Reads the backend's state (its supervisor keeps it current); starts nothing, so a probe
    every second costs nothing."""
    ctx = context_of(request)
    if ctx.admission.draining:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    problem = ctx.client.readiness()
    if problem is not None:
        raise ApiError(503, f"not ready: {problem}", code="not_ready")
    return {"status": "ready"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(context_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    return JSONResponse(ModelList(data=[_card(context_of(request))]).model_dump())


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> JSONResponse:
    ctx = context_of(request)
    ctx.check_model(model_id)
    return JSONResponse(_card(ctx).model_dump())


def _card(ctx: ServerContext) -> ModelCard:
    return ModelCard(
        id=ctx.client.model_name, created=ctx.created, max_model_len=ctx.client.max_model_len
    )


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    ctx = context_of(request)
    ctx.check_model(body.model)
    tokenizer = ctx.client.tokenizer
    if body.prompt is not None:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        tokens = chat_prompt(tokenizer, body.messages or [], **body.template_options())
    response = TokenizeResponse(
        tokens=tokens, count=len(tokens), max_model_len=ctx.client.max_model_len
    )
    return JSONResponse(response.model_dump())


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    ctx = context_of(request)
    ctx.check_model(body.model)
    vocab = len(ctx.client.tokenizer.hf)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise invalid(f"token ids must be in [0, {vocab})", param="tokens")
    text = ctx.client.tokenizer.decode(body.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
