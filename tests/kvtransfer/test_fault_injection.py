"""The KV handoff fails closed: faults injected into the transfer (kvtransfer/faults.py), under a
concurrent greedy load through the real Coordinator and workers (tests/support/local_cluster.py),
over every transport.

For every case: every request completes with exactly the tokens a colocated engine produces
(a failed attempt is retried, or recomputed on the decode worker), none runs past its deadline,
the workers stay up, and every KV block is free again on both sides.

    case               what happens on the wire                  what ends it
    corrupt once       one payload has a bit flipped             checksum mismatch -> retry
    corrupt always     every payload from the first on           2 mismatches -> local recompute
    drop               one payload lost on the wire              its receive's deadline ->
                                                                 the channel closes -> retry
    duplicate          one payload arrives twice                 nothing: the copy carries the
                                                                 same message number and is
                                                                 never received; exact output
    cut                the channel closes mid-layer              channel error -> retry
    corrupt frame      one frame (step, done) has a bit flipped  its CRC-32 fails -> the
                                                                 channel closes -> retry
    delay (in lease)   one payload 0.3 s late                    nothing: exact output
    delay (past lease) one payload later than the lease           receive deadline / lease
                                                                 expiry -> retry

tests/kvtransfer/test_fencing.py shows that bytes of an abandoned attempt never land.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from coordinator.coordinator import CoordinatorConfig
from coordinator.supervisor import SupervisorConfig
from engine.config import EngineConfig
from engine.llm import LLM
from kvtransfer.faults import Fault, FaultyTransport
from protocol.sampling import SamplingParams
from tests.support.local_cluster import local_cluster
from tests.support.prompts import mixed_prompts
from tests.support.transports import TRANSPORTS, close_transport, transport_named

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
NUM_REQUESTS = 6
LEASE_S = 1.5  # the decode worker's reservation lease, and the transfer's receive deadline
DEADLINE_S = 40.0  # per case: every request must be done by then


@dataclass(frozen=True)
class Case:
    fault: Fault
    on_payload: int = 2
    every: bool = False
    delay: float = 0.0
    retried: bool = True  # the fault costs an attempt
    corrupt: range = range(0, 1)  # checksum failures the decode worker reports
    step_tokens: int = 64  # the prefill step's token budget


CASES = {
    "corrupt once": Case(Fault.CORRUPT, corrupt=range(1, 2)),
    # A payload carries a step's chunks on one channel: a flipped bit fails the one it lands in,
    # so requests that shared a step with it may arrive whole. At least one fails twice and is
    # recomputed locally (asserted below); none fails more than twice.
    "corrupt always": Case(
        Fault.CORRUPT, on_payload=0, every=True, corrupt=range(2, 2 * NUM_REQUESTS + 1)
    ),
    "drop": Case(Fault.DROP),
    "duplicate": Case(Fault.DUPLICATE, retried=False),
    "cut": Case(Fault.CUT),
    # (16-token steps: the 29- and 54-token prompts come in chunks, some starting past token 0,
    # however the requests happen to arrive)
    "corrupt frame": Case(Fault.CORRUPT_FRAME, on_payload=0, step_tokens=16),
    "delay within lease": Case(Fault.DELAY, delay=0.3, retried=False),
    "delay past lease": Case(Fault.DELAY, delay=LEASE_S + 1.0),
}


@pytest.fixture(autouse=True)
def no_ray_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ray.kill", lambda handle: None)  # the local handles are not actors


@pytest.fixture(scope="module")
def prompts_and_expected(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    prompts = mixed_prompts(llm.engine.model_config.vocab_size, count=NUM_REQUESTS, seed=11)
    expected = [out.token_ids for out in llm.generate_ids(prompts, GREEDY)]
    return prompts, expected


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", list(CASES))
def test_a_fault_in_the_handoff_never_reaches_the_output(
    tiny_llama, prompts_and_expected, name: str, transport: str
) -> None:
    case = CASES[name]
    prompts, expected = prompts_and_expected
    config = EngineConfig(
        tiny_llama,
        dtype="float32",
        block_size=4,
        num_kv_blocks=96,
        max_num_batched_tokens=case.step_tokens,
    )
    faulty = FaultyTransport(
        transport_named(transport), case.fault, case.on_payload, case.every, case.delay
    )
    receiving = transport_named(transport)
    coordinator_config = CoordinatorConfig(
        block_size=4, supervision=SupervisorConfig(probe_interval=0.25, probe_timeout=5.0)
    )

    async def scenario():
        async with local_cluster(config, faulty, receiving, LEASE_S, coordinator_config) as (
            coordinator,
            prefill,
            decode,
        ):
            started = time.monotonic()
            outputs = await asyncio.wait_for(
                asyncio.gather(*(_generate(coordinator, p) for p in prompts)), DEADLINE_S
            )
            elapsed = time.monotonic() - started
            stats = await decode.stats()
            prefill_stats = await prefill.stats()
            health = [await prefill.health(), await decode.health()]
            return outputs, elapsed, stats, prefill_stats, health

    try:
        outputs, elapsed, stats, prefill_stats, health = asyncio.run(scenario())
    finally:
        close_transport(faulty)
        close_transport(receiving)
    assert outputs == expected  # 0 wrong tokens
    assert elapsed < DEADLINE_S
    assert faulty.injected >= 1
    assert all(h.alive for h in health)  # neither side crashed
    assert stats.kv_checksum_failures in case.corrupt
    failures = stats.kv_transfer_failures + prefill_stats.kv_transfer_failures  # either side saw it
    if case.retried:
        assert failures >= 1
    else:
        assert failures == 0
    if case.every:  # recomputed on the decode worker after two corrupt transfers
        assert stats.requests_prefilled_locally >= 1
    for worker in (stats, prefill_stats):  # KV usage back to 0, read before shutdown frees it
        assert worker.num_free_blocks == worker.num_total_blocks


async def _generate(coordinator, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for output in coordinator.generate(prompt, GREEDY):
        tokens = output.token_ids
    return tokens
