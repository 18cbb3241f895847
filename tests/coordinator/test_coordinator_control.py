"""The Coordinator's control plane against fake workers: what a client streams when workers
answer, repeat themselves, fail, die, run out of room, or when the client leaves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import replace

import pytest
from ray.exceptions import RayActorError

import coordinator.coordinator as coordinator_module
from coordinator.coordinator import MAX_ATTEMPTS, Coordinator, CoordinatorConfig
from coordinator.request_state import TrackedRequest
from engine.outputs import RequestOutput
from protocol.errors import (
    EngineDeadError,
    InvalidOutputError,
    RequestError,
    RequestFailedError,
    TransferError,
)
from protocol.messages import WorkRequest
from protocol.sampling import SamplingParams
from tests.support.fake_workers import OUTPUT, FakeCluster, text_of

CONFIG = CoordinatorConfig(
    block_size=4,
    call_timeout=1.0,
    prefill_base_timeout=1.0,
    prefill_seconds_per_token=0.0,
    capacity_wait=0.1,
)
PROMPT = [1, 2, 3, 4, 5, 6]
TEST_TIMEOUT_S = 5.0


@pytest.fixture(autouse=True)
def killed(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Fast stats, and the handles shutdown() would ray.kill (which would start a cluster)."""
    monkeypatch.setattr(coordinator_module, "STATS_SECONDS", 60.0)  # only ready() refreshes
    handles: list[object] = []
    monkeypatch.setattr("ray.kill", handles.append)
    return handles


def run(coro: Coroutine) -> None:
    asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_S))


async def stream(
    coordinator: Coordinator, params: SamplingParams, request_id: str = "req-0"
) -> tuple[list[RequestOutput], Exception | None]:
    """Every output the client sees, and the error that ended the stream (if one did)."""
    outputs: list[RequestOutput] = []
    try:
        async for output in coordinator.generate(PROMPT, params, request_id):
            outputs.append(output)
    except Exception as err:
        return outputs, err
    return outputs, None


def streamed_tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.delta_token_ids]


def test_streams_exactly_the_output_with_first_token_from_prefill() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=5))
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:5]
        assert outputs[0].delta_token_ids[0] == OUTPUT[0]
        final = outputs[-1]
        assert (final.token_ids, final.text, final.finish_reason) == (
            OUTPUT[:5], text_of(OUTPUT[:5]), "length"
        )  # fmt: skip
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        [(work, _ticket)] = cluster.prefill["prefill-0"].calls["prefill"]
        assert work._replace(age_s=0.0) == WorkRequest(
            "req-0#1", PROMPT, SamplingParams(max_tokens=5), []
        )
        assert 0.0 < work.age_s < 5.0  # how long ago the request reached the coordinator
        assert cluster.decode["decode-0"].ids("reserve") == ["req-0#1"]
        assert "prefill" not in cluster.prefill["prefill-1"].calls
        assert cluster.decode["decode-0"].ids("abort") == []  # it finished there by itself

    run(main())


def test_repeated_batches_are_dropped() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        cluster.decoder().repeat = True  # every batch twice, the first one repeating the prefill
        cluster.decoder().batch = 3
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=7))
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:7]
        assert outputs[-1].token_ids == OUTPUT[:7]
        assert all(o.delta_token_ids for o in outputs[:-1])  # no empty output for a repeat

    run(main())


def test_first_token_streams_before_decode_reports_it() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        cluster.decoder().stall_after = 0  # the decode worker never reports a token
        async with cluster.running() as coordinator:
            tokens = coordinator.generate(PROMPT, SamplingParams(max_tokens=5), "req-0")
            first = await anext(tokens)
            await tokens.aclose()
        assert (first.delta_token_ids, first.text, first.finished) == ([OUTPUT[0]], "k", False)

    run(main())


