"""A fixed case replayed against stored numbers, so any drift in the simulator, the scheduler or
the router it runs shows up in CI. A deliberate change regenerates the file:

    TANDEM_UPDATE_REPLAY=1 pytest tests/simulation/test_replay.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loadtest.config import DatasetConfig, LoadConfig, PrefixRepetitionSpec
from planning.cost_model import StepCostModel
from planning.nnls import FitStats
from planning.transfer_model import TransferCostModel
from protocol.kv import KVLayout
from simulation.cluster import Simulation
from simulation.deployment import Costs, Deployment, EngineLimits, Overheads, Scenario
from simulation.report import simulated_record
from simulation.workload import synthetic_requests

DATA = Path(__file__).parent / "data"
PROFILES = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles"
EXPECTED = DATA / "replay_expected.json"
KEYS = (
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "duration",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
)


def replay() -> dict:
    step = StepCostModel.load(PROFILES / "smollm2-cpu-1thread.json")  # `tandem profile --threads 1`
    transfer = TransferCostModel(50e-6, 1 / 3e9, FitStats(1, 0.0, 0, None))  # gloo, ~3 GB/s
    scenario = Scenario(
        Deployment(1, 2, EngineLimits(num_blocks=600, max_num_batched_tokens=512), "cost"),
        Costs(step, transfer, KVLayout(30, 3, 64, "bfloat16")),  # SmolLM2's KV
        Overheads(step_gap=0.001, dispatch=0.002, handover=0.001),
    )
    load = LoadConfig(request_rate=6.0, max_concurrency=12, seed=3)
    spec = PrefixRepetitionSpec(num_prefixes=4, prefix_len=192, suffix_len=48, output_len=24)
    requests = synthetic_requests(DatasetConfig(spec, 60, seed=3), load)
    outcome = Simulation(scenario, requests, load).run()
    record = simulated_record(outcome, scenario, load, dataset_name=spec.name)
    hits = sum(w.blocks.prefix_hits for w in outcome.workers.values())
    return {**{k: record[k] for k in KEYS}, "prefix_hit_tokens": hits, "events": outcome.num_events}


def test_the_fixed_case_replays_to_the_stored_numbers():
    got = replay()
    if os.environ.get("TANDEM_UPDATE_REPLAY"):
        EXPECTED.write_text(json.dumps(got, indent=2) + "\n")
    expected = json.loads(EXPECTED.read_text())
    assert got == pytest.approx(expected, rel=1e-9)
