"""The Supervisor against fake workers: hung and dead workers leave routing within a bound and
their requests resume elsewhere with no token lost or repeated; replacements join; pools grow,
shrink and drain; readiness only reads state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace

import pytest

import coordinator.coordinator as coordinator_module
from coordinator.coordinator import CoordinatorConfig
from coordinator.supervisor import SupervisorConfig
from protocol.errors import EngineDeadError, PoolError
from protocol.sampling import SamplingParams
from tests.support.fake_workers import OUTPUT, FakeCluster

SUPERVISION = SupervisorConfig(
    probe_interval=0.02, probe_timeout=0.05, max_probe_failures=2, restart_backoff=0.01
)
CONFIG = CoordinatorConfig(
    block_size=4, call_timeout=1.0, prefill_base_timeout=30.0, supervision=SUPERVISION
)
PROMPT = [1, 2, 3, 4, 5, 6]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(autouse=True)
def killed(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    monkeypatch.setattr(coordinator_module, "STATS_SECONDS", 0.02)
    monkeypatch.setattr(coordinator_module, "STATS_TIMEOUT", 0.05)
    handles: list[object] = []
    monkeypatch.setattr("ray.kill", handles.append)
    return handles


def run(coro: Coroutine) -> None:
    asyncio.run(asyncio.wait_for(coro, 10.0))


async def tokens_of(coordinator, request_id: str = "req-0") -> list[int]:
    return [
        t async for out in coordinator.generate(PROMPT, GREEDY, request_id)
        for t in out.delta_token_ids
    ]  # fmt: skip


async def until(condition: Callable[[], bool], timeout: float = 3.0) -> float:
    """Seconds until `condition` held (fails the test past `timeout`)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition never held"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def test_frozen_prefill_worker_leaves_and_its_request_resumes_elsewhere(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=2, spawn=True)
        async with cluster.running() as coordinator:
            cluster.prefiller("prefill-0").frozen = True  # SIGSTOP: no call answers
            started = time.monotonic()
            assert await tokens_of(coordinator) == OUTPUT[:8]  # exact, none repeated or lost
            assert time.monotonic() - started < 2.0  # not the prefill deadline (30 s)
            assert not coordinator.router.is_alive("prefill-0")
            assert cluster.prefill["prefill-0"] in killed
            # A replacement joins the pool and the server is whole again.
            await until(lambda: len(coordinator.supervisor.serving("prefill")) == 2)
            assert cluster.spawned == ["prefill-new0"]
            assert coordinator.supervisor.restarts() == {"prefill": 1, "decode": 0}
            assert coordinator.readiness() is None

    run(main())


def test_dead_decode_worker_is_replaced_and_requests_continue(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=2, spawn=True)
        cluster.decoder("decode-0").stall_after = 3  # decode-0 holds req-0 after 3 tokens
        async with cluster.running() as coordinator:
            stream = coordinator.generate(PROMPT, GREEDY, "req-0")
            seen = []
            async for out in stream:
                seen.extend(out.delta_token_ids)
                if len(seen) == 3:
                    cluster.decode["decode-0"].dead = True  # kill -9
                    break
            rest = [t async for out in stream for t in out.delta_token_ids]
            assert seen + rest == OUTPUT[:8]
            assert cluster.decode["decode-1"].ids("reserve") == ["req-0#2"]
            await until(lambda: len(coordinator.supervisor.serving("decode")) == 2)
            assert "decode-new0" in coordinator.decode
            assert coordinator.readiness() is None

    run(main())


def test_detection_time_of_a_frozen_decode_worker(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_decode=2)
        async with cluster.running() as coordinator:
            cluster.decoder("decode-1").frozen = True
            took = await until(lambda: not coordinator.router.is_alive("decode-1"))
            bound = SUPERVISION.probe_interval + 2 * SUPERVISION.probe_timeout
            assert took < bound + 0.5
            # No spawner: the pool stays short, but one decode worker still serves.
            assert coordinator.readiness() is None
            cluster.decode["decode-0"].dead = True
            await until(lambda: coordinator.readiness() is not None)
            assert "no decode worker" in coordinator.readiness()

    run(main())