def test_client_leaving_aborts_the_request_on_its_workers() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        cluster.decoder().stall_after = 3
        async with cluster.running() as coordinator:
            tokens = coordinator.generate(PROMPT, SamplingParams(max_tokens=8), "req-0")
            seen = [t async for t in _take_tokens(tokens, 3)]
            await tokens.aclose()
            assert seen == OUTPUT[:3]
            assert cluster.decode["decode-0"].ids("abort") == ["req-0#1"]  # sent at once
            # Its prefill was done: the request no longer involves the prefill worker.
            assert cluster.prefill["prefill-0"].ids("abort") == []
            for _ in range(100):  # the abort is sent, not awaited: it lands a turn later
                if not cluster.decoder().active:
                    break
                await asyncio.sleep(0.01)
            assert cluster.decoder().active == {}
            assert coordinator.router.decode["decode-0"].running == 0

    run(main())


def test_a_client_leaving_just_as_its_reservation_answers_ends_the_request() -> None:
    """The cancellation and the reply land in one turn of the loop: asyncio.wait_for (before
    Python 3.12) returned the reply and dropped the cancellation, so the request was prefilled
    and decoded to its end for nobody, and the client's close waited for all of it."""

    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        decoder = cluster.decoder()
        decoder.step_seconds = 0.1  # its 8 tokens take 0.4 s
        reserve = decoder.reserve

        async def reserve_as_the_client_leaves(*args):
            ticket = await reserve(*args)
            client.cancel()
            return ticket

        decoder.reserve = reserve_as_the_client_leaves
        async with cluster.running() as coordinator:
            client = asyncio.ensure_future(stream(coordinator, SamplingParams(max_tokens=8)))
            started = time.monotonic()
            await asyncio.wait({client})
            assert time.monotonic() - started < 0.2  # not the whole request's time
            assert cluster.prefill["prefill-0"].ids("prefill") == []
            assert cluster.decode["decode-0"].ids("abort") == ["req-0#1"]
            assert coordinator.router.decode["decode-0"].running == 0

    run(main())


async def _take_tokens(tokens, count: int):
    seen = 0
    async for output in tokens:
        for token in output.delta_token_ids:
            yield token
            seen += 1
        if seen >= count:
            return


def test_dead_prefill_worker_is_marked_dead_and_request_moves_to_the_other() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        async with cluster.running() as coordinator:
            cluster.prefill["prefill-0"].dead = True
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=4))
            assert not coordinator.router.is_alive("prefill-0")
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:4]
        assert cluster.prefill["prefill-1"].ids("prefill") == ["req-0#2"]
        assert cluster.decode["decode-0"].ids("reserve") == ["req-0#1", "req-0#2"]
        # The failed attempt's reservation is released; the dead worker is not called again.
        assert cluster.decode["decode-0"].ids("abort") == ["req-0#1"]
        assert "abort" not in cluster.prefill["prefill-0"].calls

    run(main())


def test_prefill_worker_dying_mid_request_resumes_elsewhere_with_output_so_far() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        cluster.decoder().failures = {"req-0#1": 2}  # attempt 1 is lost after two tokens
        cluster.prefiller("prefill-0").failures = {"req-0#2": RayActorError(error_msg="gone")}
        params = SamplingParams(max_tokens=6)
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, params)
            assert not coordinator.router.is_alive("prefill-0")
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:6]
        assert cluster.prefill["prefill-0"].ids("prefill") == ["req-0#1", "req-0#2"]
        [(resumed, _ticket)] = cluster.prefill["prefill-1"].calls["prefill"]
        assert resumed._replace(age_s=0.0) == WorkRequest("req-0#3", PROMPT, params, OUTPUT[:2])
        # A retry keeps the request's age: it arrived when the first attempt did.
        first = cluster.prefill["prefill-0"].calls["prefill"][0][0]
        assert resumed.age_s > first.age_s > 0.0

    run(main())


def test_request_failed_on_decode_is_retried_with_output_so_far() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1)
        cluster.decoder().failures = {"req-0#1": 2}
        params = SamplingParams(max_tokens=6)
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, params)
            assert coordinator.router.is_alive("decode-0")  # a lost request is not a dead worker
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:6]
        works = [args[0] for args in cluster.decode["decode-0"].calls["reserve"]]
        assert works == [
            WorkRequest("req-0#1", PROMPT, params, []),
            WorkRequest("req-0#2", PROMPT, params, OUTPUT[:2]),
        ]
        assert cluster.decode["decode-0"].ids("abort") == ["req-0#1"]

    run(main())


