"""Sending one streaming request and timing it the way vLLM's benchmark does. `send_request`
never raises for a failed request: the failure is recorded in the result.

Streams are read with aiohttp (its HTTP parser is C), as vLLM's benchmark does: the client
shares the machine with the server it measures, and httpx's pure-Python stack cost about half a
core at 5,000 tokens/s, CPU the server under test then did not get.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from loadtest.config import SamplingConfig
from loadtest.errors import describe_http_error, one_line
from loadtest.sample import SampleRequest
from loadtest.sse import parse_sse_line
from loadtest.target import Target

ERROR_BODY_LIMIT = 2000
CONNECT_TIMEOUT_S = 10.0
MAX_LINE_BYTES = 1 << 20  # one SSE line (a chunk with many logprobs can be long)


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it. Times in seconds on the perf_counter clock."""

    prompt_len: int  # the server's usage (as vLLM counts: chat template included), else ours
    sent_at: float
    ttft: float | None  # send -> first chunk carrying generated text
    itl: tuple[float, ...]  # gaps between consecutive chunks carrying generated text
    latency: float | None  # send -> last chunk carrying generated text (vLLM's E2EL)
    output_tokens: int | None  # from the server's usage, or counted from the text afterwards
    generated_text: str
    error: str | None

    @property
    def success(self) -> bool:
        return self.error is None


def build_payload(target: Target, sample: SampleRequest, sampling: SamplingConfig) -> dict:
    payload: dict[str, object] = {
        "model": target.model,
        "max_tokens": sample.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.is_chat:
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = sample.prompt
    optional = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
    }
    payload.update({key: value for key, value in optional.items() if value is not None})
    if sampling.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(sampling.extra_body or {})  # last, as vLLM's --extra-body
    return payload


@contextlib.asynccontextmanager
async def stream_client(max_connections: int | None) -> AsyncIterator[aiohttp.ClientSession]:
    """The session requests are sent with: connections kept and reused, at most
    `max_connections` open (None: no limit), no proxy (one between client and server would
    distort every latency measured). Each request has its own overall deadline."""
    connector = aiohttp.TCPConnector(limit=max_connections or 0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, trust_env=False, read_bufsize=MAX_LINE_BYTES
    ) as session:
        yield session


async def send_request(
    client: aiohttp.ClientSession,
    target: Target,
    payload: dict,
    prompt_len: int,
    timeout_s: float,
) -> RequestResult:
    stream = _Stream(sent_at=time.perf_counter())
    try:
        error = await asyncio.wait_for(_post(client, target, payload, stream), timeout_s)
    except aiohttp.ConnectionTimeoutError:  # (an asyncio.TimeoutError too: caught first)
        error = f"cannot connect to {target.url} within {CONNECT_TIMEOUT_S:g} s"
    except asyncio.TimeoutError:
        error = f"timed out after {timeout_s:g} s"
    except aiohttp.ClientConnectorError as err:
        error = f"cannot connect to {target.url}: {one_line(str(err)) or 'ConnectError'}"
    except aiohttp.ClientPayloadError as err:
        error = f"the response was cut off: {one_line(str(err))}"
    except (aiohttp.ClientError, ValueError) as err:  # ValueError: a line past MAX_LINE_BYTES
        error = f"{type(err).__name__}: {one_line(str(err))}"
    return stream.result(prompt_len, error)


async def _post(
    client: aiohttp.ClientSession, target: Target, payload: dict, stream: _Stream
) -> str | None:
    async with client.post(target.url, json=payload, headers=target.headers) as response:
        if response.status != 200:
            body = await response.content.read(ERROR_BODY_LIMIT)
            text = body.decode("utf-8", errors="replace")
            return describe_http_error(response.status, response.reason or "", text)
        # Whatever bytes have arrived, split into lines here: one read and one clock reading
        # per arrival rather than per line (an event is a `data:` line and a blank one).
        partial = b""
        async for data in response.content.iter_any():
            now = time.perf_counter()
            *lines, partial = (partial + data).split(b"\n")
            if len(partial) > MAX_LINE_BYTES:
                raise ValueError(f"an SSE line longer than {MAX_LINE_BYTES} bytes")
            for raw in lines:
                error = stream.on_line(raw.decode("utf-8", errors="replace").rstrip("\r"), now)
                if error is not None or stream.done:
                    return error
        if partial:  # a last line the server did not end (as readline, taken at the end)
            line = partial.decode("utf-8", errors="replace").rstrip("\r")
            error = stream.on_line(line, time.perf_counter())
            if error is not None:
                return error
    return None if stream.done else "the stream ended before [DONE]"


@dataclass
class TextTiming:
    """One request's text as it arrives: TTFT from the first piece carrying text, ITL between
    pieces. Any stream of text can be timed with it (benchmarks/serving.py times the in-process
    engine the same way)."""

    sent_at: float
    last_at: float | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_tokens: int | None = None  # as the server's usage counts them

    def on_text(self, text: str, now: float) -> None:
        if self.last_at is None:
            self.ttft = now - self.sent_at
        else:
            self.itl.append(now - self.last_at)
        self.last_at = now
        self.pieces.append(text)

    def result(self, prompt_len: int, error: str | None) -> RequestResult:
        if error is None and self.ttft is None:
            error = "the stream carried no generated text"
        return RequestResult(
            prompt_len=prompt_len if self.prompt_tokens is None else self.prompt_tokens,
            sent_at=self.sent_at,
            ttft=self.ttft,
            itl=tuple(self.itl),
            latency=None if self.last_at is None else self.last_at - self.sent_at,
            output_tokens=self.output_tokens,
            generated_text="".join(self.pieces),
            error=error,
        )


@dataclass
class _Stream(TextTiming):
    """What one SSE response has delivered so far; mutated only by its own request."""

    done: bool = False

    def on_line(self, line: str, now: float) -> str | None:
        event = parse_sse_line(line)
        if event is None:
            return None
        self.done = event.done
        if event.completion_tokens is not None:
            self.output_tokens = event.completion_tokens
        if event.prompt_tokens is not None:
            self.prompt_tokens = event.prompt_tokens
        if event.timed:
            self.on_text(event.text, now)
        return event.error
