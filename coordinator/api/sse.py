"""Server-sent events in OpenAI's framing: `data: {json}\\n\\n` per chunk, then `data: [DONE]`.

A failure after the response has started cannot change its status any more: it becomes one
chunk `data: {"error": {...}}`, still followed by `[DONE]`, so clients see why it ended.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

from coordinator.api.errors import as_api_error
from coordinator.api.streams import closing

DONE = b"data: [DONE]\n\n"


def frame(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


class ErrorChunk(BaseModel):
    error: dict


async def frames(
    events: AsyncIterator[BaseModel], on_close: Callable[[], None]
) -> AsyncIterator[bytes]:
    try:
        async with closing(events):
            try:
                async for event in events:
                    yield frame(event)
            except Exception as err:
                yield frame(ErrorChunk(error=as_api_error(err).body()["error"]))
        yield DONE
    finally:
        on_close()


class EventStream(StreamingResponse):
    """A streaming response whose body is closed as soon as sending stops, for whatever
    reason; closing it aborts the requests behind it."""

    def __init__(self, events: AsyncIterator[BaseModel], on_close: Callable[[], None]) -> None:
        super().__init__(
            frames(events, on_close),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def stream_response(self, send: Send) -> None:
        # Starlette stops iterating when the client goes away but leaves the body open, and
        # an open async generator only runs its cleanup when garbage collected.
        async with closing(self.body_iterator):
            await super().stream_response(send)