def test_client_gets_engine_dead_error_after_max_attempts() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1)
        attempts = [f"req-0#{n}" for n in range(1, MAX_ATTEMPTS + 1)]
        cluster.decoder().failures = dict.fromkeys(attempts, 1)  # one token, then lost
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=8))
        assert isinstance(err, EngineDeadError)
        assert str(err) == f"request failed {MAX_ATTEMPTS} times: kv cache lost"
        assert streamed_tokens(outputs) == OUTPUT[:MAX_ATTEMPTS]  # each attempt added one
        assert cluster.decode["decode-0"].ids("reserve") == attempts

    run(main())


def test_full_decode_pool_fails_the_request_after_capacity_wait() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        cluster.decoder().room = False
        async with cluster.running() as coordinator:
            started = time.monotonic()
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=4))
            waited = time.monotonic() - started
        assert outputs == []
        assert isinstance(err, EngineDeadError)
        assert str(err) == "no decode worker had room for the request in time"
        assert CONFIG.capacity_wait <= waited < CONFIG.capacity_wait + 1.0
        assert len(cluster.decode["decode-0"].calls["reserve"]) >= 2  # it kept asking
        assert "prefill" not in cluster.prefill["prefill-0"].calls

    run(main())


async def two_in_line(coordinator: Coordinator, params: SamplingParams) -> list[asyncio.Future]:
    """Requests "req-a" then "req-b", each sent once the one before waits in the decode-room
    line (their decode worker has no room)."""
    streams = []
    for i, request_id in enumerate(("req-a", "req-b")):
        streams.append(asyncio.ensure_future(stream(coordinator, params, request_id)))
        while len(coordinator.room) < i + 1:
            await asyncio.sleep(0.005)
    return streams


def test_requests_waiting_for_decode_room_get_in_first_come_first_served() -> None:
    async def main() -> None:
        cluster = FakeCluster(replace(CONFIG, capacity_wait=4.0))
        decoder = cluster.decoder()
        decoder.room = False
        params = SamplingParams(max_tokens=4)
        async with cluster.running() as coordinator:
            first, second = await two_in_line(coordinator, params)
            assert cluster.decode["decode-0"].ids("reserve") == [
                "req-a#1"
            ]  # b waits behind a, without asking
            decoder.room = True
            coordinator.room.freed()  # as a request ending there, or a stats report, would
            results = await asyncio.gather(first, second)
        for outputs, err in results:
            assert err is None and streamed_tokens(outputs) == OUTPUT[:4]
        assert cluster.decode["decode-0"].ids("reserve") == [
            "req-a#1",
            "req-a#1",
            "req-b#1",
        ]  # a passed it on
        assert len(coordinator.room) == 0

    run(main())


def test_a_waiter_whose_try_fails_passes_its_turn_on() -> None:
    """The first in line is woken and its reservation fails (not refused: the call itself
    fails). The next in line gets the turn at once (the failed attempt's end passes it on), not
    at the next stats poll (60 s here)."""

    async def main() -> None:
        cluster = FakeCluster(replace(CONFIG, capacity_wait=4.0))
        decoder = cluster.decoder()
        decoder.room = False
        reserve = decoder.reserve
        failed: list[str] = []

        async def failing_once_there_is_room(work, *args):
            if decoder.room and not failed:
                failed.append(work.request_id)
                raise RuntimeError("the reservation failed")
            return await reserve(work, *args)

        decoder.reserve = failing_once_there_is_room
        params = SamplingParams(max_tokens=4)
        async with cluster.running() as coordinator:
            first, second = await two_in_line(coordinator, params)
            decoder.room = True
            coordinator.room.freed()  # once, as one request ending there would
            started = time.monotonic()
            (_, error_a), (outputs_b, error_b) = await asyncio.gather(first, second)
            waited = time.monotonic() - started
        assert failed == ["req-a#1"]
        assert error_b is None and streamed_tokens(outputs_b) == OUTPUT[:4]
        assert waited < 1.0  # not the 4 s capacity wait
        assert error_a is None or "reservation failed" in str(error_a)

    run(main())


