"""An SSE response runs its close callback (the admission ticket's release) on every way out,
even when the client left before the body was ever read."""

import asyncio

from coordinator.api.sse import EventStream


async def _events():
    yield b"data: 1\n\n"


def _scope() -> dict:
    return {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "headers": []}


def test_a_client_gone_before_the_first_chunk_still_closes_the_stream() -> None:
    closed = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}  # gone at once

    async def send(message: dict) -> None:
        await asyncio.sleep(0)  # a full socket: cancelled here, before the body is read

    asyncio.run(EventStream(_events(), lambda: closed.append(True))(_scope(), receive, send))
    assert closed


def test_a_read_stream_closes_once_and_ends_with_done() -> None:
    closed, sent = [], []

    async def receive() -> dict:
        await asyncio.sleep(60)  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    stream = EventStream(_events(), lambda: closed.append(True))
    asyncio.run(asyncio.wait_for(stream(_scope(), receive, send), 10))
    bodies = b"".join(m.get("body", b"") for m in sent)
    assert bodies == b"data: 1\n\ndata: [DONE]\n\n"
    assert len(closed) >= 1
