"""The update stream: a decode worker's publisher thread pushing frames to the coordinator's
UpdateServer over a real local TCP connection, and the framing both sides share."""

from __future__ import annotations

import asyncio
import queue
import socket
from collections.abc import Callable

import pytest

from coordinator.update_server import UpdateServer
from decode.publisher import UpdatePublisher
from protocol.errors import RequestError
from protocol.messages import RequestFailed, TokenUpdate, WorkerUpdate
from protocol.sampling import FinishReason, PromptLogprob, TokenLogprobs
from protocol.wire import (
    HEADER,
    MAX_FRAME_BYTES,
    FrameError,
    frame,
    frame_length,
    hello,
    pack_updates,
    unpack_updates,
    update_frames,
)

UPDATES: list[WorkerUpdate] = [
    TokenUpdate("a#1", 0, [5, 6], [None, None], num_prompt_tokens=7, queue_seconds=0.25),
    TokenUpdate(
        "b#2",
        3,
        [9],
        [TokenLogprobs(-0.5, [(9, -0.5), (4, -1.25)])],
        FinishReason.STOP,
        stop_token_id=9,
        num_cached_tokens=16,
    ),
    RequestFailed("c#1", "KV did not arrive within 1.0s", retry=False),
    RequestFailed("d#1", "the json schema cannot be used: ...", retry=False, invalid=True),
    TokenUpdate(
        "e#1",
        0,
        [3],
        [None],
        num_prompt_tokens=3,
        prompt_logprobs=[None, PromptLogprob(-2.5, 4, [(8, -0.25)]), PromptLogprob(-0.1, 1, [])],
    ),
]


def test_updates_survive_the_wire_field_for_field() -> None:
    payload = pack_updates(UPDATES)
    assert frame_length(payload[: HEADER.size]) == len(payload) - HEADER.size
    decoded = unpack_updates(payload[HEADER.size :])
    assert decoded == UPDATES
    assert decoded[1].finish_reason is FinishReason.STOP
    assert type(decoded[1].logprobs[0]) is TokenLogprobs
    assert type(decoded[4].prompt_logprobs[1]) is PromptLogprob
    assert isinstance(decoded[3].error(), RequestError)  # the client's fault: a 400


def test_a_batch_over_the_frame_limit_goes_in_several_frames() -> None:
    scores = [None] + [PromptLogprob(-1.0, 3, [(t, -0.5) for t in range(20)])] * 200
    big = [TokenUpdate(f"r{i}", 0, [1], [None], prompt_logprobs=scores) for i in range(4)]
    limit = len(pack_updates(big[:2])) - HEADER.size  # two fit a frame, four do not
    frames = update_frames(big, limit)
    assert len(frames) == 2 and all(len(f) - HEADER.size <= limit for f in frames)
    assert [u for f in frames for u in unpack_updates(f[HEADER.size :])] == big
    [alone] = update_frames(big[:1], limit=1000)  # one update over any frame: it fails alone
    [failed] = unpack_updates(alone[HEADER.size :])
    assert isinstance(failed, RequestFailed) and failed.request_id == "r0"
    assert failed.invalid and not failed.retry and "frame limit" in failed.reason


def test_bad_bytes_are_frame_errors() -> None:
    with pytest.raises(FrameError):
        frame_length(HEADER.pack(MAX_FRAME_BYTES + 1))
    with pytest.raises(FrameError):
        unpack_updates(b"\xc1")  # never valid msgpack
    with pytest.raises(FrameError):
        unpack_updates(frame([[0, "x"]])[HEADER.size :])  # too few fields


class Published:
    """What a DecodeWorker's take_updates does, fed by the test."""

    def __init__(self) -> None:
        self.batches: queue.Queue[list[WorkerUpdate] | Exception] = queue.Queue()

    def take(self, timeout: float) -> list[WorkerUpdate]:
        try:
            item = self.batches.get(timeout=timeout)
        except queue.Empty:
            return []
        if isinstance(item, Exception):
            raise item
        return item


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 10.0))


def test_publisher_pushes_each_batch_as_one_frame_in_order() -> None:
    async def scenario() -> None:
        server = UpdateServer()
        await server.start()
        connection = server.expect("decode-0")
        published = Published()
        publisher = await asyncio.to_thread(
            UpdatePublisher, published.take, server.endpoint, "decode-0", server.secret
        )
        stream = await connection
        published.batches.put(UPDATES[:2])
        published.batches.put(UPDATES[2:])
        assert await stream.read() == UPDATES[:2]
        assert await stream.read() == UPDATES[2:]
        # The worker's engine crashed: the publisher says so by closing its end.
        published.batches.put(RuntimeError("engine thread crashed"))
        with pytest.raises(asyncio.IncompleteReadError):
            await stream.read()
        await asyncio.to_thread(publisher.close)
        assert not publisher.alive
        assert publisher.frames_sent == 2
        await server.close()

    run(scenario())


def test_closing_the_publisher_ends_the_stream_promptly() -> None:
    async def scenario() -> None:
        server = UpdateServer()
        await server.start()
        connection = server.expect("decode-0")
        publisher = await asyncio.to_thread(
            UpdatePublisher, Published().take, server.endpoint, "decode-0", server.secret
        )
        stream = await connection
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.to_thread(publisher.close)
        with pytest.raises(asyncio.IncompleteReadError):
            await stream.read()
        assert loop.time() - started < 2.0
        await server.close()

    run(scenario())


@pytest.mark.parametrize(
    "first_frame",
    [
        lambda secret: hello("decode-0", "not-the-secret"),
        lambda secret: hello("decode-9", secret),  # a worker the server does not expect
        lambda secret: frame(["something else", 1, 2]),
        lambda secret: b"GET / HTTP/1.1\r\n\r\n",
    ],
    ids=["wrong secret", "unexpected worker", "not a hello", "not our protocol"],
)
def test_a_connection_without_the_right_hello_is_closed(
    first_frame: Callable[[str], bytes],
) -> None:
    async def scenario() -> None:
        server = UpdateServer()
        await server.start()
        connection = server.expect("decode-0")
        sock = socket.create_connection(tuple(server.endpoint), timeout=5)
        sock.sendall(first_frame(server.secret))
        # The server closes it: the next read sees end of stream (or a reset).
        got = await asyncio.to_thread(_recv_or_reset, sock)
        assert got == b""
        assert not connection.done()  # the expected worker can still connect
        sock.close()
        await server.close()

    run(scenario())


def _recv_or_reset(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1)
    except ConnectionResetError:
        return b""