def test_dead_decode_pool_fails_the_request() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        async with cluster.running() as coordinator:
            cluster.decode["decode-0"].dead = True
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=4))
            assert not coordinator.router.is_alive("decode-0")
        assert outputs == []
        assert isinstance(err, EngineDeadError)
        assert str(err) == "no live decode worker"

    run(main())


def test_a_decode_worker_leaving_closes_the_prefill_workers_channels_to_it() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_decode=2)
        async with cluster.running() as coordinator:
            coordinator.supervisor.report_dead("decode-0", "killed")
            await asyncio.sleep(0.05)
            for handle in cluster.prefill.values():
                assert handle.calls["forget_peer"] == [("decode-0",)]
            coordinator.supervisor.report_dead("prefill-1", "killed")  # has no channels in
            await asyncio.sleep(0.05)
            assert cluster.prefill["prefill-0"].calls["forget_peer"] == [("decode-0",)]
            assert "forget_peer" not in cluster.decode["decode-1"].calls
            # The router forgets both (replacements come with new ids): no load, no cache
            # index kept for them, none scanned when routing.
            assert set(coordinator.router.decode) == {"decode-1"}
            assert set(coordinator.router.prefill) == {"prefill-0"}

    run(main())


def test_a_new_request_goes_to_the_decode_worker_running_fewer() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_decode=2)
        cluster.decoder("decode-0").stall_after = 1  # keeps the first request running
        params = SamplingParams(max_tokens=5)
        async with cluster.running() as coordinator:
            first = coordinator.generate(PROMPT, params, "req-a")
            assert (await anext(first)).delta_token_ids == [OUTPUT[0]]
            outputs, err = await stream(coordinator, params, "req-b")
            await first.aclose()
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:5]
        assert cluster.decode["decode-0"].ids("reserve") == ["req-a#1"]
        assert cluster.decode["decode-1"].ids("reserve") == ["req-b#1"]

    run(main())


def test_concurrent_requests_spread_over_decode_workers() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_decode=2)
        params = SamplingParams(max_tokens=5)
        async with cluster.running() as coordinator:
            results = await asyncio.gather(
                stream(coordinator, params, "req-a"), stream(coordinator, params, "req-b")
            )
        for outputs, err in results:
            assert err is None
            assert streamed_tokens(outputs) == OUTPUT[:5]
        assert cluster.decode["decode-0"].ids("reserve") == ["req-a#1"]
        assert cluster.decode["decode-1"].ids("reserve") == ["req-b#1"]

    run(main())


def test_stop_string_ends_the_stream_and_aborts_on_decode() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=8, stop=("m",)))
            await asyncio.sleep(0.05)  # the abort is sent from a task of its own
        assert err is None
        final = outputs[-1]
        assert (final.text, final.finish_reason, final.stop_reason) == ("kl", "stop", "m")
        assert "".join(o.delta_text for o in outputs) == "kl"
        assert cluster.decode["decode-0"].ids("abort") == ["req-0#1"]
        assert "abort" not in cluster.prefill["prefill-0"].calls

    run(main())


def test_a_stop_string_in_the_prefill_workers_token_aborts_on_decode() -> None:
    # The prefill worker's answer comes first (the decode worker holds its tokens back): the
    # stop string is found in the token it carries, and the decode worker must stop too.
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        cluster.decoder("decode-0").stall_after = 0
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=8, stop=("k",)))
            await asyncio.sleep(0.05)  # the abort is sent from a task of its own
        assert err is None
        assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", "k")
        assert cluster.decode["decode-0"].ids("abort") == ["req-0#1"]

    run(main())


