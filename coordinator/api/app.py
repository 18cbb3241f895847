"""The FastAPI app: OpenAI-compatible generation routes plus models, tokenizer, health, readiness
and metrics. `create_app(client, settings)` is all a server (or a test) needs.

    GET  /health                 liveness: the process answers (no key needed)
    GET  /ready                  readiness: a one-token generation succeeds (no key needed)
    GET  /metrics                Prometheus text (no key needed)
    GET  /v1/models              the served model
    POST /v1/completions         see completions.py
    POST /v1/chat/completions    see chat.py
    POST /tokenize, /detokenize  the served model's tokenizer
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from coordinator.api import chat, completions
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
from coordinator.api.streams import closing
from protocol.sampling import SamplingParams

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers carry no key

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

    app = FastAPI(title="tandem", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tandem = ctx
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(completions.router)
    app.include_router(chat.router)
    if ctx.settings.api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=ctx.settings.api_key)
    return app


class ApiKeyCheck:
    """Refuses requests without `Authorization: Bearer <key>` before anything reads their body,
    so a caller without the key learns nothing else (not even that its JSON is malformed)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> dict:
    ctx = context_of(request)
    if ctx.admission.draining:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    try:
        await asyncio.wait_for(_probe(ctx.client), ctx.settings.ready_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(503, "not ready: the probe generation timed out", code="not_ready") from None
    except Exception as err:
        raise ApiError(503, f"not ready: {err}", code="not_ready") from err
    return {"status": "ready"}


async def _probe(client: EngineClient) -> None:
    """One greedy token from a short prompt, outside admission and metrics."""
    await client.ready()
    prompt = client.tokenizer.encode("Hello")[-8:] or [0]
    params = SamplingParams(max_tokens=1, temperature=0)
    async with closing(client.generate(prompt, params, f"ready-{uuid.uuid4().hex}")) as stream:
        async for _ in stream:
            pass


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(context_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    ctx = context_of(request)
    card = ModelCard(
        id=ctx.client.model_name, created=ctx.created, max_model_len=ctx.client.max_model_len
    )
    return JSONResponse(ModelList(data=[card]).model_dump())


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    ctx = context_of(request)
    ctx.check_model(body.model)
    tokenizer = ctx.client.tokenizer
    if body.prompt is not None:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        tokens = chat_prompt(tokenizer, body.messages or [])
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
