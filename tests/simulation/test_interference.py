"""The interference model: a decode step slowed while the prefill step beside it lasts."""

from __future__ import annotations

import pytest

from simulation.interference import slowed


def test_a_step_inside_the_overlap_is_slowed_all_along() -> None:
    assert slowed(0.010, 3.0, 0.040) == pytest.approx(0.030)


def test_a_step_outlasting_the_overlap_runs_at_its_own_pace_after_it() -> None:
    # 5 ms at a third of its pace do 5/3 ms of its 10 ms; the other 25/3 ms follow at full pace.
    assert slowed(0.010, 3.0, 0.005) == pytest.approx(0.005 + 0.010 - 0.005 / 3)
    assert slowed(0.010, 1.0, 0.005) == pytest.approx(0.010)