def test_an_attempt_ended_before_its_prefill_leaves_no_queued_prompt_behind() -> None:
    # Routing counts the prompt in its prefill worker's queue as soon as it is placed; a client
    # that leaves during the reservation ends the attempt before the prefill call, which used
    # to be the only place that took it off again (the worker then looked busy for good).
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        cluster.decoder().reserve_seconds = 0.5
        async with cluster.running() as coordinator:
            outputs = coordinator.generate(PROMPT, SamplingParams(max_tokens=4), "req-0")
            first = asyncio.ensure_future(anext(outputs))
            await asyncio.sleep(0.1)  # placed, reserving
            queues = [w.queued_tokens for w in coordinator.router.prefill.values()]
            assert sorted(queues) == [0, len(PROMPT)]
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await outputs.aclose()
            await asyncio.sleep(0.05)
            assert [w.queued_tokens for w in coordinator.router.prefill.values()] == [0, 0]
            assert coordinator.router.decode["decode-0"].running == 0

    run(main())


def test_eos_as_first_token_is_streamed_once_as_a_stop() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, eos_ids=frozenset({OUTPUT[0]}))
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=4))
        assert err is None
        [only] = outputs
        assert (only.token_ids, only.text, only.finish_reason) == ([OUTPUT[0]], "", "stop")
        assert only.stop_reason is None  # EOS: no stop token the request named, as in vLLM

    run(main())


def test_prefill_timeout_loses_the_attempt_but_not_the_worker() -> None:
    async def main() -> None:
        config = CoordinatorConfig(
            block_size=4, call_timeout=1.0, prefill_base_timeout=0.05, prefill_seconds_per_token=0.0
        )
        cluster = FakeCluster(config, num_prefill=1)
        cluster.prefiller().hangs = {"req-0#1"}
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=3))
            assert coordinator.router.is_alive("prefill-0")
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:3]
        assert cluster.prefill["prefill-0"].ids("prefill") == ["req-0#1", "req-0#2"]
        assert cluster.prefill["prefill-0"].ids("abort") == ["req-0#1"]
        assert cluster.decode["decode-0"].ids("abort") == ["req-0#1"]

    run(main())


def test_retry_after_a_prefill_timeout_succeeds_on_the_other_prefill_worker() -> None:
    async def main() -> None:
        config = CoordinatorConfig(
            block_size=4, call_timeout=1.0, prefill_base_timeout=0.05, prefill_seconds_per_token=0.0
        )
        cluster = FakeCluster(config)
        cluster.prefiller("prefill-0").hangs = {f"req-0#{n}" for n in range(1, MAX_ATTEMPTS + 1)}
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=3))
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:3]

    run(main())


def test_local_prefill_skips_the_prefill_pool() -> None:
    async def main() -> None:
        config = CoordinatorConfig(block_size=4, local_prefill_threshold=64)
        cluster = FakeCluster(config)
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=4))
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:4]
        assert cluster.decode["decode-0"].ids("add_local") == ["req-0#1"]
        assert "reserve" not in cluster.decode["decode-0"].calls
        assert all("prefill" not in handle.calls for handle in cluster.prefill.values())

    run(main())


def test_shutdown_fails_requests_in_flight_and_kills_every_worker(killed: list[object]) -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        cluster.decoder().stall_after = 1
        coordinator = cluster.coordinator
        await coordinator.ready()
        tokens = coordinator.generate(PROMPT, SamplingParams(max_tokens=8), "req-0")
        first = await anext(tokens)
        await coordinator.shutdown()
        with pytest.raises(EngineDeadError, match="the server is shutting down"):
            await anext(tokens)
        assert first.delta_token_ids == [OUTPUT[0]]
        assert killed == [*cluster.prefill.values(), *cluster.decode.values()]

    run(main())


def test_invalid_prompt_is_refused_before_any_worker_is_called() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        async with cluster.running() as coordinator:
            with pytest.raises(RequestError, match="the prompt is empty"):
                await anext(coordinator.generate([], SamplingParams(), "req-0"))
        assert "reserve" not in cluster.decode["decode-0"].calls

    run(main())


def test_ready_takes_the_smallest_context_and_worker_stats() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        cluster.decoder().free_blocks = 42
        cluster.prefiller("prefill-1").max_model_len = 8
        async with cluster.running() as coordinator:
            assert coordinator.max_model_len == 8
            with pytest.raises(RequestError, match="at most 8 tokens"):
                coordinator.check_request(list(range(8)))
            stats = {s.worker: s.num_free_blocks for s in coordinator.stats()}
            assert stats == {"prefill-0": 100, "prefill-1": 100, "decode-0": 42}
            assert coordinator.router.decode["decode-0"].free_blocks == 42

    run(main())


