"""A scripted OpenAI-compatible server for the load-test tests: asyncio streams on 127.0.0.1 with
an OS-assigned port, in a background thread. Generated token k (k = 0, 1, ...) is sent
ttft_s + k * itl_s after the request got a slot, so every metric can be computed by hand. Its
tokenizer is whitespace: a text of N words is N tokens, and token k reads "tok{k} "."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import json
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

READ_TIMEOUT_S = 5.0
START_TIMEOUT_S = 5.0
FAILING_TOKEN = 2  # CUT_STREAM and ERROR_EVENT fail after this many tokens


class Failure(enum.Enum):
    HTTP_500 = "http-500"
    CUT_STREAM = "cut-stream"  # the connection drops mid-stream
    ERROR_EVENT = "error-event"  # an error object arrives inside the stream


@dataclass(frozen=True)
class Script:
    ttft_s: float = 0.1
    itl_s: float = 0.03
    model: str = "fake-model"
    include_usage: bool = True
    # usage.prompt_tokens: the prompt's words plus this many (a chat template's tokens, say);
    # None leaves it out, so the client counts the prompt itself
    template_tokens: int | None = None
    serve_tokenize: bool = True
    capacity: int | None = None  # requests generating at once; the others queue
    failure: Failure | None = None
    fail_from: int = 0  # generation requests count from 0 in arrival order (the probe is 0)


class FakeServer:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.received: list[dict] = []  # generation payloads, in arrival order
        self.max_in_flight = 0
        self._in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._slots: asyncio.Semaphore | None = None
        self.url = ""

    def start(self) -> FakeServer:
        self._thread.start()
        self._server = self._call(self._open()).result(timeout=START_TIMEOUT_S)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self._call(self._close()).result(timeout=START_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=START_TIMEOUT_S)
        self._loop.close()

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    async def _open(self) -> asyncio.Server:
        self._slots = asyncio.Semaphore(self.script.capacity or 1_000_000)
        return await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def _close(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, body = await asyncio.wait_for(_read_request(reader), READ_TIMEOUT_S)
            await self._route(writer, method, path, body)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    async def _route(
        self, writer: asyncio.StreamWriter, method: str, path: str, body: dict
    ) -> None:
        if (method, path) == ("GET", "/v1/models"):
            models = {"object": "list", "data": [{"id": self.script.model, "object": "model"}]}
            return await _send_json(writer, 200, models)
        if (method, path) == ("POST", "/tokenize") and self.script.serve_tokenize:
            words = str(body.get("prompt", "")).split()
            return await _send_json(
                writer, 200, {"tokens": list(range(len(words))), "count": len(words)}
            )
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            return await self._generate(writer, body, chat=path.endswith("chat/completions"))
        await _send_json(writer, 404, {"detail": "Not Found"})

    async def _generate(self, writer: asyncio.StreamWriter, payload: dict, chat: bool) -> None:
        index = len(self.received)
        self.received.append(payload)
        failure = self.script.failure if index >= self.script.fail_from else None
        if failure is Failure.HTTP_500:
            return await _send_json(writer, 500, {"error": {"message": "scripted failure"}})
        assert self._slots is not None
        async with self._slots:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            try:
                await self._stream(writer, payload, chat, failure)
            finally:
                self._in_flight -= 1

    async def _stream(
        self, writer: asyncio.StreamWriter, payload: dict, chat: bool, failure: Failure | None
    ) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        if chat:  # a role-only chunk at once: it must not count as the first token
            await _send_event(writer, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        num_tokens = int(payload["max_tokens"])
        for k in range(num_tokens):
            await asyncio.sleep(
                max(0.0, began + self.script.ttft_s + k * self.script.itl_s - loop.time())
            )
            if failure is not None and k == FAILING_TOKEN:
                return await _fail_stream(writer, failure)
            # the last token's chunk carries the finish, as vLLM's and tandem's servers send a
            # reply cut by max_tokens (a chunk of its own would be timed as one more step)
            last = "length" if k == num_tokens - 1 else None
            await _send_event(writer, _token_chunk(f"tok{k} ", chat, last))
        wants_usage = (payload.get("stream_options") or {}).get("include_usage")
        if self.script.include_usage and wants_usage:
            usage = {"completion_tokens": num_tokens, "total_tokens": num_tokens}
            if self.script.template_tokens is not None:
                prompt = payload["messages"][0]["content"] if chat else payload["prompt"]
                usage["prompt_tokens"] = len(prompt.split()) + self.script.template_tokens
            await _send_event(writer, {"choices": [], "usage": usage})
        await _send_chunk(writer, b"data: [DONE]\n\n")
        await _send_chunk(writer, b"")


def _token_chunk(text: str, chat: bool, finish_reason: str | None) -> dict:
    choice = {"index": 0, "finish_reason": finish_reason}
    choice.update({"delta": {"content": text}} if chat else {"text": text})
    return {"id": "cmpl-fake", "choices": [choice], "usage": None}


async def _fail_stream(writer: asyncio.StreamWriter, failure: Failure) -> None:
    if failure is Failure.CUT_STREAM:
        writer.transport.abort()
        return
    await _send_event(writer, {"object": "error", "error": {"message": "scripted failure"}})
    await _send_chunk(writer, b"data: [DONE]\n\n")
    await _send_chunk(writer, b"")


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    request_line, *header_lines = head.split("\r\n")
    method, path, _ = request_line.split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    raw = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, path, json.loads(raw) if raw else {}


async def _send_json(writer: asyncio.StreamWriter, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    writer.write(head.encode() + data)
    await writer.drain()


async def _send_event(writer: asyncio.StreamWriter, chunk: dict) -> None:
    await _send_chunk(writer, f"data: {json.dumps(chunk)}\n\n".encode())


async def _send_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    """One piece of a chunked-encoding body; empty data ends the body."""
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()
