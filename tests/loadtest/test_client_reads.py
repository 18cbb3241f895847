"""The load client reads an SSE stream however its bytes are cut: events split mid-line across
reads, several in one read, CRLF line ends; a line past MAX_LINE_BYTES fails its request."""

from __future__ import annotations

import asyncio
import json

import pytest

import loadtest.client
from loadtest.client import send_request, stream_client
from loadtest.target import Target


def event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\n'
DONE = b"data: [DONE]\n\n"


async def fetch(writes: list[bytes]):
    """One request to a server that sends the response body as `writes`, one write (and one
    HTTP chunk) each, a moment apart."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for data in writes:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = Target(url=f"http://127.0.0.1:{port}/v1/completions", model="m", headers={},
                    is_chat=False)  # fmt: skip
    try:
        async with stream_client(None) as client:
            return await send_request(client, target, {"prompt": "x"}, 3, timeout_s=10)
    finally:
        server.close()


def test_events_cut_anywhere_are_read_whole() -> None:
    body = event("a") + event("b") + event(" c") + event("d") + USAGE + DONE
    cuts = [body[:3], body[3:20], body[20:70], body[70:71], body[71:]]  # mid-line, mid-event
    result = asyncio.run(fetch(cuts))
    assert result.error is None
    assert result.generated_text == "ab cd"
    assert result.output_tokens == 4 and result.prompt_len == 3
    assert len(result.itl) == 3


def test_events_that_arrive_together_are_timed_together() -> None:
    """Two events in one write reach the client in one read, at one time: a zero gap, as
    vLLM's client times a joined chunk (not the microseconds it took to parse the first)."""
    result = asyncio.run(fetch([event("a"), event("b") + event("c"), DONE]))
    assert result.generated_text == "abc"
    assert result.itl[0] > 0.005 and result.itl[1] == 0.0


def test_crlf_line_ends() -> None:
    body = (event("x") + event("y") + DONE).replace(b"\n", b"\r\n")
    result = asyncio.run(fetch([body]))
    assert result.error is None and result.generated_text == "xy"


def test_a_line_past_the_limit_fails_the_request(monkeypatch) -> None:
    monkeypatch.setattr(loadtest.client, "MAX_LINE_BYTES", 64)
    result = asyncio.run(fetch([event("a"), b"data: " + b"x" * 100, b"\n\n" + DONE]))
    assert not result.success
    assert "longer than 64 bytes" in result.error


@pytest.mark.parametrize("cut", [1, 7])
def test_done_split_across_reads(cut: int) -> None:
    body = event("z") + DONE
    result = asyncio.run(fetch([body[: len(body) - cut], body[len(body) - cut :]]))
    assert result.error is None and result.generated_text == "z"


def test_a_last_line_without_its_newline_still_counts() -> None:
    result = asyncio.run(fetch([event("q"), b"data: [DONE]"]))
    assert result.error is None and result.generated_text == "q"


def test_a_last_chunk_with_no_text_still_ends_the_request() -> None:
    """The model stopped on EOS: the server's last chunk has finish_reason and no text. vLLM's
    client times it (its E2EL, its last ITL); ours skipped it and TPOT read low."""
    last = {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}
    stop = b"data: " + json.dumps(last).encode() + b"\n\n"
    result = asyncio.run(fetch([event("a"), event("b"), stop, USAGE, DONE]))
    assert result.error is None and result.generated_text == "ab"
    assert len(result.itl) == 2  # a -> b -> the stop chunk
    assert result.latency == pytest.approx(result.ttft + sum(result.itl))


def test_a_connect_timeout_says_so(monkeypatch) -> None:
    import aiohttp

    async def cannot_connect(*args) -> None:
        raise aiohttp.ConnectionTimeoutError("connect")

    monkeypatch.setattr(loadtest.client, "_post", cannot_connect)
    target = Target(url="http://127.0.0.1:9/v1/completions", model="m", headers={},
                    is_chat=False)  # fmt: skip

    async def go():
        async with stream_client(None) as client:
            return await send_request(client, target, {"prompt": "x"}, 3, timeout_s=40)

    result = asyncio.run(go())
    assert result.error == "cannot connect to http://127.0.0.1:9/v1/completions within 10 s"
