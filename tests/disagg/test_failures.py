"""A worker dying mid-request becomes a retry, never a stuck client or a lost token; every
surviving worker ends with all its KV blocks free."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from protocol.sampling import SamplingParams
from tests.support.servers import wait_until

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


async def generate_all(client, prompts, on_progress) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for output in client.generate(prompt, GREEDY, f"f{i}"):
            assert output.token_ids[: len(tokens)] == tokens  # never rewritten, never repeated
            tokens = output.token_ids
            on_progress(i, len(tokens))
        return tokens

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def run_and_kill(loop, client, prompts, victim, kill_when, kill=ray.kill) -> list[list[int]]:
    """Runs every prompt; `kill(victim)` once kill_when(progress) holds."""
    progress: dict[int, int] = {}
    future = asyncio.run_coroutine_threadsafe(
        generate_all(client, prompts, progress.__setitem__), loop.loop
    )
    deadline = time.monotonic() + 240  # a bound against hangs, not a speed check
    while not kill_when(progress):
        assert time.monotonic() < deadline and not future.done(), progress
        time.sleep(0.005)
    kill(victim)
    return future.result(timeout=300)


def assert_retired(client, worker_id: str) -> None:
    """The dead worker leaves the router. Its requests may all have ended before the kill
    landed, so the coordinator may learn of the death (a closed stream, a failed probe) a
    little after the last output."""
    assert wait_until(lambda: not client.router.is_alive(worker_id), timeout=10), worker_id


def assert_all_blocks_free(loop, handles) -> None:
    for handle in handles:
        deadline = time.monotonic() + 10
        while True:
            stats = ray.get(handle.stats.remote(), timeout=10)
            if stats.num_free_blocks == stats.num_total_blocks:
                break
            assert time.monotonic() < deadline, f"{stats.worker} kept blocks: {stats}"
            time.sleep(0.1)


def test_dead_prefill_worker_requests_are_retried(
    tiny_llama, build_pool, loop, prompts, expected
) -> None:
    client = build_pool(tiny_llama, num_prefill=2, num_decode=1)
    victim = client.prefill["prefill-0"]
    outputs = run_and_kill(loop, client, prompts, victim, kill_when=lambda p: len(p) >= 1)
    assert outputs == expected
    assert_retired(client, "prefill-0")
    assert_all_blocks_free(loop, [client.prefill["prefill-1"], *client.decode.values()])


def test_dead_decode_worker_requests_resume_elsewhere(
    tiny_llama, build_pool, loop, prompts, expected
) -> None:
    client = build_pool(tiny_llama, num_prefill=1, num_decode=2)
    victim = client.decode["decode-0"]
    # Kill once every request has streamed a few tokens: each must resume mid-generation.
    outputs = run_and_kill(
        loop, client, prompts, victim,
        kill_when=lambda p: len(p) == len(prompts) and min(p.values()) >= 3,
    )  # fmt: skip
    assert outputs == expected
    assert_retired(client, "decode-0")
    assert_all_blocks_free(loop, [*client.prefill.values(), client.decode["decode-1"]])


def test_every_worker_dead_is_an_error_not_a_hang(tiny_llama, build_pool, loop, prompts) -> None:
    client = build_pool(tiny_llama, num_prefill=1, num_decode=1)
    for handle in (*client.prefill.values(), *client.decode.values()):
        ray.kill(handle)

    async def attempt():
        async for _ in client.generate(prompts[0], GREEDY, "nobody"):
            pass

    started = time.monotonic()
    with pytest.raises(Exception, match="no live decode worker|failed"):
        loop.run(attempt(), timeout=60)
    assert time.monotonic() - started < 60