def test_shutdown_places_no_new_attempt() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        cluster.decoder().stall_after = 1
        coordinator = cluster.coordinator
        await coordinator.ready()
        tokens = coordinator.generate(PROMPT, SamplingParams(max_tokens=8), "req-0")
        await anext(tokens)
        await coordinator.shutdown()
        await asyncio.sleep(0.05)  # a client that is slow to read the failure
        assert cluster.decode["decode-0"].ids("reserve") == ["req-0#1"]
        await tokens.aclose()

    run(main())


def test_a_stream_interval_sends_tokens_in_fours_after_the_first() -> None:
    async def main() -> None:
        cluster = FakeCluster(replace(CONFIG, stream_interval=4))
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=8))
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:8]
        assert len(outputs[0].delta_token_ids) <= 2  # the first update goes at once
        assert all(len(o.delta_token_ids) >= 4 for o in outputs[1:-1])
        assert len(outputs) <= 3  # the first, then 4, then the rest with the finish
        assert outputs[-1].finish_reason == "length" and outputs[-1].text == text_of(OUTPUT[:8])

    run(main())


def test_a_disaggregated_request_reports_its_prefill_workers_queue_time() -> None:
    # The decode worker only received the KV: the wait that counts was for the prefill.
    async def main() -> None:
        cluster = FakeCluster(CONFIG)
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=3))
        assert err is None
        # (the decode worker's first update may overtake the prefill worker's answer)
        assert {o.queue_seconds for o in outputs} - {None} == {0.375}
        assert outputs[-1].queue_seconds == 0.375

    run(main())


@pytest.mark.parametrize(
    "error,raised", [(InvalidOutputError("bad schema"), True), (OSError("channel gone"), False)]
)
def test_a_lost_attempt_still_hears_its_prefill_workers_verdict(error, raised) -> None:
    """The decode worker may report a prefill worker's abort before the prefill call fails: the
    request's own fault (a 400, no retry) still wins; a failure of another kind stays a loss."""
    from coordinator.request_state import TrackedRequest
    from tests.support.fake_workers import FakeTokenizer

    async def go():
        request = TrackedRequest("r", [1, 2], SamplingParams(), FakeTokenizer())
        request.next_attempt()

        async def prefill():
            await asyncio.sleep(0.05)
            raise error

        request.lose("prefill aborted: bad schema")  # (the decode worker's report came first)
        return await Coordinator._unless_lost(request, prefill(), verdict_s=2.0)

    if raised:
        with pytest.raises(InvalidOutputError, match="bad schema"):
            asyncio.run(go())
    else:
        assert asyncio.run(go()) is None


def test_a_stop_string_found_in_held_tokens_as_a_request_fails_frees_its_seat() -> None:
    # Attempt 1 streams "k" and holds "l", "m" (a stream interval of 4), then is lost; attempt
    # 2's prefill fails for good. Failing flushes the held text, where the stop string "lm"
    # ends the request: its attempt must still give back the decode seat it reserved.
    async def main() -> None:
        cluster = FakeCluster(replace(CONFIG, stream_interval=4), num_prefill=1)
        cluster.decoder().failures = {"req-0#1": 3}
        cluster.prefiller().failures = {"req-0#2": InvalidOutputError("bad schema")}
        async with cluster.running() as coordinator:
            outputs, _ = await stream(coordinator, SamplingParams(max_tokens=8, stop=["lm"]))
            await asyncio.sleep(0.05)  # the aborts are sent, not awaited
        assert "".join(o.delta_text for o in outputs) == "k"
        assert outputs[-1].finish_reason == "stop"
        assert cluster.decode["decode-0"].ids("reserve") == ["req-0#1", "req-0#2"]
        assert "req-0#2" in cluster.decode["decode-0"].ids("abort")

    run(main())


