"""`tandem plan`'s search: simulate every way to split a GPU budget into pools and pick the one
with the best goodput that meets the SLO.

Layouts tried for G GPUs and T GPUs per worker (W = G // T workers): W colocated workers, and
P prefill + D decode with P + D = W: every P up to GRID of them; past that, GRID + 1 values of P
spread evenly over 1..W-1, then as many again between the best one's neighbours, and so on until
the bracket holds no more than GRID + 1 (each round shrinks it ~GRID/2-fold: 1,000 workers take
three rounds, ~50 simulations instead of 999). That finds the best P when goodput rises to one
peak and falls, as it does with P (too few prefill workers: TTFT; too few decode: ITL); a
workload with two separate peaks could hide the narrower one between two grid points. Each is
simulated on the same workload; a layout is
feasible when every percentile objective holds (e.g. TTFT p99 <= 2 s), and its goodput is the
requests per second that met the per-request objectives (TTFT, and TPOT against the ITL limit,
as `tandem bench --goodput` counts them). The pick: the feasible layout of highest goodput; if
none is feasible the plan says so (and shows how close each came), it never adds GPUs.

The layouts are independent simulations, so with `jobs` > 1 they run in that many processes
at once (a 128-GPU hour is minutes of simulation per layout, and 16 layouts of TP8 workers);
each simulation is deterministic, so the plan is the same whatever the number of jobs.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
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


GRID = 16  # disaggregated layouts simulated in one round of the search


def num_workers(base: Deployment, gpus: int) -> int:
    workers = gpus // base.gpus_per_worker
    if workers < 1:
        raise SimulationError(f"{gpus} GPUs hold no worker of {base.gpus_per_worker} GPUs")
    return workers


def layout(base: Deployment, workers: int, prefill: int) -> Deployment:
    """`workers` of them, `prefill` in the prefill pool (0: every one colocated)."""
    return dataclasses.replace(base, prefill_workers=prefill, decode_workers=workers - prefill)


def grid(lo: int, hi: int, points: int = GRID + 1) -> list[int]:
    """Up to `points` integers spread evenly over lo..hi, both ends included."""
    if hi - lo + 1 <= points:
        return list(range(lo, hi + 1))
    return sorted({lo + round(i * (hi - lo) / (points - 1)) for i in range(points)})


def _rank(candidate: Candidate) -> tuple[bool, float]:
    return (candidate.feasible, candidate.goodput_per_gpu)


def search(
    scenario: Scenario,
    requests: Sequence[SimRequest],
    load: LoadConfig,
    gpus: int,
    objectives: Sequence[Objective],
    on_candidate: Callable[[Candidate], None] | None = None,
    jobs: int = 1,
) -> Plan:
    """The layouts of `gpus` the search needs simulated (`jobs` at a time, each in its own
    process when more than one); `on_candidate` sees each result as it is known, in layout
    order within a round."""
    base = scenario.deployment
    workers = num_workers(base, gpus)
    known: dict[int, Candidate] = {}  # prefill workers -> the layout's result

    def simulate(prefills: list[int]) -> None:
        new = [p for p in prefills if p not in known]
        if not new:  # (a narrowed bracket may hold only splits simulated already)
            return
        trials = [dataclasses.replace(scenario, deployment=layout(base, workers, p)) for p in new]
        for p, candidate in zip(
            new, _evaluate_all(trials, requests, load, objectives, jobs), strict=True
        ):
            known[p] = candidate
            if on_candidate is not None:
                on_candidate(candidate)

    lo, hi = 1, workers - 1
    simulate([0, *grid(lo, hi)])
    while hi - lo + 1 > GRID + 1:  # narrow the bracket around the best point of the grid
        points = grid(lo, hi)
        at = max(range(len(points)), key=lambda i: _rank(known[points[i]]))
        lo, hi = points[max(0, at - 1)], points[min(len(points) - 1, at + 1)]
        simulate(grid(lo, hi))
    candidates = sorted(known.values(), key=_rank, reverse=True)
    best = candidates[0] if candidates and candidates[0].feasible else None
    return Plan(candidates, best)


def _evaluate_all(
    trials: list[Scenario],
    requests: Sequence[SimRequest],
    load: LoadConfig,
    objectives: Sequence[Objective],
    jobs: int,
) -> Iterator[Candidate]:
    if jobs <= 1 or len(trials) == 1:
        for trial in trials:
            yield evaluate(trial, requests, load, objectives)
        return
    # Fresh interpreters, not forks: the caller may hold threads (a tokenizer's, for one).
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(jobs, len(trials)), mp_context=spawn) as pool:
        futures = [pool.submit(evaluate, t, requests, load, objectives) for t in trials]
        for future in futures:
            try:
                yield future.result()
            except BrokenProcessPool:
                raise SimulationError(
                    f"a simulation process died (out of memory?): try fewer --jobs than {jobs}"
                ) from None


def evaluate(
    trial: Scenario,
    requests: Sequence[SimRequest],
    load: LoadConfig,
    objectives: Sequence[Objective],
) -> Candidate:
    """One layout simulated and scored against the objectives."""
    slo = per_request_slo(objectives)
    percentiles = sorted({o.percentile for o in objectives} | {50.0})
    outcome = Simulation(trial, requests, load).run()
    record = simulated_record(outcome, trial, load, percentiles, slo, per_request=False)
    predicted = {o.key: float(record.get(o.key, float("inf"))) for o in objectives}
    feasible = record["failed"] == 0 and all(predicted[o.key] <= o.limit_ms for o in objectives)
    return Candidate(
        trial.deployment,
        float(record["request_goodput"] or 0.0),
        float(record["request_throughput"]),
        predicted,
        feasible,
        int(record["failed"]),
    )
