"""The interference model: a decode step slowed while a prefill step lasts, and the inverse the
fidelity benchmark measures factors with."""

from __future__ import annotations

import pytest

from simulation.interference import factor_of, slowed


def test_a_step_inside_the_overlap_is_slowed_all_along() -> None:
    assert slowed(0.010, 3.0, 0.040) == pytest.approx(0.030)


def test_a_step_outlasting_the_overlap_runs_at_its_own_pace_after_it() -> None:
    # 5 ms at a third of its pace do 5/3 ms of its 10 ms; the other 25/3 ms follow at full pace.
    assert slowed(0.010, 3.0, 0.005) == pytest.approx(0.005 + 0.010 - 0.005 / 3)
    assert slowed(0.010, 1.0, 0.005) == pytest.approx(0.010)


@pytest.mark.parametrize("factor", [1.0, 1.5, 3.0, 11.0])
@pytest.mark.parametrize("overlap", [0.001, 0.005, 0.012, 0.5])
def test_factor_of_undoes_slowed(factor: float, overlap: float) -> None:
    assert factor_of(slowed(0.010, factor, overlap), 0.010, overlap) == pytest.approx(factor)


def test_a_step_slower_than_its_overlap_can_explain_is_taken_as_slowed_all_along() -> None:
    # 50 ms for a 10 ms step with 5 ms of overlap: slower after the overlap too.
    assert factor_of(0.050, 0.010, 0.005) == pytest.approx(5.0)