def test_scale_up_then_drain_back(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=1, spawn=True)
        async with cluster.running() as coordinator:
            assert coordinator.worker_start_s() is None  # none started yet
            coordinator.scale({"decode": 2})
            await until(lambda: len(coordinator.supervisor.serving("decode")) == 2)
            started = coordinator.worker_start_s()
            assert started is not None and 0 <= started < 5.0  # spawn -> serving, measured
            results = await asyncio.gather(*(tokens_of(coordinator, f"req-{i}") for i in range(4)))
            assert results == [OUTPUT[:8]] * 4
            assert cluster.decode["decode-new0"].ids("reserve")  # the new worker got work
            coordinator.scale({"decode": 1})
            await until(lambda: len(coordinator.supervisor.serving("decode")) == 1)
            await until(lambda: "decode-new0" not in coordinator.supervisor.workers)
            assert cluster.decode["decode-new0"] in killed
            assert coordinator.supervisor.restarts()["decode"] == 0  # growth is no restart
            assert await tokens_of(coordinator, "after") == OUTPUT[:8]

    run(main())


def test_drain_lets_running_requests_finish(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=2)
        cluster.decoder("decode-0").batch = 1
        async with cluster.running() as coordinator:
            stream = coordinator.generate(PROMPT, GREEDY, "req-0")
            first = await stream.__anext__()
            coordinator.drain("decode-0")
            assert coordinator.router.decode["decode-0"].accepting is False
            rest = [t async for out in stream for t in out.delta_token_ids]
            assert first.delta_token_ids + rest == OUTPUT[:8]
            assert cluster.decode["decode-0"].ids("reserve") == ["req-0#1"]  # never moved
            await until(lambda: "decode-0" not in coordinator.supervisor.workers)
            assert await tokens_of(coordinator, "next") == OUTPUT[:8]
            assert cluster.decode["decode-1"].ids("reserve") == ["next#1"]

    run(main())


def test_readiness_reads_state_only(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        assert cluster.coordinator.readiness() == "the workers are still starting"
        async with cluster.running() as coordinator:
            await asyncio.sleep(0.05)
            tasks = len(asyncio.all_tasks())
            calls = sum(len(h.calls) for h in (*cluster.prefill.values(), *cluster.decode.values()))
            for _ in range(1000):
                assert coordinator.readiness() is None
                await coordinator.ready()  # repeated: starts nothing new
            assert len(asyncio.all_tasks()) == tasks
            ping_calls = [len(h.calls["ping"]) for h in cluster.decode.values()]
            assert ping_calls == [1]
            assert calls >= 0

    run(main())


def test_a_frozen_worker_does_not_freeze_stats(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(
            CoordinatorConfig(block_size=4, supervision=SupervisorConfig(probe_interval=60.0)),
            num_prefill=2,
        )
        async with cluster.running() as coordinator:
            cluster.prefiller("prefill-1").frozen = True
            cluster.decoder().free_blocks = 7
            await until(lambda: any(s.stale for s in coordinator.stats()))
            # The others keep reporting while prefill-1 keeps its last (stale) report.
            await until(lambda: any(s.num_free_blocks == 7 for s in coordinator.stats()))
            stale = {s.worker: s.stale for s in coordinator.stats()}
            assert stale == {"prefill-0": False, "prefill-1": True, "decode-0": False}

    run(main())


def test_role_switch_moves_running_decodes_and_loses_nothing(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=2)
        cluster.decoder("decode-0").batch = 1
        cluster.decoder("decode-1").batch = 1
        async with cluster.running() as coordinator:
            streams = [coordinator.generate(PROMPT, GREEDY, f"req-{i}") for i in range(4)]
            firsts = [await s.__anext__() for s in streams]
            on_d0 = [r for r in cluster.decode["decode-0"].ids("reserve")]
            assert on_d0  # the burst spread over both decode workers
            took = await coordinator.switch_role("decode-0", "prefill")
            assert took < 0.3
            assert sorted(w.worker_id for w in coordinator.supervisor.serving("prefill")) == [
                "decode-0",
                "prefill-0",
            ]
            for first, stream in zip(firsts, streams, strict=True):
                rest = [t async for out in stream for t in out.delta_token_ids]
                assert first.delta_token_ids + rest == OUTPUT[:8]  # exact: nothing lost
            # The requests still running on decode-0 resumed on decode-1; decode-0 now prefills.
            moved = {r for r in cluster.decode["decode-1"].ids("reserve") if r.endswith("#2")}
            assert moved and moved <= {r.replace("#1", "#2") for r in on_d0}
            assert await tokens_of(coordinator, "after") == OUTPUT[:8]
            took = await coordinator.switch_role("decode-0", "decode")
            assert [w.pool for w in coordinator.supervisor.workers.values()].count("decode") == 2
            assert await tokens_of(coordinator, "back") == OUTPUT[:8]
            with pytest.raises(PoolError):
                await coordinator.switch_role("decode-1", "colocated")

    run(main())


def test_a_failed_role_switch_leaves_no_handle_behind(killed) -> None:
    """The switch takes the worker out of routing and keeps its handle for its new role; when
    `set_role` fails the worker is retired, and its handle goes with it (the prefill pool's
    handles are what decode workers' departures call `forget_peer` on)."""

    def cannot(role: str, worker_id: str):
        raise RuntimeError("no memory for the new role")

    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=2, num_decode=1)
        cluster.prefill["prefill-1"].make_role = cannot
        async with cluster.running() as coordinator:
            with pytest.raises(RuntimeError, match="no memory"):
                await coordinator.switch_role("prefill-1", "decode")
            assert "prefill-1" not in coordinator.prefill
            assert "prefill-1" not in coordinator.decode
            assert "prefill-1" not in coordinator.supervisor.workers
            assert await tokens_of(coordinator, "after") == OUTPUT[:8]

    run(main())


def test_a_reservation_cut_short_by_a_role_switch_is_placed_again(killed) -> None:
    # A worker whose role ends mid-call answers with an error of its own, not a dead actor's.
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=2)
        cluster.decoder("decode-0").reserve_seconds = 0.3
        async with cluster.running() as coordinator:
            stream = coordinator.generate(PROMPT, GREEDY, "req-0")
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.1)
            assert cluster.decode["decode-0"].ids("reserve") == ["req-0#1"]  # in flight there
            await coordinator.switch_role("decode-0", "prefill")
            out = await first
            rest = [t async for o in stream for t in o.delta_token_ids]
            assert out.delta_token_ids + rest == OUTPUT[:8]
            assert cluster.decode["decode-1"].ids("reserve")[-1].startswith("req-0#")

    run(main())


