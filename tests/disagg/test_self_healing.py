"""Self-healing and elastic pools on real Ray workers (tiny model, gloo): a worker killed with
SIGKILL or frozen with SIGSTOP under a greedy load leaves routing, its requests finish exactly as
an undisturbed run, and a replacement brings the pool back to its size; pools grow, shrink and
switch roles under load without losing or changing a request."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import ray

from protocol.sampling import SamplingParams
from tests.disagg.test_failures import assert_all_blocks_free, generate_all

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
HEAL_TIMEOUT_S = 120  # a replacement loads the model: seconds on this machine


def run_with(loop, client, prompts, when, action) -> list[list[int]]:
    """Runs every prompt; calls action() once when(progress) holds; returns the outputs."""
    progress: dict[int, int] = {}
    future = asyncio.run_coroutine_threadsafe(
        generate_all(client, prompts, progress.__setitem__), loop.loop
    )
    deadline = time.monotonic() + 240  # a bound against hangs, not a speed check
    while not when(progress):
        assert time.monotonic() < deadline and not future.done(), progress
        time.sleep(0.005)
    action()
    return future.result(timeout=300)


def wait_for(condition, timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition never held"
        time.sleep(0.05)
    return time.monotonic() - start


def serving(client, pool: str) -> list[str]:
    return sorted(w.worker_id for w in client.supervisor.serving(pool))


def scale(loop, client, sizes: dict[str, int]) -> None:
    """On the coordinator's event loop, as the admin API calls it."""

    async def on_loop() -> None:
        client.scale(sizes)

    loop.run(on_loop(), timeout=10)


def mid_generation(prompts):
    return lambda p: len(p) == len(prompts) and min(p.values()) >= 3


def test_sigkill_of_a_decode_worker_heals(tiny_llama, build_pool, loop, prompts, expected):
    client = build_pool(tiny_llama, num_prefill=1, num_decode=2)
    pid = ray.get(client.decode["decode-0"].pid.remote(), timeout=30)
    outputs = run_with(
        loop, client, prompts, mid_generation(prompts), lambda: os.kill(pid, signal.SIGKILL)
    )
    assert outputs == expected
    # The death is noticed on the coordinator's loop (its update stream closes, or a probe
    # fails), which the outputs need not wait for when none of them was left on decode-0.
    wait_for(lambda: "decode-0" not in serving(client, "decode"), 2.0)
    wait_for(lambda: len(serving(client, "decode")) == 2, HEAL_TIMEOUT_S)
    assert client.supervisor.restarts() == {"prefill": 0, "decode": 1}
    assert client.readiness() is None
    assert "decode-0" not in client.decode
    assert_all_blocks_free(loop, [*client.prefill.values(), *client.decode.values()])


def test_sigstop_of_a_prefill_worker_heals(tiny_llama, build_pool, loop, prompts, expected):
    client = build_pool(tiny_llama, num_prefill=2, num_decode=1)
    pid = ray.get(client.prefill["prefill-0"].pid.remote(), timeout=30)
    stopped_at: list[float] = []

    def freeze() -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped_at.append(time.monotonic())

    try:
        outputs = run_with(loop, client, prompts, lambda p: len(p) >= 1, freeze)
        assert outputs == expected
        detected = wait_for(lambda: "prefill-0" not in serving(client, "prefill"), 10)
        assert time.monotonic() - stopped_at[0] < 5.0 or detected < 5.0
        wait_for(lambda: len(serving(client, "prefill")) == 2, HEAL_TIMEOUT_S)
        assert client.readiness() is None
    finally:
        with contextlib.suppress(ProcessLookupError):  # the supervisor killed it already
            os.kill(pid, signal.SIGKILL)


def test_scale_and_role_switch_under_load(tiny_llama, build_pool, loop, prompts, expected):
    client = build_pool(tiny_llama, num_prefill=1, num_decode=1)
    scale(loop, client, {"decode": 2})
    wait_for(lambda: len(serving(client, "decode")) == 2, HEAL_TIMEOUT_S)
    switched: list[float] = []

    def switch() -> None:
        switched.append(loop.run(client.switch_role("decode-0", "prefill"), timeout=60))

    assert run_with(loop, client, prompts, mid_generation(prompts), switch) == expected
    assert serving(client, "prefill") == ["decode-0", "prefill-0"]
    assert switched[0] < 1.0
    back = loop.run(client.switch_role("decode-0", "decode"), timeout=60)
    assert back < 1.0
    scale(loop, client, {"decode": 1, "prefill": 1})
    assert run_with(loop, client, prompts, lambda p: True, lambda: None) == expected
    wait_for(
        lambda: len(serving(client, "decode")) == 1 and len(serving(client, "prefill")) == 1, 30
    )
    assert run_with(loop, client, prompts, lambda p: True, lambda: None) == expected


def test_sigstop_of_a_decode_worker_heals(tiny_llama, build_pool, loop, prompts, expected):
    client = build_pool(tiny_llama, num_prefill=1, num_decode=2)
    pid = ray.get(client.decode["decode-0"].pid.remote(), timeout=30)
    stopped_at: list[float] = []

    def freeze() -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped_at.append(time.monotonic())

    try:
        outputs = run_with(loop, client, prompts, mid_generation(prompts), freeze)
        assert outputs == expected  # resumed on decode-1 from the tokens already streamed
        wait_for(lambda: "decode-0" not in serving(client, "decode"), 10)
        assert time.monotonic() - stopped_at[0] < 10
        wait_for(lambda: len(serving(client, "decode")) == 2, HEAL_TIMEOUT_S)
        assert client.readiness() is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_decode_worker_that_leaves_has_its_channels_closed(
    tiny_llama, build_pool, loop, prompts, expected
):
    """The prefill worker's lanes to a decode worker scaled away close (each held a thread and
    a channel on both ends for as long as the prefill worker lived)."""
    client = build_pool(tiny_llama, num_prefill=1, num_decode=2)
    prefill = client.prefill["prefill-0"]
    channels = lambda handle: ray.get(handle.stats.remote(), timeout=10).kv_channels_open  # noqa: E731
    assert run_with(loop, client, prompts, lambda p: True, lambda: None) == expected
    assert channels(prefill) == 2  # one lane to each decode worker
    assert [channels(client.decode[d]) for d in ("decode-0", "decode-1")] == [1, 1]
    scale(loop, client, {"decode": 1})  # the newest, decode-1, drains and leaves
    wait_for(lambda: serving(client, "decode") == ["decode-0"], 30)
    wait_for(lambda: channels(prefill) == 1, 10)
    assert run_with(loop, client, prompts, lambda p: True, lambda: None) == expected
    assert channels(prefill) == 1 and channels(client.decode["decode-0"]) == 1
