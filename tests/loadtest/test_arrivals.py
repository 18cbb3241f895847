"""The arrival process: gamma gaps with mean 1/rate and variance mean^2/burstiness, seeded."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest.arrivals import arrival_gaps, send_offsets
from loadtest.config import LoadConfig
from loadtest.errors import BenchError
from loadtest.sweep import parse_sweep
from planning.slo import SloError, parse_slo

COUNT = 40_000


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_gaps_have_the_requested_mean(rate: float) -> None:
    gaps = arrival_gaps(COUNT, rate, burstiness=1.0, seed=0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert gaps.var() == pytest.approx(1 / rate**2, rel=0.05)  # exponential: variance = mean^2


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_variance(burstiness: float) -> None:
    rate = 2.0
    gaps = arrival_gaps(COUNT, rate, burstiness, seed=3)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.var() == pytest.approx((1 / rate) ** 2 / burstiness, rel=0.08)


def test_lower_burstiness_is_burstier() -> None:
    variances = [arrival_gaps(COUNT, 1.0, b, seed=1).var() for b in (0.5, 1.0, 2.0)]
    assert variances[0] > variances[1] > variances[2]


def test_same_seed_same_schedule() -> None:
    first = arrival_gaps(100, 3.0, 1.0, seed=7)
    assert np.array_equal(first, arrival_gaps(100, 3.0, 1.0, seed=7))
    assert not np.array_equal(first, arrival_gaps(100, 3.0, 1.0, seed=8))


def test_infinite_rate_sends_everything_at_once() -> None:
    assert np.array_equal(send_offsets(5, math.inf, 1.0, seed=0), np.zeros(5))


def test_offsets_accumulate_the_gaps_scaled_to_end_at_count_over_rate() -> None:
    # As vllm bench serve schedules them: the first after a gap, the last at count / rate.
    offsets = send_offsets(6, 2.0, 1.0, seed=0)
    gaps = arrival_gaps(6, 2.0, 1.0, seed=0)
    assert offsets[-1] == pytest.approx(3.0)
    assert np.allclose(offsets, np.cumsum(gaps) * 3.0 / gaps.sum())
    assert offsets[0] > 0 and np.all(np.diff(offsets) >= 0)


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_rejects_non_positive_parameters(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_gaps(3, rate, burstiness, seed=0)


def test_infinite_burstiness_spaces_requests_evenly() -> None:
    # (as vllm bench serve reads it; a gamma of infinite shape gave NaN gaps, and a runner
    # that waits only for positive delays then sent everything at once)
    assert send_offsets(5, 10.0, math.inf, 0) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])


def test_bad_seeds_sweeps_and_slos_are_one_line_errors() -> None:
    with pytest.raises(BenchError, match="--seed"):
        LoadConfig(seed=-1)
    with pytest.raises(BenchError, match="finite"):
        parse_sweep("max-concurrency=nan")
    with pytest.raises(SloError, match="percentile"):
        parse_slo("ttft_p150=2s")
    with pytest.raises(SloError, match="finite"):
        parse_slo("ttft_p99=nans")