def test_a_reservation_asks_to_be_held_as_long_as_its_prefill_may_take() -> None:
    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1)
        async with cluster.running() as coordinator:
            _, err = await stream(coordinator, SamplingParams(max_tokens=2))
        assert err is None
        [(work, prefill_id, _key, _tp, lease_s)] = cluster.decode["decode-0"].calls["reserve"]
        assert lease_s == CONFIG.prefill_timeout(len(PROMPT)) and prefill_id == "prefill-0"

    run(main())


def test_a_decode_worker_too_slow_to_reserve_is_not_tried_again() -> None:
    """Its reservation timed out and the retry went back to it (its load read 0 again), four
    times, while the other decode worker idled: the client got an error."""

    async def main() -> None:
        cluster = FakeCluster(replace(CONFIG, call_timeout=0.2), num_decode=2)
        cluster.decoder("decode-0").reserve_seconds = 10.0  # a long step; health answers fine
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=3))
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:3]
        assert cluster.decode["decode-0"].ids("reserve") == ["req-0#1"]
        assert cluster.decode["decode-1"].ids("reserve") == ["req-0#2"]

    run(main())


def test_a_prefill_timeout_keeps_the_kv_channel_and_a_transfer_error_replaces_it() -> None:
    """Any failed prefill marked the pair's channel broken, and the retry's reservation made
    the decode worker retire it: every other transfer on it failed with the one timeout."""

    async def main(error: Exception | None) -> list[object]:
        config = replace(CONFIG, prefill_base_timeout=0.05)
        cluster = FakeCluster(config, num_prefill=1)
        if error is None:
            cluster.prefiller().hangs = {"req-0#1"}  # slow: a timeout, nothing wrong on the wire
        else:
            cluster.prefiller().failures = {"req-0#1": error}
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=3))
        assert err is None and streamed_tokens(outputs) == OUTPUT[:3]
        return [call[2] for call in cluster.decode["decode-0"].calls["reserve"]]

    timed_out = asyncio.run(asyncio.wait_for(main(None), TEST_TIMEOUT_S))
    assert timed_out == [None, None]  # the retry reserves on the same, healthy channel
    broke = asyncio.run(asyncio.wait_for(main(TransferError("peer gone")), TEST_TIMEOUT_S))
    assert broke[0] is None and broke[1] is not None  # the retry asks for a new channel


def test_a_lost_attempt_whose_last_token_arrived_is_not_retried_for_more() -> None:
    """The prefill worker's token was the last max_tokens allowed; the decode worker lost the
    attempt before reporting the finish. The retry sampled one more: the client got two
    tokens for max_tokens=1."""

    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=1)
        cluster.decoder().failures = {"req-0#1": 0}  # lost before it reports a token
        async with cluster.running() as coordinator:
            outputs, err = await stream(coordinator, SamplingParams(max_tokens=1))
        assert err is None
        assert streamed_tokens(outputs) == OUTPUT[:1]
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert cluster.prefill["prefill-0"].ids("prefill") == ["req-0#1"]

    run(main())


def test_an_update_that_breaks_one_request_fails_it_alone(monkeypatch) -> None:
    """An exception while folding one request's tokens in (its detokenizer, its stop strings)
    ended the decode worker's whole update stream: the worker was reported dead and every
    request on it was retried."""
    accept = TrackedRequest.accept

    def breaks_for_bad(self, update):
        if self.request_id == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return accept(self, update)

    monkeypatch.setattr(TrackedRequest, "accept", breaks_for_bad)

    async def main() -> None:
        cluster = FakeCluster(CONFIG, num_prefill=1, num_decode=1)
        async with cluster.running() as coordinator:
            (good, good_err), (bad, bad_err) = await asyncio.gather(
                stream(coordinator, SamplingParams(max_tokens=6), "good"),
                stream(coordinator, SamplingParams(max_tokens=6), "bad"),
            )
            assert coordinator.router.is_alive("decode-0")
        assert good_err is None and streamed_tokens(good) == OUTPUT[:6]
        assert isinstance(bad_err, RequestFailedError)
        assert "could not be processed" in str(bad_err)
        assert "bad#1" in cluster.decode["decode-0"].ids("abort")
        assert cluster.decode["decode-0"].ids("reserve") == ["good#1", "bad#1"]  # no retry

    run(main())