def test_a_reservation_cut_short_by_a_role_switch_costs_no_attempt(killed) -> None:
    """The switch lost the attempt while its reservation was out; placed again elsewhere in
    the same attempt, it must not end at once on that stale loss (a second reservation and
    prefill, the first ones aborted, and one of its MAX_ATTEMPTS spent for nothing)."""

    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=2)
        cluster.decoder("decode-0").reserve_seconds = 0.3
        async with cluster.running() as coordinator:
            task = asyncio.ensure_future(tokens_of(coordinator))
            await until(lambda: cluster.decode["decode-0"].ids("reserve") == ["req-0#1"])
            await coordinator.switch_role("decode-0", "prefill")
            assert await task == OUTPUT[:8]
            assert cluster.decode["decode-1"].ids("reserve") == ["req-0#1"]
            assert cluster.prefill["prefill-0"].ids("prefill") == ["req-0#1"]
            assert cluster.decode["decode-1"].ids("abort") == []

    run(main())


def test_a_worker_ray_cannot_place_fails_the_start_with_what_it_asked(killed) -> None:
    async def main() -> None:
        config = CoordinatorConfig(block_size=4, placement_timeout=0.05, supervision=SUPERVISION)
        cluster = FakeCluster(config, num_prefill=1, num_decode=1)
        cluster.prefiller().frozen = True  # never placed: ping() never answers

        def unplaced(workers):
            assert set(workers) == {"prefill-0", "decode-0"}
            return "Ray placed no process for prefill-0 within 0.05s: each worker asks for ..."

        cluster.coordinator._unplaced = unplaced
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="placed no process for prefill-0"):
            await cluster.coordinator.ready()
        assert time.monotonic() - started < 1.0

    run(main())


def test_slow_model_loading_is_not_a_placement_failure(killed) -> None:
    async def main() -> None:
        config = CoordinatorConfig(block_size=4, placement_timeout=0.01, supervision=SUPERVISION)
        cluster = FakeCluster(config)
        cluster.prefiller().ping_delay = 0.2  # placed, still loading its model
        cluster.coordinator._unplaced = lambda workers: None
        async with cluster.running() as coordinator:
            assert await tokens_of(coordinator) == OUTPUT[:8]

    run(main())


def test_a_role_switch_whose_caller_is_cancelled_still_ends(killed) -> None:
    """The planner's tick is cancelled when its mode changes, maybe mid-switch: the worker
    still ends in its new pool, routable and probed, instead of out of both for good."""

    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=2)
        cluster.decode["decode-0"].set_role_seconds = 0.3
        async with cluster.running() as coordinator:
            switch = asyncio.ensure_future(coordinator.switch_role("decode-0", "prefill"))
            await until(lambda: cluster.decode["decode-0"].calls["set_role"] != [])  # under way
            assert not switch.done()
            switch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await switch
            worker = coordinator.supervisor.workers["decode-0"]
            assert worker.pool == "prefill"  # counted in its new pool from the switch's start
            await until(lambda: worker.state.value == "serving")
            assert coordinator.router.is_alive("decode-0")
            assert await tokens_of(coordinator, "after") == OUTPUT[:8]

    run(main())


