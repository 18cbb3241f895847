"""benchmarks/simulator_fidelity.py without serving: which steps count as started beside a step
of the other pool (the ones --fit-interference leaves out of the step model), the share of a
run's decode steps that did, and the handover read off the coordinator's histogram."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from planning.cost_model import StepCostModel
from planning.nnls import FitStats
from protocol.telemetry import StepRecord
from simulation.deployment import Costs

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "simulator_fidelity.py"
_spec = importlib.util.spec_from_file_location("simulator_fidelity", SCRIPT)
fidelity = importlib.util.module_from_spec(_spec)
sys.modules["simulator_fidelity"] = fidelity
_spec.loader.exec_module(fidelity)


def step(start: float, seconds: float, prefill_tokens: int = 0, threads: int = 0) -> StepRecord:
    return StepRecord(start + seconds, seconds, prefill_tokens, 0, 1, 100, 1, 0, threads)


def constant(seconds: float) -> StepCostModel:
    return StepCostModel(("step",), (seconds,), 16, 1024, FitStats(1, 0.0, 0, None))


def test_decode_steps_that_start_inside_any_prefill_step_are_beside_it() -> None:
    inside_first = step(1.05, 0.02)
    inside_second = step(3.50, 0.02)
    before, between, at_an_end = step(0.50, 0.02), step(2.0, 0.9), step(1.20, 0.02)
    per_worker = {
        "prefill-0": [step(1.0, 0.2, 100)],  # 1.0 - 1.2 s
        "prefill-1": [step(3.0, 1.0, 800)],  # 3.0 - 4.0 s
        "decode-0": [before, inside_first, at_an_end, between, inside_second],
    }
    # Each with its overlap: from its start to the end of the prefill step it started in.
    beside = fidelity.beside(per_worker, "decode", "prefill")
    assert beside == pytest.approx({id(inside_first): 0.15, id(inside_second): 0.5})
    # The other way round: the prefill steps start at 1.0 s and 3.0 s, inside no decode step
    # (`between` ended at 2.9 s) until one is added that spans 3.0 s.
    assert fidelity.beside(per_worker, "prefill", "decode") == {}
    per_worker["decode-0"].append(step(2.95, 0.1))  # 2.95 - 3.05 s: prefill-1 starts inside
    overlaps = fidelity.beside(per_worker, "prefill", "decode")
    assert overlaps == pytest.approx({id(per_worker["prefill-1"][0]): 0.05})


def test_the_handover_median_is_read_from_the_histograms_growth() -> None:
    inf = float("inf")
    before = {0.01: 5.0, 0.02: 5.0, 0.05: 5.0, inf: 5.0}  # 5 earlier requests, all under 10 ms
    after = {0.01: 5.0, 0.02: 7.0, 0.05: 13.0, inf: 13.0}  # then 2 in 10-20 ms, 6 in 20-50 ms
    # Of the 8 new ones the median (the 4th) lies in 20-50 ms, 2 of that bucket's 6 in.
    assert fidelity.bucket_median(before, after) == 0.02 + 0.03 * 2 / 6
    assert fidelity.bucket_median(after, after) == 0.0  # nothing new (a colocated layout)
    assert fidelity.bucket_median({}, {0.01: 1.0, inf: 4.0}) == 0.01  # past the last bound


def test_the_share_beside_prefill_counts_decode_steps_in_the_run_window_only() -> None:
    reply = {
        "workers": {
            "prefill-0": {"steps": [step(1.0, 0.2, 100)._asdict()]},  # 1.0 - 1.2 s
            "decode-0": {
                "steps": [
                    s._asdict()
                    for s in (
                        step(0.5, 0.02, threads=2),  # before the run window
                        step(1.05, 0.02, threads=1),  # beside the prefill step, paced down
                        step(1.5, 0.02, threads=2),
                        step(1.6, 0.02, threads=2),
                        step(9.0, 0.02, threads=2),  # beside nothing, after the window
                    )
                ]
            },
        }
    }
    costs = Costs(constant(0.05), by_threads={1: constant(0.04), 2: constant(0.01)})
    pools = fidelity.pools_real(fidelity.steps_of(reply), 1.0, 2.0, costs)
    assert pools["decode_beside"] == 1 / 3
    assert pools["decode_fewer_threads"] == 1 / 3
    assert pools["decode_step_ms"] == pytest.approx(20.0)
    assert pools["decode_vs_model"] == pytest.approx(2.0)  # 0.5, 2 and 2: each by its threads
    assert (pools["prefill_steps"], pools["prefill_seconds"]) == (1, pytest.approx(0.2))
    del reply["workers"]["prefill-0"]  # colocated: no prefill pool, nothing to tell
    colocated = fidelity.steps_of(reply)
    assert fidelity.pools_real(colocated, 1.0, 2.0, costs) == dict.fromkeys(fidelity.POOL_STATS)


def test_the_simulated_interference_is_the_median_the_mean_or_every_factor() -> None:
    measured = (1.5, 2.0, 2.5, 10.0)
    assert fidelity.simulated(measured, "median") == 2.25
    assert fidelity.simulated(measured, "mean") == 4.0
    assert fidelity.simulated(measured, "draw") == measured
    assert fidelity.simulated((0.8, 0.9, 1.0), "median") == 1.0  # never faster than alone
    assert fidelity.simulated(1.0, "mean") == 1.0  # too few measured: none


def test_steps_with_more_workers_computing_than_cores_are_slowed_for_that_part_of_them() -> None:
    a, b, c = step(0.0, 1.0), step(0.5, 1.0), step(0.7, 0.1)
    late = step(1.2, 0.1)  # a has ended, b goes on: two computing
    per_worker = {"prefill-0": [a], "prefill-1": [b], "decode-0": [c, late]}
    shared = fidelity.oversubscription(per_worker, 2)
    # c runs all its way beside a and b: three workers on two cores
    assert shared[id(c)] == pytest.approx(1.5) and shared[id(late)] == pytest.approx(1.0)
    # a and b are three on two cores for c's 0.1 s only: 0.1 s of theirs did 2/3 of the work
    work = 0.9 + 0.1 * 2 / 3
    assert shared[id(a)] == pytest.approx(1.0 / work) and shared[id(b)] == pytest.approx(1 / work)
    assert fidelity.oversubscription(per_worker, 3)[id(c)] == pytest.approx(1.0)
    # Steps that only touch (one ends as the other begins) do not share the cores, and a step
    # of no length is not slowed.
    first, touching, empty = step(0.0, 0.5), step(0.5, 0.5), step(0.2, 0.0)
    alone = {"decode-0": [first], "decode-1": [touching], "decode-2": [empty]}
    assert fidelity.oversubscription(alone, 1) == {
        id(first): 1.0,
        id(touching): 1.0,
        id(empty): 1.0,
    }


def test_the_fit_takes_the_calibration_with_or_without_its_open_loop_part_or_the_run() -> None:
    def reply(*ends: float) -> dict:
        return {"workers": {"decode-0": {"steps": [{"end": e} for e in ends]}}}

    def ends(fitted: dict) -> list[float]:
        return [s["end"] for s in fitted["workers"]["decode-0"]["steps"]]

    calibration, run = reply(1.0, 2.0, 5.0, 6.0), reply(10.0, 11.0, 30.0)
    measured = {"alone": [0.5, 1.5], "open_loop": (4.0, 7.0), "window": (9.0, 20.0)}
    fitted, alone = fidelity.fitted_steps(measured, calibration, run, "calibration", True)
    assert ends(fitted) == [1.0, 2.0, 5.0, 6.0] and alone == (0.5, 1.5)
    fitted, alone = fidelity.fitted_steps(measured, calibration, run, "calibration", False)
    assert ends(fitted) == [1.0, 2.0] and alone == (0.5, 1.5)  # before the open loop began
    fitted, alone = fidelity.fitted_steps(measured, calibration, run, "run", True)
    assert ends(fitted) == [10.0, 11.0] and alone is None
    older = {"alone": None, "window": (9.0, 20.0)}  # a report from before the open loop
    fitted, alone = fidelity.fitted_steps(older, calibration, run, "calibration", False)
    assert ends(fitted) == [1.0, 2.0, 5.0, 6.0] and alone is None


def test_paced_calibrations_keep_each_thread_counts_spread_where_it_has_enough_steps() -> None:
    """One worker's steps on one and on two threads, never two at once (so nothing is
    oversubscribed): a model per count, and the spread of each count's decode steps; the
    three prompt steps on two threads are too few for a spread of their own."""
    steps, t = [], 0.0
    for i in range(60):
        threads = 1 + i % 2
        seqs = 1 + i % 7
        wobble = (1.0, 1.2, 0.9)[i % 3] if threads == 2 else 1.0
        seconds = (0.01 + 0.002 * seqs) * (2 if threads == 1 else 1) * wobble
        steps.append({"end": t + seconds, "seconds": seconds, "prefill_tokens": 0,
                      "prefill_attention": 0, "decode_seqs": seqs, "decode_context": 50 * seqs,
                      "kv_blocks_used": 1, "queue_length": 0, "threads": threads})  # fmt: skip
        t += seconds + 0.001
    for _ in range(3):
        steps.append({"end": t + 0.2, "seconds": 0.2, "prefill_tokens": 100,
                      "prefill_attention": 5000, "decode_seqs": 0, "decode_context": 0,
                      "kv_blocks_used": 1, "queue_length": 0, "threads": 2})  # fmt: skip
        t += 0.201
    cal = fidelity.calibrate({"workers": {"decode-0": {"steps": steps}}}, "t", False, None)
    assert set(cal.by_threads) == {1, 2} and set(cal.thread_noise) == {1, 2}
    one_decodes, one_prompts = cal.thread_noise[1]
    two_decodes, two_prompts = cal.thread_noise[2]
    assert len(one_decodes) == 30 and len(two_decodes) == 30
    assert one_prompts == () and two_prompts == ()  # 0 and 3 prompt steps: the pooled is drawn
    # the one-thread steps fit their model exactly; the two-thread ones keep their wobble
    assert max(one_decodes) / min(one_decodes) == pytest.approx(1.0, abs=0.02)
    assert max(two_decodes) / min(two_decodes) > 1.2
