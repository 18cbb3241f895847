"""`tandem plan`'s search: simulate every way to split a GPU budget into pools and pick the one
with the best goodput that meets the SLO.

Layouts tried for G GPUs and T GPUs per worker (W = G // T workers): W colocated workers, and
every P prefill + D decode with P + D = W. Each is simulated on the same workload; a layout is
feasible when every percentile objective holds (e.g. TTFT p99 <= 2 s), and its goodput is the
requests per second that met the per-request objectives (TTFT, and TPOT against the ITL limit,
as `tandem bench --goodput` counts them). The pick: the feasible layout of highest goodput; if
none is feasible the plan says so (and shows how close each came), it never adds GPUs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

from loadtest.config import GoodputSLO, LoadConfig
from planning.slo import Objective
from simulation.cluster import Simulation
from simulation.deployment import Deployment, Scenario
from simulation.report import simulated_record
from simulation.workload import SimRequest, SimulationError


def per_request_slo(objectives: Sequence[Objective]) -> GoodputSLO:
    """Goodput counts a request good when its TTFT and TPOT are within the tightest limits."""
    limits: dict[str, float] = {}
    for o in objectives:
        name = "tpot" if o.metric == "itl" else o.metric
        limits[name] = min(limits.get(name, o.limit_ms), o.limit_ms)
    return GoodputSLO(limits.get("ttft"), limits.get("tpot"), limits.get("e2el"))


class Candidate(NamedTuple):
    deployment: Deployment
    goodput: float  # requests per second that met the per-request objectives
    throughput: float  # requests per second
    percentiles: dict[str, float]  # each objective's key -> predicted ms
    feasible: bool
    failed: int

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.deployment.num_gpus


class Plan(NamedTuple):
    candidates: list[Candidate]  # best first
    best: Candidate | None  # None: no layout meets the objectives


def layouts(base: Deployment, gpus: int) -> list[Deployment]:
    workers = gpus // base.gpus_per_worker
    if workers < 1:
        raise SimulationError(f"{gpus} GPUs hold no worker of {base.gpus_per_worker} GPUs")
    options = [dataclasses.replace(base, prefill_workers=0, decode_workers=workers)]
    options += [
        dataclasses.replace(base, prefill_workers=p, decode_workers=workers - p)
        for p in range(1, workers)
    ]
    return options


def search(
    scenario: Scenario,
    requests: Sequence[SimRequest],
    load: LoadConfig,
    gpus: int,
    objectives: Sequence[Objective],
    on_candidate: Callable[[Candidate], None] | None = None,
) -> Plan:
    slo = per_request_slo(objectives)
    percentiles = sorted({o.percentile for o in objectives} | {50.0})
    candidates = []
    for deployment in layouts(scenario.deployment, gpus):
        trial = dataclasses.replace(scenario, deployment=deployment)
        outcome = Simulation(trial, requests, load).run()
        record = simulated_record(outcome, trial, load, percentiles, slo, per_request=False)
        predicted = {o.key: float(record.get(o.key, float("inf"))) for o in objectives}
        feasible = record["failed"] == 0 and all(predicted[o.key] <= o.limit_ms for o in objectives)
        candidate = Candidate(
            deployment,
            float(record["request_goodput"] or 0.0),
            float(record["request_throughput"]),
            predicted,
            feasible,
            int(record["failed"]),
        )
        candidates.append(candidate)
        if on_candidate is not None:
            on_candidate(candidate)
    candidates.sort(key=lambda c: (c.feasible, c.goodput_per_gpu), reverse=True)
    best = candidates[0] if candidates and candidates[0].feasible else None
    return Plan(candidates, best)
