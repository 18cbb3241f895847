"""Server-sent events in OpenAI's framing: `data: {json}\\n\\n` per chunk, then `data: [DONE]`.

A failure after the response has started cannot change its status any more: it becomes one
chunk `data: {"error": {...}}`, still followed by `[DONE]`, so clients see why it ended.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from coordinator.api.errors import as_api_error
from coordinator.api.streams import closing

DONE = b"data: [DONE]\n\n"
# The scope key under which the app (coordinator/api/app.py) hands down the server's own `send`.
SERVER_SEND = "tandem.server_send"


def frame(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


# A JSON string as pydantic writes one: UTF-8 as is, the short escapes for \b \f \n \r \t,
# \u00XX for the other control characters (tests/coordinator/api/test_sse_frames.py checks
# every character class).
_json_string = json.JSONEncoder(ensure_ascii=False).encode
_MARKER = "tandem-text-goes-here"


class TextFrames:
    """The frames of a stream's plain text chunks (no logprobs, not the last), built fast.

    `template(index, text)` is choice `index`'s chunk; pydantic renders it once per choice with
    a marker as its text, and each chunk then costs one JSON string encoding instead of a model
    build and dump (0.2 us against 4.5, at one chunk per token per stream). The result is byte
    for byte the model's own frame."""

    def __init__(self, template: Callable[[int, str], BaseModel]) -> None:
        self._template = template
        self._parts: dict[int, tuple[bytes, bytes]] = {}  # choice -> bytes around the text

    def frame(self, index: int, text: str) -> bytes:
        parts = self._parts.get(index) or self._split(index)
        try:
            return parts[0] + _json_string(text).encode() + parts[1]
        except UnicodeEncodeError:  # a lone surrogate: left to pydantic, as any other chunk
            return frame(self._template(index, text))

    def _split(self, index: int) -> tuple[bytes, bytes]:
        rendered = frame(self._template(index, _MARKER))
        head, marker, tail = rendered.partition(_json_string(_MARKER).encode())
        if not marker or _MARKER.encode() in tail:
            raise ValueError("the template must hold the text exactly once")
        self._parts[index] = (head, tail)
        return head, tail


class ErrorChunk(BaseModel):
    error: dict


async def frames(
    events: AsyncIterator[BaseModel | bytes], on_close: Callable[[], None]
) -> AsyncIterator[bytes]:
    """`events` are chunk models, or frames already built (TextFrames)."""
    try:
        async with closing(events):
            try:
                async for event in events:
                    yield event if isinstance(event, bytes) else frame(event)
            except Exception as err:
                yield frame(ErrorChunk(error=as_api_error(err).body()["error"]))
        yield DONE
    finally:
        on_close()


class EventStream(StreamingResponse):
    """A streaming response whose body is closed as soon as sending stops, for whatever
    reason; closing it aborts the requests behind it."""

    def __init__(
        self, events: AsyncIterator[BaseModel | bytes], on_close: Callable[[], None]
    ) -> None:
        super().__init__(
            frames(events, on_close),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close
        self._server_send: Send | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # `frames` calls on_close once started; a client that leaves while the response's
        # start is being sent cancels it before the body is ever read, and an async generator
        # closed before its first step runs none of its code: the callback (which is
        # idempotent) must run here too, or the admission ticket is never given back.
        self._server_send = scope.get(SERVER_SEND)
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    async def stream_response(self, send: Send) -> None:
        # The start goes through the middlewares (CORS headers; the error handlers' record that
        # a response began); the body, a message per token per stream, goes to the server
        # directly when the app handed its `send` down (SERVER_SEND): none of the middlewares
        # looks at a body, and passing each chunk through their wrappers cost ~10% of the
        # serving process per token (benchmarks/api_overhead.py).
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        body = self._server_send or send
        # Starlette stops iterating when the client goes away but leaves the body open, and
        # an open async generator only runs its cleanup when garbage collected.
        async with closing(self.body_iterator):
            async for chunk in self.body_iterator:
                await body({"type": "http.response.body", "body": chunk, "more_body": True})
        await body({"type": "http.response.body", "body": b"", "more_body": False})
