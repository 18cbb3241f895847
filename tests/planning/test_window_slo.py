"""What the planner reads: the traffic window (rate, lengths, percentiles, forgetting) and the
SLO spelling turned into its targets."""

from __future__ import annotations

import numpy as np
import pytest

from planning.slo import SloError, parse_slo, planner_targets
from planning.window import LoadWindow, percentile


def test_the_window_summarises_only_its_span() -> None:
    window = LoadWindow(span_s=10.0, percentile=99.0)
    for i in range(40):  # 4 per second from t=0 to 9.75 s
        window.arrived(i / 4, 100 + i)
    ttfts = [0.1 * (i + 1) for i in range(20)]
    for i, ttft in enumerate(ttfts):
        window.finished(5.0 + i / 10, 30, ttft, 0.02 if i % 2 else None)
    seen = window.summary(10.0)
    assert seen.arrival_rate == pytest.approx(4.0)
    assert seen.mean_prompt == pytest.approx(np.mean([100 + i for i in range(40)]))
    assert seen.mean_output == 30 and seen.finished == 20
    assert seen.ttft_s == pytest.approx(np.percentile(ttfts, 99))
    assert seen.itl_s == pytest.approx(0.02)
    later = window.summary(20.0)  # everything older than 10 s is gone
    assert later.arrival_rate == 0.0 and later.finished == 0 and later.ttft_s is None


def test_a_young_window_divides_by_what_it_has_seen() -> None:
    window = LoadWindow(span_s=10.0, opened_at=100.0)
    for i in range(6):
        window.arrived(100.0 + i / 3, 10)
    assert window.summary(102.0).arrival_rate == pytest.approx(3.0)


def test_a_first_request_after_a_quiet_start_is_not_a_burst() -> None:
    """The young window's age was taken from its first arrival: one request 20 ms before a
    tick read as 50 req/s, and the planner grew the pools on it."""
    window = LoadWindow(span_s=10.0, opened_at=0.0)  # the server started at 0
    window.arrived(100.0, 6)
    assert window.summary(100.02).arrival_rate == pytest.approx(0.1)
    unopened = LoadWindow(span_s=10.0)  # no opening time: a whole span is assumed watched
    unopened.arrived(100.0, 6)
    assert unopened.summary(100.02).arrival_rate == pytest.approx(0.1)


def test_the_trend_is_a_clear_slope_or_nothing() -> None:
    rng = np.random.default_rng(0)
    ramp, steady = LoadWindow(trend_s=120.0), LoadWindow(trend_s=120.0)
    for window, rate in ((ramp, lambda t: 1.0 + 0.05 * t), (steady, lambda t: 3.0)):
        t = 0.0
        while t < 300.0:  # Poisson arrivals at rate(t)
            t += rng.exponential(1.0 / rate(t))
            window.arrived(t, 100)
    assert ramp.summary(300.0).rate_trend == pytest.approx(0.05, rel=0.35)
    assert steady.summary(300.0).rate_trend == 0.0  # noise is not a ramp
    assert LoadWindow().summary(0.0).rate_trend == 0.0
    young = LoadWindow()
    for i in range(25):  # 25 s of a steep rise: under four whole buckets, no trend yet
        young.arrived(float(i), 10)
    assert young.summary(25.0).rate_trend == 0.0
    assert len(ramp._buckets) <= 13  # kept over the trend's span, not the run


def test_percentiles_need_enough_samples_and_match_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) is None
    values = [3.0, 1.0, 7.0, 2.0, 9.0, 4.0]
    for q in (50, 90, 99):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_planner_targets_from_an_slo() -> None:
    targets = planner_targets(parse_slo("ttft_p95=1.5s,itl_p95=40ms,e2el_p99=30s"))
    assert targets == (1.5, 0.04, 95.0)
    assert planner_targets(parse_slo("ttft_p99=2s,tpot_p99=50")).itl_s == 0.05
    with pytest.raises(SloError, match="TTFT and an ITL"):
        planner_targets(parse_slo("ttft_p99=2s"))
    with pytest.raises(SloError, match="one percentile"):
        planner_targets(parse_slo("ttft_p99=2s,itl_p50=20ms"))
    with pytest.raises(SloError, match="metric_pNN=limit"):
        parse_slo("latency=2s")
