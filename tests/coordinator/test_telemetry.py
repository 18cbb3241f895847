"""Step telemetry and prefix-cache reports: the worker's logs, what the coordinator keeps, and
an end-to-end run where the router learns each worker's cache from the workers themselves."""

from __future__ import annotations

import asyncio

import pytest
import torch

from coordinator.coordinator import CoordinatorConfig
from coordinator.router import prefix_hashes
from coordinator.supervisor import SupervisorConfig
from coordinator.telemetry import TelemetryStore
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.llm import LLM
from protocol.sampling import SamplingParams
from protocol.telemetry import PrefixEvent, SeqLog, StepRecord, Telemetry, read_telemetry
from tests.support.local_cluster import local_cluster
from tests.support.transports import close_transport, transport_named


def test_seq_log_hands_out_what_follows_a_cursor_and_says_when_it_lost_some() -> None:
    log: SeqLog[int] = SeqLog(capacity=3)
    assert log.since(0) == (0, [], True)
    for item in (10, 11):
        log.append(item)
    assert log.since(0) == (2, [10, 11], True)
    assert log.since(1) == (2, [11], True)
    assert log.since(2) == (2, [], True)
    for item in (12, 13, 14):
        log.append(item)  # 10 and 11 fall out
    assert log.since(1) == (5, [12, 13, 14], False)
    assert log.since(3) == (5, [13, 14], True)


def test_a_reader_cut_off_from_the_cache_events_gets_a_snapshot_instead() -> None:
    steps: SeqLog[StepRecord] = SeqLog(4)
    prefix: SeqLog[PrefixEvent] = SeqLog(2)
    for digest in (1, 2, 3):
        prefix.append(PrefixEvent(digest, True))
    reply = read_telemetry(steps, prefix, lambda: [2, 3], 0, 0)
    assert reply.prefix_snapshot == [2, 3] and reply.prefix_events == []
    assert reply.prefix_seq == 3
    reply = read_telemetry(steps, prefix, lambda: [2, 3], 0, 1)  # 1 is still kept
    assert reply.prefix_snapshot is None
    assert [e.digest for e in reply.prefix_events] == [2, 3]


def test_store_keeps_the_latest_state_of_each_block_and_counts_missed_steps() -> None:
    store = TelemetryStore()
    record = StepRecord(0.0, 0.01, 8, 64, 2, 30, 5, 0)
    events = [PrefixEvent(7, True), PrefixEvent(8, True), PrefixEvent(7, False)]
    events += [PrefixEvent(9, False), PrefixEvent(9, True)]
    report = store.apply("w", Telemetry(12, [record], 3, 5, events, None))
    assert sorted(report.stored) == [8, 9] and report.evicted == [7]
    assert store.cursor("w") == (12, 5)
    kept = store.recent("w")["w"]
    assert kept["steps_total"] == 1 and kept["steps_missed"] == 3
    assert kept["steps"] == [record._asdict()]
    snapshot = store.apply("w", Telemetry(12, [], 0, 9, [], [4, 5]))
    assert snapshot.snapshot and snapshot.stored == [4, 5]


def test_every_step_record_reaches_the_planner_once_however_late_its_reply() -> None:
    # Worker b's reply comes a poll late (or its host's clock lags): its step ended before
    # worker a's latest. A cursor on step end times dropped it.
    store = TelemetryStore()
    a = [StepRecord(100.0, 0.01, 0, 0, 4, 40, 5, 0), StepRecord(101.0, 0.01, 0, 0, 4, 40, 5, 0)]
    b = StepRecord(100.5, 0.02, 0, 0, 4, 40, 5, 0)
    store.apply("a", Telemetry(2, a, 0, 0, [], None))
    assert store.take_steps() == a
    store.apply("b", Telemetry(1, [b], 0, 0, [], None))
    assert store.take_steps() == [b]
    assert store.take_steps() == []


