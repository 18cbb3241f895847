"""The SLO planner's Prometheus metrics, read from its loop at scrape time.

tandem:planner_mode{mode}                   1 for the mode it runs in
tandem:planner_decisions{action}            decisions so far, by action (a counter)
tandem:planner_target_workers{pool}         the layout of its latest decision
tandem:planner_predicted_ttft_seconds       for the layout serving now, queue included
tandem:planner_predicted_itl_seconds
tandem:planner_observed_ttft_seconds        the watched percentile over the last window
tandem:planner_observed_itl_seconds         (NaN until enough requests finished)
tandem:planner_arrival_rate                 requests per second over the window
tandem:planner_infeasible                   1 while no layout within its bounds meets the SLO
tandem:planner_profile_factor               live steps' time / the profile's prediction
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.planner_loop import MODES, PlannerLoop

ACTIONS = ("none", "switch", "grow", "shrink", "infeasible")


class PlannerCollector(Collector):
    def __init__(self, model: str, planner: PlannerLoop) -> None:
        self.model = model
        self.planner = planner

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        loop, model = self.planner, [self.model]
        mode = GaugeMetricFamily(
            "tandem:planner_mode", "The planner's mode.", labels=["model", "mode"]
        )
        for name in MODES:
            mode.add_metric([*model, name], float(loop.mode == name))
        yield mode
        decisions = CounterMetricFamily(
            "tandem:planner_decisions", "Planner decisions, by action.", labels=["model", "action"]
        )
        for action in ACTIONS:
            decisions.add_metric([*model, action], float(loop.counts[action]))
        yield decisions
        current, seen = loop.current, loop.last
        target = GaugeMetricFamily(
            "tandem:planner_target_workers", "Workers per pool of the latest decision.",
            labels=["model", "pool"],
        )  # fmt: skip
        if current is not None:
            target.add_metric([*model, "prefill"], float(current.prefill_workers))
            target.add_metric([*model, "decode"], float(current.decode_workers))
        yield target
        predicted = None if current is None else current.current
        yield self._gauge("predicted_ttft_seconds", "Predicted TTFT of the layout serving now.",
                          None if predicted is None else predicted.ttft_s)  # fmt: skip
        yield self._gauge("predicted_itl_seconds", "Predicted ITL of the layout serving now.",
                          None if predicted is None else predicted.itl_s)  # fmt: skip
        yield self._gauge("observed_ttft_seconds", "TTFT percentile over the planner's window.",
                          None if seen is None else seen.observed_ttft_s)  # fmt: skip
        yield self._gauge("observed_itl_seconds", "ITL percentile over the planner's window.",
                          None if seen is None else seen.observed_itl_s)  # fmt: skip
        yield self._gauge("arrival_rate", "Requests per second over the planner's window.",
                          None if seen is None else seen.arrival_rate)  # fmt: skip
        infeasible = current is not None and current.action == "infeasible"
        yield self._gauge("infeasible", "1 while no layout within bounds meets the SLO.",
                          float(infeasible))  # fmt: skip
        yield self._gauge("profile_factor", "Live step time over the profile's prediction.",
                          loop.model.factor)  # fmt: skip

    def _gauge(self, name: str, text: str, value: float | None) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"tandem:planner_{name}", text, labels=["model"])
        family.add_metric([self.model], math.nan if value is None else float(value))
        return family
