"""The engine thread uses the thread count whose steps it timed fastest (engine/thread_tuner.py)."""

from __future__ import annotations

import time

import pytest
import torch

from engine import thread_tuner
from engine.engine_thread import EngineThread
from engine.thread_tuner import ThreadTuner, candidate_counts


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(tuner: ThreadTuner, clock: FakeClock, seconds_per_count, steps: int) -> list[int]:
    """Steps `steps` times, 10 ms of clock apart; the counts used, in order."""
    used = []
    for _ in range(steps):
        count = tuner.count()
        used.append(count)
        clock.now += 0.01
        tuner.observe(seconds_per_count(count))
    return used


def test_candidates_are_every_core_one_fewer_and_half() -> None:
    assert candidate_counts(1) == [1]
    assert candidate_counts(2) == [2, 1]
    assert candidate_counts(8) == [8, 7, 4]


def test_a_probe_interleaves_blocks_and_switches_to_the_faster_count() -> None:
    clock = FakeClock()
    tuner = ThreadTuner(2, hold_seconds=4.0, block_steps=4, blocks=3, clock=clock)
    before = _run(tuner, clock, lambda count: 0.006 if count == 2 else 0.005, steps=100)
    assert before == [2] * 100  # the first probe waits a quarter of the hold
    probe = _run(tuner, clock, lambda count: 0.006 if count == 2 else 0.005, steps=24)
    assert probe == ([2] * 4 + [1] * 4) * 3
    assert tuner.current == 1 and tuner.switches == 1 and tuner.probes == 1
    assert tuner.last_ratios == pytest.approx({2: 1.0, 1: 5 / 6})
    assert _run(tuner, clock, lambda count: 0.005, steps=399) == [1] * 399  # held 4 s


def test_the_count_in_use_stays_unless_another_beats_it_by_the_margin() -> None:
    clock = FakeClock()
    tuner = ThreadTuner(2, hold_seconds=1.0, block_steps=4, blocks=2, margin=0.05, clock=clock)
    _run(tuner, clock, lambda count: 0.0100 if count == 2 else 0.0097, steps=25 + 16)
    assert tuner.probes == 1 and tuner.current == 2  # 3% faster: within the margin


def test_the_first_step_of_each_block_and_the_slowest_eighth_are_not_counted() -> None:
    clock = FakeClock()
    tuner = ThreadTuner(2, hold_seconds=0.0, block_steps=9, blocks=1, clock=clock)
    times = iter([1.0] + [0.004] * 7 + [0.9] + [1.0] + [0.005] * 8)  # count 2's block, then 1's
    _run(tuner, clock, lambda count: next(times), steps=18)
    assert tuner.last_ratios == pytest.approx({2: 1.0, 1: 0.005 / 0.004})
    assert tuner.current == 2


def test_a_burst_in_one_round_does_not_decide() -> None:
    # Count 1 steps faster, but a burst of prefill work lands on its whole block in round 0:
    # each round is compared on its own, and the median of the rounds' ratios decides.
    clock = FakeClock()
    tuner = ThreadTuner(2, hold_seconds=0.0, clock=clock)  # 6 rounds of 8-step blocks
    plan = [2] * 8 + [1] * 8
    times = iter([0.006] * 8 + [0.02] * 8 + (([0.006] * 8 + [0.005] * 8) * 5))
    assert _run(tuner, clock, lambda count: next(times), steps=96) == plan * 6
    assert tuner.last_ratios[1] == pytest.approx(5 / 6)
    assert tuner.current == 1


def test_the_hold_doubles_while_probes_keep_the_count_and_resets_on_a_switch() -> None:
    clock = FakeClock()
    tuner = ThreadTuner(2, hold_seconds=1.0, block_steps=2, blocks=1, clock=clock)
    probes_ended_at = []
    for step in range(2600):  # 26 s of 10 ms steps; count 1 turns faster at 20 s
        faster = 2 if step < 2000 else 1
        count = tuner.count()
        clock.now += 0.01
        tuner.observe(0.004 if count == faster else 0.006)
        if tuner.probes > len(probes_ended_at):
            probes_ended_at.append(clock.now)
    gaps = [round(b - a, 1) for a, b in zip(probes_ended_at, probes_ended_at[1:], strict=False)]
    # Held 1 s -> 2 s -> 4 s (the cap) while count 2 stays; a probe takes 4 steps (0.04 s).
    assert gaps[:6] == [2.0, 4.0, 4.0, 4.0, 4.0, 4.0]  # the 7th probe (at 22.5 s) switches
    assert tuner.switches == 1 and tuner.current == 1
    assert gaps[6] == 1.0  # and the hold starts again from 1 s


def test_engine_thread_steps_on_the_count_the_tuner_chose(monkeypatch) -> None:
    """A step that is slower on two threads than on one (it sleeps longer when the engine
    thread's torch count is 2): the engine thread ends up stepping on one, and says so."""
    monkeypatch.setattr(thread_tuner, "HOLD_SECONDS", 0.2)
    seen: list[int] = []
    previous = torch.get_num_threads()

    def step() -> None:
        count = torch.get_num_threads()
        seen.append(count)
        time.sleep(0.004 if count == 2 else 0.002)

    try:
        engine = EngineThread(
            "test-engine",
            step=step,
            has_work=lambda: len(seen) < 400,
            on_crash=lambda err: None,
            num_threads=2,
            tune_threads=True,
        )
        for _ in range(400):  # 20 s at most
            if len(seen) >= 400:
                break
            time.sleep(0.05)
        fields = engine.step_fields()
        engine.stop()
    finally:
        torch.set_num_threads(previous)
    assert seen[0] == 2  # it starts on every core
    assert seen[-1] == 1 and fields["engine_threads"] == 1
    assert engine.tuner is not None and engine.tuner.switches == 1