def test_block_manager_reports_blocks_entering_and_leaving_its_prefix_cache() -> None:
    events: list[tuple[int, bool]] = []
    blocks = BlockManager(num_blocks=2, block_size=4)
    blocks.on_cache_change = lambda digests, stored: events.extend((d, stored) for d in digests)
    tokens = list(range(8))
    table = blocks.allocate(2)
    blocks.cache_full_blocks(table, tokens, 0, 2)
    digests = prefix_hashes(tokens, 4)
    assert events == [(digests[0], True), (digests[1], True)]
    blocks.free_blocks(table)  # cached, still held by the cache: no event
    assert len(events) == 2
    blocks.allocate(1)  # evicts the block freed first: the tail (freeing goes tail first)
    assert events[-1] == (digests[1], False)


def test_every_engine_step_leaves_one_record_with_its_shape(tiny_llama) -> None:
    llm = LLM(tiny_llama, dtype="float32", block_size=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate_ids([list(range(1, 11)), list(range(20, 26))], params)
    _, records, complete = llm.engine.step_log.since(0)
    assert complete
    first, *rest = records
    # One step prefills both prompts (10 + 6 tokens) and samples their first tokens.
    assert (first.prefill_tokens, first.decode_seqs) == (16, 0)
    assert first.prefill_attention == 10 * 10 + 6 * 6
    # Then two decode steps of both sequences, each a token longer.
    assert [(r.decode_seqs, r.decode_context, r.prefill_tokens) for r in rest] == [
        (2, 11 + 7, 0),
        (2, 12 + 8, 0),
    ]
    assert all(r.seconds > 0 for r in records)
    assert {r.threads for r in records} == {torch.get_num_threads()}  # this thread steps
    _, events, _ = llm.engine.prefix_log.since(0)
    assert [e.digest for e in events if e.stored][:2] == prefix_hashes(list(range(1, 11)), 4)


@pytest.mark.parametrize("routing", ["load", "cost"])
def test_router_learns_each_workers_cache_from_its_reports(
    tiny_llama, routing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The supervisor kills its workers with ray.kill at shutdown, which would start a Ray
    # cluster in this process (these workers are local objects, not actors).
    monkeypatch.setattr("ray.kill", lambda handle: None)
    config = EngineConfig(
        tiny_llama, dtype="float32", block_size=4, num_kv_blocks=96, max_num_batched_tokens=64
    )
    coordinator_config = CoordinatorConfig(
        block_size=4,
        routing=routing,
        supervision=SupervisorConfig(probe_interval=0.25, probe_timeout=5.0),
    )
    prompt = list(range(1, 14))  # 3 full blocks and a partial one
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    digests = set(prefix_hashes(prompt, 4))
    sending, receiving = transport_named("gloo"), transport_named("gloo")

    async def scenario():
        async with local_cluster(config, sending, receiving, 10.0, coordinator_config) as (
            coordinator,
            _,
            _,
        ):
            async for _ in coordinator.generate(prompt, params):
                pass
            for _ in range(100):  # reports arrive once per stats poll (1 s); 10 s at most
                known = coordinator.router.decode["decode-0"].cached
                if digests <= known and coordinator.telemetry.recent().get("decode-0"):
                    break
                await asyncio.sleep(0.1)
            return coordinator.router, coordinator.telemetry.recent()

    try:
        router, recent = asyncio.run(scenario())
    finally:
        close_transport(sending)
        close_transport(receiving)
    assert digests <= router.prefill["prefill-0"].cached  # it computed them
    assert digests <= router.decode["decode-0"].cached  # they arrived there
    prefill_steps = recent["prefill-0"]["steps"]
    assert sum(s["prefill_tokens"] for s in prefill_steps) == len(prompt)
    decode_steps = recent["decode-0"]["steps"]
    assert [s["decode_seqs"] for s in decode_steps] == [1, 1, 1]  # tokens 2-4 of 4