def test_a_spawn_that_raises_is_a_failed_start_and_is_tried_again(killed) -> None:
    """Ray's control plane refusing a new actor (a GCS hiccup) fails that start, not the task
    that keeps the pool at its size: the next try places the replacement."""

    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=2, spawn=True)
        async with cluster.running() as coordinator:
            supervisor = coordinator.supervisor
            spawn, refused = supervisor.spawn, []

            def flaky(pool: str):
                if not refused:
                    refused.append(pool)
                    raise ConnectionError("GCS unavailable")
                return spawn(pool)

            supervisor.spawn = flaky
            cluster.decode["decode-0"].dead = True
            await until(lambda: "decode-0" not in supervisor.workers)
            await until(lambda: len(supervisor.serving("decode")) == 2)
            assert refused == ["decode"] and cluster.spawned == ["decode-new0"]
            assert await tokens_of(coordinator, "after") == OUTPUT[:8]

    run(main())


def test_probing_goes_on_after_a_release_that_raises(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=3)
        async with cluster.running() as coordinator:
            supervisor = coordinator.supervisor

            def release(worker_id: str) -> None:
                raise ConnectionError(f"placement group of {worker_id}: GCS unavailable")

            supervisor.release = release
            cluster.decoder("decode-1").frozen = True
            await until(lambda: "decode-1" not in supervisor.workers)
            cluster.decoder("decode-2").frozen = True  # the probe loop still watches
            await until(lambda: "decode-2" not in supervisor.workers)
            assert await tokens_of(coordinator, "after") == OUTPUT[:8]

    run(main())


def test_the_stats_loop_survives_a_round_that_raises(killed, monkeypatch) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=1)
        async with cluster.running() as coordinator:
            observe, raised = coordinator.router.observe, []

            def observe_once_bad(*args) -> None:
                if not raised:
                    raised.append(args)
                    raise RuntimeError("a bad report")
                observe(*args)

            monkeypatch.setattr(coordinator.router, "observe", observe_once_bad)
            await until(lambda: bool(raised))
            calls = len(cluster.decode["decode-0"].calls["stats"])
            await until(lambda: len(cluster.decode["decode-0"].calls["stats"]) > calls + 2)

    run(main())


def test_a_pool_scaled_down_keeps_its_new_size_when_a_worker_dies(killed) -> None:
    """Scaling 2 -> 1 drains one worker; the pool's size is then 1, not 0: the last worker's
    death starts a replacement and readiness says the pool is short meanwhile (the drained
    worker's departure used to lower the size a second time, and the pool stayed empty)."""

    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=2, spawn=True)
        async with cluster.running() as coordinator:
            supervisor = coordinator.supervisor
            coordinator.scale({"decode": 1})
            await until(lambda: "decode-1" not in supervisor.workers)  # drained, left
            assert supervisor.pools["decode"].target == 1
            cluster.decode["decode-0"].dead = True
            await until(lambda: "decode-0" not in supervisor.workers)
            await until(lambda: len(supervisor.serving("decode")) == 1)
            assert cluster.spawned == ["decode-new0"] and coordinator.readiness() is None
            assert await tokens_of(coordinator, "after") == OUTPUT[:8]
            with pytest.raises(PoolError, match="no worker left"):  # the last one stays
                coordinator.drain("decode-new0")
            coordinator.scale({"decode": 2})
            await until(lambda: len(supervisor.serving("decode")) == 2)
            coordinator.drain("decode-new0")  # an explicit drain shrinks the pool by one
            assert supervisor.pools["decode"].target == 1

    run(main())


def test_starts_still_waiting_when_the_pool_shrinks_are_dropped(killed) -> None:
    """Growth held back by the restart rate (here 2 a minute), then a shrink: the starts that
    had not begun never begin (they used to load a model, and be killed, minutes later)."""

    async def main() -> None:
        supervision = replace(SUPERVISION, max_restarts_per_minute=2)
        cluster = FakeCluster(replace(CONFIG, supervision=supervision), num_decode=1, spawn=True)
        async with cluster.running() as coordinator:
            record = coordinator.supervisor.pools["decode"]
            coordinator.scale({"decode": 6})
            await until(lambda: len(cluster.spawned) == 2)  # the rate's worth, at once
            assert record.queued == 3  # the others wait for the rate
            coordinator.scale({"decode": 1})
            await until(lambda: record.starting == 0)
            await asyncio.sleep(0.2)
            assert len(cluster.spawned) == 2

    run(main())


