"""kill -9 of either side while a KV transfer is between two layers, on real Ray workers: every
payload send on the prefill side is held back (a test-only transport fault), so each request's
transfer spans a visible time and the kill lands inside one. Requests finish exactly as an
undisturbed run, nothing hangs, the surviving side stays up and holds no KV blocks."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from tests.disagg.test_failures import assert_all_blocks_free
from tests.disagg.test_self_healing import HEAL_TIMEOUT_S, run_with, serving, wait_for

SLOW_SENDS = "delay,delay=0.1,every"  # every KV payload leaves 0.1 s late
# A send to the killed decode worker holds its channel's sender lane until its deadline, once
# (the other sends in flight on that channel are then dropped unwaited); sends are not yet
# abandoned as soon as their peer dies, so keep the deadline short.
TRANSFER_TIMEOUT_S = 5.0


@pytest.fixture
def slow_pool(tiny_llama, build_pool, loop):
    """slow_pool(num_decode): 1 prefill worker whose KV sends are slow, `num_decode` decode
    workers. Each pool (with its replacements) is stopped when its test ends: the session's Ray
    cluster has room for a limited number of workers."""
    built = []

    def build(num_decode: int):
        built.append(
            build_pool(
                tiny_llama,
                num_prefill=1,
                num_decode=num_decode,
                kv_fault=SLOW_SENDS,
                transfer_timeout=TRANSFER_TIMEOUT_S,
            )  # fmt: skip
        )
        return built[-1]

    yield build
    for client in built:
        loop.run(client.shutdown(), timeout=60)


def kill_mid_transfer(loop, client, victim, prompts) -> list[list[int]]:
    """Runs every prompt and SIGKILLs `victim` once some requests have their first token (their
    KV landed) while others are still moving; returns the outputs."""
    pid = ray.get(victim.pid.remote(), timeout=30)
    started = lambda p: 1 <= len(p) < len(prompts)  # noqa: E731
    return run_with(loop, client, prompts, started, lambda: os.kill(pid, signal.SIGKILL))


def test_kill_9_of_the_prefill_worker_mid_layer(slow_pool, loop, prompts, expected):
    client = slow_pool(num_decode=1)
    outputs = kill_mid_transfer(loop, client, client.prefill["prefill-0"], prompts)
    assert outputs == expected  # the lost transfers were redone (on the decode worker, or anew)
    assert ray.get(client.decode["decode-0"].health.remote(), timeout=10).alive
    wait_for(lambda: len(serving(client, "prefill")) == 1, HEAL_TIMEOUT_S)
    assert client.supervisor.restarts()["prefill"] == 1
    assert_all_blocks_free(loop, [*client.prefill.values(), *client.decode.values()])


def test_kill_9_of_a_decode_worker_mid_layer(slow_pool, loop, prompts, expected):
    client = slow_pool(num_decode=2)
    outputs = kill_mid_transfer(loop, client, client.decode["decode-0"], prompts)
    assert outputs == expected
    prefill = client.prefill["prefill-0"]
    assert ray.get(prefill.health.remote(), timeout=10).alive
    sent = ray.get(prefill.stats.remote(), timeout=10)
    assert sent.kv_transfer_seconds_sum / sent.kv_transfer_count >= 0.1  # the sends were slow
    wait_for(lambda: len(serving(client, "decode")) == 2, HEAL_TIMEOUT_S)
    assert_all_blocks_free(loop, [*client.prefill.values(), *client.decode.values()])
