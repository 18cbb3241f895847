"""Disconnects abort their requests and free their KV blocks; a full admission queue answers 503
with Retry-After."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from coordinator.api.context import ServerSettings
from tests.support.servers import (
    LONG_NUM_KV_BLOCKS,
    LONG_TOKENS,
    local_client,
    wait_until,
    wait_until_async,
)

LONG = {"prompt": [5, 6, 7, 8, 9], "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}
FREED_WITHIN_S = 1.0
IN_ENGINE_WITHIN_S = 30.0  # the request reaches the engine (the first test may compile kernels)


@pytest.fixture(scope="module")
def one_at_a_time(serve, long_llama):
    """An engine that runs one request at a time, behind a queue of one."""
    client = local_client(long_llama, max_num_seqs=1, num_kv_blocks=LONG_NUM_KV_BLOCKS)
    return client, serve(client, ServerSettings(max_queue=1, retry_after_s=2))


def engine_is_idle(client) -> bool:
    stats = client.stats()[0]
    all_free = stats.num_free_blocks == LONG_NUM_KV_BLOCKS
    return stats.num_running == stats.num_waiting == 0 and all_free


def is_running(client) -> bool:
    """The engine runs the one request it has room for: its KV blocks are taken."""
    return client.stats()[0].num_running == 1


def success_count(url: str, aborted: bool = False) -> float:
    """Requests counted as finished: for a stop or length reason, or (`aborted`) for abort."""
    text = httpx.get(url + "/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("tandem:request_success_total")]
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines
        if ('finished_reason="abort"' in line) == aborted
    )  # fmt: skip


def test_stream_disconnect_aborts_and_frees_blocks(one_at_a_time) -> None:
    client, server = one_at_a_time
    finished_before = success_count(server.url)
    aborted_before = success_count(server.url, aborted=True)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        payload = {**LONG, "stream": True}
        with http.stream("POST", "/v1/completions", json=payload) as response:
            lines = response.iter_lines()  # kept open: closing it would close the connection
            assert next(lines).startswith("data: ")
            assert client.stats()[0].num_free_blocks < LONG_NUM_KV_BLOCKS
        # Leaving the block closed the connection in the middle of the stream.
    assert wait_until(lambda: engine_is_idle(client), FREED_WITHIN_S)
    assert success_count(server.url) == finished_before  # aborted, not finished
    assert success_count(server.url, aborted=True) == aborted_before + 1


def test_non_streaming_disconnect_aborts_and_frees_blocks(one_at_a_time) -> None:
    client, server = one_at_a_time

    async def leave_early() -> None:
        async with httpx.AsyncClient(base_url=server.url) as http:
            request = asyncio.create_task(http.post("/v1/completions", json=LONG, timeout=30))
            assert await wait_until_async(lambda: is_running(client), IN_ENGINE_WITHIN_S)
            request.cancel()  # closes the connection
            await asyncio.gather(request, return_exceptions=True)

    finished_before = success_count(server.url)
    aborted_before = success_count(server.url, aborted=True)
    asyncio.run(leave_early())
    assert wait_until(lambda: engine_is_idle(client), FREED_WITHIN_S)
    assert success_count(server.url) == finished_before
    assert success_count(server.url, aborted=True) == aborted_before + 1


def test_full_queue_answers_503_with_retry_after(one_at_a_time) -> None:
    client, server = one_at_a_time
    payload = {**LONG, "stream": True}
    http = httpx.Client(base_url=server.url, timeout=30)
    with http, http.stream("POST", "/v1/completions", json=payload) as running:
        lines = running.iter_lines()  # kept open: closing it would close the connection
        assert next(lines).startswith("data: ")
        # The engine's one slot is taken: this one waits in the queue, and fills it.
        with http.stream("POST", "/v1/completions", json=payload) as queued:
            assert queued.status_code == 200
            refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert client.stats()[0].num_running == 1
    assert refused.status_code == 503
    assert refused.headers["Retry-After"] == "2"
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and error["type"] == "service_unavailable"
    assert wait_until(lambda: engine_is_idle(client), FREED_WITHIN_S)
    # With the queue empty again, requests are admitted.
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
