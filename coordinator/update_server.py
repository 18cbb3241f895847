"""UpdateServer: where decode workers push their token updates (the worker side is
decode/publisher.py, the framing protocol/wire.py).

    server.expect(worker_id)   -> a future of that worker's connection
    worker.stream_updates(server.endpoint, server.secret)    the worker connects and says hello
    await future  -> connection;  connection.read() -> the next frame's updates, in order

A connection is accepted only with the secret this server made and for a worker it expects;
anything else is closed. Reading has no deadline of its own: a silent connection is an idle
worker, and a hung one is the Supervisor's to find (its probes retire it, which cancels the
reader).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

from protocol.kv import Endpoint
from protocol.messages import WorkerUpdate
from protocol.wire import HEADER, FrameError, frame_length, read_hello, unpack_updates

log = logging.getLogger(__name__)
HELLO_TIMEOUT = 10.0


class UpdateConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def read(self) -> list[WorkerUpdate]:
        """The next frame's updates; IncompleteReadError once the worker closed its end,
        FrameError for bytes that are not our protocol."""
        return unpack_updates(await _read_frame(self.reader))

    def close(self) -> None:
        self.writer.close()


class UpdateServer:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.secret = secrets.token_hex(16)
        self._expected: dict[str, asyncio.Future[UpdateConnection]] = {}
        self._server: asyncio.Server | None = None
        self.endpoint: Endpoint | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.endpoint = Endpoint(self.host, port)

    def expect(self, worker_id: str) -> asyncio.Future[UpdateConnection]:
        """The connection `worker_id` will open next (a later expect replaces this one)."""
        self.forget(worker_id)
        future = asyncio.get_running_loop().create_future()
        self._expected[worker_id] = future
        return future

    def forget(self, worker_id: str) -> None:
        future = self._expected.pop(worker_id, None)
        if future is None:
            return
        if future.done() and not future.cancelled():
            future.result().close()
        else:
            future.cancel()

    async def close(self) -> None:
        for worker_id in list(self._expected):
            self.forget(worker_id)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            payload = await asyncio.wait_for(_read_frame(reader), HELLO_TIMEOUT)
            worker_id, secret = read_hello(payload)
        except (TimeoutError, asyncio.IncompleteReadError, FrameError, OSError) as err:
            log.warning("update stream refused: %s", type(err).__name__)
            writer.close()
            return
        future = self._expected.get(worker_id)
        if not secrets.compare_digest(secret, self.secret) or future is None or future.done():
            log.warning("update stream from %r refused: not expected", worker_id)
            writer.close()
            return
        future.set_result(UpdateConnection(reader, writer))


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(HEADER.size)
    return await reader.readexactly(frame_length(header))