def test_a_draining_worker_cannot_switch_roles(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=3)
        cluster.decoder("decode-1").stall_after = 2  # keeps a request: it drains, not leaves
        async with cluster.running() as coordinator:
            stream = coordinator.generate(PROMPT, GREEDY, "req-0")
            await anext(stream)
            holder = next(w for w in ("decode-0", "decode-1", "decode-2")
                          if cluster.decode[w].ids("reserve"))  # fmt: skip
            coordinator.drain(holder)
            with pytest.raises(PoolError, match="is draining, not serving"):
                await coordinator.switch_role(holder, "prefill")
            await stream.aclose()

    run(main())


def test_growth_the_machine_has_no_room_for_is_refused(killed) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=1, spawn=True)
        async with cluster.running() as coordinator:
            asked = []

            def room_for(more: dict[str, int]) -> str | None:
                asked.append(more)
                return "3 more workers need about 6.0 GiB and this machine has 2.0 GiB available"

            coordinator._room_for = room_for
            with pytest.raises(PoolError, match="need about 6.0 GiB"):
                coordinator.scale({"decode": 4, "prefill": 1})
            assert asked == [{"decode": 3}]  # only growth is asked about
            assert coordinator.supervisor.pools["decode"].target == 1 and not cluster.spawned

    run(main())


def test_a_request_whose_prefill_worker_switched_roles_meanwhile_is_retried(killed) -> None:
    """Its decode reservation was slow, and its prefill worker became a decode worker before
    it came back: the attempt is lost and retried (ending it once looked the worker up in
    the prefill pool it had left, and the request failed with a KeyError)."""

    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=2, num_decode=2)
        for worker in ("decode-0", "decode-1"):
            cluster.decoder(worker).reserve_seconds = 0.3
        async with cluster.running() as coordinator:
            task = asyncio.ensure_future(tokens_of(coordinator))
            await until(lambda: any(r.route for r in coordinator._requests.values()))
            [request] = coordinator._requests.values()
            await coordinator.switch_role(request.route.prefill_id, "decode")
            assert await task == OUTPUT[:8]

    run(main())


def test_a_pool_resized_while_a_worker_switches_out_keeps_its_size(killed) -> None:
    """decode-1 switches to prefill; meanwhile the decode pool is scaled to 1. The switch's
    end took one more off the decode target: 0, with decode-0 serving, and when decode-0 died
    nothing replaced it (and /ready still said all was well)."""

    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=2, spawn=True)
        cluster.decode["decode-1"].set_role_seconds = 0.2
        async with cluster.running() as coordinator:
            switch = asyncio.ensure_future(coordinator.switch_role("decode-1", "prefill"))
            await asyncio.sleep(0.05)
            assert coordinator.layout() == {"prefill": (1, 1), "decode": (1, 0)}  # on its way
            with pytest.raises(PoolError, match="starting, not serving"):
                coordinator.drain("decode-1")  # nothing to drain while it switches
            coordinator.scale({"decode": 1, "prefill": 2})  # what the pools hold by then
            await switch
            pools = coordinator.supervisor.pools
            assert {pool: record.target for pool, record in pools.items()} == {
                "prefill": 2,
                "decode": 1,
            }
            assert cluster.spawned == []  # nothing extra started
            cluster.decode["decode-0"].dead = True
            serving = coordinator.supervisor.serving
            await until(lambda: [w.worker_id for w in serving("decode")] == ["decode-new0"])
            assert await tokens_of(coordinator, "after") == OUTPUT[:8]

    run(main())


def test_a_probe_out_when_a_switch_begins_does_not_retire_the_worker(killed) -> None:
    """One missed probe, the next one out, then the switch: the probe's miss retired (killed)
    the worker mid-switch, and switch_role raised KeyError (a 404 "no worker" over HTTP)."""

    async def main() -> None:
        cluster = FakeCluster(
            replace(CONFIG, supervision=replace(SUPERVISION, probe_timeout=0.1)),
            num_prefill=1,
            num_decode=2,
            spawn=True,
        )
        handle = cluster.decode["decode-1"]
        handle.set_role_seconds = 0.3
        async with cluster.running() as coordinator:
            actor = cluster.decoder("decode-1")
            actor.frozen = True  # one slow health answer
            await until(lambda: coordinator.supervisor.workers["decode-1"].probe_failures == 1)
            probes = len(handle.calls["health"])
            await until(lambda: len(handle.calls["health"]) > probes)  # the next one is out
            actor.frozen = False
            await coordinator.switch_role("decode-1", "prefill")
            assert handle not in killed
            assert coordinator.supervisor.workers["decode-1"].pool == "prefill"

    run(main())
