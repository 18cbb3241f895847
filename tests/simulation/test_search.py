"""`tandem plan`'s search over pool splits: every split while there are few, a narrowing grid
past that, which finds the best split of a goodput that rises to one peak."""

from __future__ import annotations

import pytest

from loadtest.config import LoadConfig
from simulation import search as search_module
from simulation.deployment import Deployment, EngineLimits, Scenario
from simulation.search import GRID, Candidate, grid, search


def scenario(workers: int) -> Scenario:
    return Scenario(Deployment(0, workers, EngineLimits(num_blocks=64)), costs=None)


def scored_by(monkeypatch, score, feasible=lambda p: True) -> list[int]:
    """Replaces the simulation by score(prefill workers); returns the splits it was asked for."""
    asked: list[int] = []

    def evaluate(trial, requests, load, objectives) -> Candidate:
        p = trial.deployment.prefill_workers
        asked.append(p)
        workers = trial.deployment.prefill_workers + trial.deployment.decode_workers
        goodput = score(p) * workers
        return Candidate(trial.deployment, goodput, goodput, {}, feasible(p), 0)

    monkeypatch.setattr(search_module, "evaluate", evaluate)
    return asked


def test_the_grid_spreads_over_the_bracket_with_both_ends() -> None:
    assert grid(1, 5) == [1, 2, 3, 4, 5]
    points = grid(1, 999)
    assert points[0] == 1 and points[-1] == 999 and len(points) == GRID + 1
    assert max(b - a for a, b in zip(points, points[1:], strict=False)) <= 63


@pytest.mark.parametrize("workers", [2, 3, GRID + 1, GRID + 2])
def test_few_workers_try_every_split(monkeypatch, workers) -> None:
    asked = scored_by(monkeypatch, lambda p: -abs(p - 1))
    plan = search(scenario(workers), [], LoadConfig(), workers, [])
    assert sorted(asked) == list(range(workers))  # 0: all colocated
    assert plan.best.deployment.prefill_workers == 1


@pytest.mark.parametrize("peak", [1, 2, 137, 500, 998, 999])
def test_a_thousand_workers_find_the_peak_in_few_simulations(monkeypatch, peak) -> None:
    asked = scored_by(monkeypatch, lambda p: 0.0 if p == 0 else 1.0 - abs(p - peak) / 1000)
    plan = search(scenario(1000), [], LoadConfig(), 1000, [])
    assert plan.best.deployment.prefill_workers == peak
    assert len(asked) == len(set(asked)) < 60  # each split once; 999 simulated before


def test_the_search_narrows_on_feasible_layouts_first(monkeypatch) -> None:
    # Goodput rises with P, but only 300..420 meets the objectives: the pick is the best of
    # those, not the infeasible maximum.
    asked = scored_by(monkeypatch, lambda p: p / 1000, feasible=lambda p: 300 <= p <= 420)
    plan = search(scenario(1000), [], LoadConfig(), 1000, [])
    assert plan.best.deployment.prefill_workers == 420 and len(asked) < 60


def test_rounds_that_add_no_split_start_no_processes(monkeypatch) -> None:
    """With 19 workers the second round's bracket may hold only splits simulated already: it
    must not ask a pool of processes for nothing (a pool of 0 workers raises)."""
    rounds: list[list[int]] = []

    def evaluate_all(trials, requests, load, objectives, jobs):
        assert trials and jobs == 2
        rounds.append([t.deployment.prefill_workers for t in trials])
        for t in trials:
            p = t.deployment.prefill_workers
            yield Candidate(t.deployment, 1.0 - abs(p - 5) / 19, 1.0, {}, True, 0)

    monkeypatch.setattr(search_module, "_evaluate_all", evaluate_all)
    plan = search(scenario(19), [], LoadConfig(), 19, [], jobs=2)
    assert plan.best.deployment.prefill_workers == 5 and len(rounds) == 1
