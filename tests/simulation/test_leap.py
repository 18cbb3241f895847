"""Leaping over decode steps (simulation/leap.py): the block math of one leap at block_size=4,
and whole simulations that come out the same, token time for token time, with leaps on and off
(with prefix caching, preemption, a dead worker and a role switch in play)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from loadtest.config import DatasetConfig, LoadConfig, PrefixRepetitionSpec, RandomSpec
from planning.cost_model import StepCostModel
from planning.nnls import FitStats
from planning.transfer_model import TransferCostModel
from protocol.kv import KVLayout
from protocol.sampling import SamplingParams
from simulation.cluster import Outcome, Simulation
from simulation.deployment import Costs, Deployment, EngineLimits, Fault, Overheads, Scenario
from simulation.leap import cut, plan_leap, settle
from simulation.workload import SimRequest, synthetic_requests

PROFILES = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles"
PROFILE = PROFILES / "smollm2-cpu-1thread.json"


def ones(num_seqs: int, contexts: np.ndarray) -> np.ndarray:
    return np.ones(len(contexts))


def decoding(scheduler: Scheduler, request_id: str, num_computed: int) -> Sequence:
    """A running sequence with KV for `num_computed` tokens and one more token to compute."""
    seq = Sequence(request_id, list(range(num_computed)), num_computed, SamplingParams())
    seq.block_table = scheduler.blocks.allocate(-(-num_computed // 4))
    scheduler.add_running(seq)
    seq.token_ids.append(1000 + num_computed)  # what the last step sampled
    return seq


def test_a_leap_takes_a_block_when_a_token_starts_one_and_caches_a_block_when_it_fills():
    scheduler = Scheduler(SchedulerConfig(8, 64), BlockManager(16, 4))
    a = decoding(scheduler, "a", 6)  # blocks for tokens 0-7; step i computes token 6 + i
    b = decoding(scheduler, "b", 9)  # blocks for tokens 0-11; step i computes token 9 + i
    leap = plan_leap(scheduler, 6, 0.0, 0.5, ones)
    assert leap is not None and leap.num_steps == 6
    # token 8 of a, token 12 of b start a block; tokens 7 and 11 of a, 11 of b end one
    assert [leap.growing(step) for step in range(6)] == [[], [], [0], [1], [], []]
    assert [leap.filling(step) for step in range(6)] == [[], [0], [1], [], [], [0]]
    assert leap.blocks_left == 2
    assert leap.starts == [0.0, 1.5, 3.0, 4.5, 6.0, 7.5]
    delivered: list[tuple[str, list[float]]] = []

    def deliver(seqs: list[Sequence], ends: list[float]) -> None:
        for seq in seqs:
            delivered.append((seq.request_id, list(ends)))
            seq.token_ids.extend(range(len(ends)))

    assert settle(leap, scheduler, 0.0, deliver) == []  # step 0 started, nothing ended
    assert settle(leap, scheduler, 4.6, deliver) == [1.0, 1.0, 1.0]  # 0-2 ended, 3 began
    assert delivered == [("a", [1.0, 2.5, 4.0]), ("b", [1.0, 2.5, 4.0])]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (9, 12)
    assert (len(a.block_table), len(b.block_table)) == (3, 4)
    assert (a.num_hashed_blocks, b.num_hashed_blocks) == (2, 3)
    cut(leap)  # something joins the batch: the leap ends with step 3
    assert leap.num_steps == 4 and leap.end == 5.5
    assert settle(leap, scheduler, 100.0, deliver) == [1.0]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (10, 13)
    assert scheduler.blocks.num_free_blocks == 16 - 7  # 5 at the start, then steps 2 and 3


def test_a_leap_stops_before_the_blocks_run_out_and_never_leaps_a_prefill():
    scheduler = Scheduler(SchedulerConfig(8, 64), BlockManager(5, 4))
    decoding(scheduler, "a", 4)  # 1 full block: takes one at steps 0, 4, 8
    decoding(scheduler, "b", 4)
    leap = plan_leap(scheduler, 20, 0.0, 0.0, ones)
    assert leap is not None and leap.num_steps == 4  # step 4 would need 2 blocks, 1 is free
    scheduler.add(Sequence("c", [1, 2, 3], 3, SamplingParams()))
    assert plan_leap(scheduler, 20, 0.0, 0.0, ones) is None


def the_same_with_and_without_leaps(make: Callable[[bool], Simulation]) -> tuple[Outcome, Outcome]:
    outcomes = []
    for leaping in (False, True):
        sim = make(leaping)
        outcomes.append(sim.run())
    stepped, leapt = outcomes
    for a, b in zip(stepped.runs, leapt.runs, strict=True):
        assert (a.first_token_at, a.finished_at, a.attempts, a.error) == (
            b.first_token_at,
            b.finished_at,
            b.attempts,
            b.error,
        )
        assert list(a.token_times) == list(b.token_times)
    for worker_id, a in stepped.workers.items():
        b = leapt.workers[worker_id]
        assert (a.busy_seconds, a.num_steps) == (b.busy_seconds, b.num_steps)
        assert (list(a.blocks.free), list(a.blocks.evictable)) == (
            list(b.blocks.free),
            list(b.blocks.evictable),
        )
        assert a.blocks.prefix_hits == b.blocks.prefix_hits
    assert leapt.num_events < stepped.num_events
    return stepped, leapt


def smollm2_costs(transfer: bool) -> Costs:
    step = StepCostModel.load(PROFILE)
    if not transfer:
        return Costs(step)
    gloo = TransferCostModel(50e-6, 1 / 3e9, FitStats(1, 0.0, 0, None))
    return Costs(step, gloo, KVLayout(30, 3, 64, "bfloat16"))


def test_leaps_change_nothing_disaggregated_with_prefix_caching():
    def make(leaping: bool) -> Simulation:
        engine = EngineLimits(num_blocks=600, max_num_batched_tokens=512)
        overheads = Overheads(step_gap=0.001, dispatch=0.002, handover=0.001, delivery=0.0005)
        sc = Scenario(Deployment(1, 2, engine, "cost"), smollm2_costs(True), overheads)
        load = LoadConfig(request_rate=6.0, max_concurrency=12, seed=3)
        spec = PrefixRepetitionSpec(num_prefixes=4, prefix_len=192, suffix_len=48, output_len=124)
        requests = synthetic_requests(DatasetConfig(spec, 80, seed=3), load)
        return Simulation(sc, requests, load, leaping=leaping)

    stepped, leapt = the_same_with_and_without_leaps(make)
    assert leapt.num_events < stepped.num_events / 3


@pytest.mark.parametrize("num_blocks", [300, 120])  # 120: the pool fills, steps preempt
def test_leaps_change_nothing_colocated(num_blocks: int):
    def make(leaping: bool) -> Simulation:
        engine = EngineLimits(num_blocks=num_blocks, max_num_batched_tokens=512, max_num_seqs=32)
        sc = Scenario(Deployment(0, 2, engine), smollm2_costs(False), Overheads(step_gap=0.001))
        load = LoadConfig(request_rate=20.0, seed=4)
        requests = synthetic_requests(DatasetConfig(RandomSpec(100, 200), 100, seed=4), load)
        return Simulation(sc, requests, load, leaping=leaping)

    the_same_with_and_without_leaps(make)


def test_leaps_change_nothing_when_a_worker_dies_or_switches_pools():
    def make(leaping: bool) -> Simulation:
        engine = EngineLimits(num_blocks=200, max_num_batched_tokens=2048)
        overheads = Overheads(step_gap=0.0002, role_switch=0.1)
        faults = (Fault(1.3, "decode-1"),)
        sc = Scenario(Deployment(1, 3, engine), smollm2_costs(True), overheads, faults)
        load = LoadConfig(request_rate=30.0, seed=2)
        requests = synthetic_requests(DatasetConfig(RandomSpec(400, 124), 60, seed=2), load)
        sim = Simulation(sc, requests, load, leaping=leaping)
        sim.at(0.6, sim.switch_role, "decode-0", "prefill")
        return sim

    stepped, _ = the_same_with_and_without_leaps(make)
    assert any(r.attempts for r in stepped.runs)  # both the switch and the death moved some


def test_a_leap_is_settled_when_max_duration_ends_the_run():
    def make(leaping: bool) -> Simulation:
        engine = EngineLimits(num_blocks=200)
        sc = Scenario(Deployment(0, 1, engine), smollm2_costs(False))
        requests = [SimRequest(0.0, list(range(50)), 2000)]
        return Simulation(sc, requests, LoadConfig(max_duration_s=3.0), leaping=leaping)

    stepped, _ = the_same_with_and_without_leaps(make)
    assert stepped.num_aborted == 1 and len(stepped.runs[0].token_times) > 10
