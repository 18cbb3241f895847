"""LoadWindow: what the planner sees of the traffic, over the last `span_s` seconds.

Whoever serves requests (the coordinator, or the simulator) reports each arrival with its prompt
length, and each finished request with its output length, TTFT and mean ITL; `summary(now)`
gives the arrival rate, mean lengths and latency percentiles of what fell in the window, and the
rate's trend over a longer span (`trend_s`): the slope of a straight line through arrivals per
`TREND_BUCKET_S` bucket, or 0 while that slope is within two standard errors of flat (Poisson
noise must not look like a ramp). Plain Python: bounded by the spans, never by the run.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

MIN_SAMPLES = 5  # fewer finished requests in the window: no observed percentile
MAX_KEPT = 100_000  # per deque: a burst larger than this is summarised by its newest part
TREND_BUCKET_S = 10.0
MIN_TREND_BUCKETS = 4


class Finished(NamedTuple):
    at: float
    output_tokens: int
    ttft_s: float
    itl_s: float | None  # None for a one-token output


class WindowSummary(NamedTuple):
    arrival_rate: float  # requests per second
    mean_prompt: float  # tokens, of the arrivals
    mean_output: float  # tokens, of the finished requests (0 when none finished)
    ttft_s: float | None  # the window's percentile, None with too few samples
    itl_s: float | None
    finished: int
    rate_trend: float = 0.0  # requests per second, per second; 0 unless clearly sloped


class LoadWindow:
    def __init__(
        self,
        span_s: float = 10.0,
        percentile: float = 99.0,
        trend_s: float = 120.0,
        opened_at: float | None = None,
    ) -> None:
        """`opened_at`: when it began to watch (the server's start), on the clock of the times
        it is given; None: as if it had watched a whole span before the first arrival."""
        self.span_s = span_s
        self.percentile = percentile
        self.trend_s = trend_s
        self.arrivals: deque[tuple[float, int]] = deque(maxlen=MAX_KEPT)
        self.done: deque[Finished] = deque(maxlen=MAX_KEPT)
        self.opened_at = opened_at
        self.started_at: float | None = None  # the first arrival
        self._buckets: dict[int, int] = {}  # bucket number -> arrivals, over `trend_s`

    def arrived(self, at: float, prompt_tokens: int) -> None:
        if self.started_at is None:
            self.started_at = at
        self.arrivals.append((at, prompt_tokens))
        bucket = math.floor(at / TREND_BUCKET_S)
        self._buckets[bucket] = self._buckets.get(bucket, 0) + 1

    def finished(self, at: float, output_tokens: int, ttft_s: float, itl_s: float | None) -> None:
        self.done.append(Finished(at, output_tokens, ttft_s, itl_s))

    def summary(self, now: float) -> WindowSummary:
        since = now - self.span_s
        while self.arrivals and self.arrivals[0][0] < since:
            self.arrivals.popleft()
        while self.done and self.done[0].at < since:
            self.done.popleft()
        # A window younger than its span (the first seconds) divides by how long it has
        # watched: since it opened, not since the first arrival (one request a moment after a
        # long quiet read as tens of requests a second).
        opened = self.opened_at
        seen = self.span_s if opened is None else min(self.span_s, now - opened)
        prompts = [tokens for _, tokens in self.arrivals]
        itls = [f.itl_s for f in self.done if f.itl_s is not None]
        return WindowSummary(
            arrival_rate=len(prompts) / max(seen, 1e-9) if prompts else 0.0,
            mean_prompt=_mean(prompts),
            mean_output=_mean([f.output_tokens for f in self.done]),
            ttft_s=percentile([f.ttft_s for f in self.done], self.percentile),
            itl_s=percentile(itls, self.percentile),
            finished=len(self.done),
            rate_trend=self.trend(now),
        )

    def trend(self, now: float) -> float:
        """The arrival rate's slope over the whole buckets of the last `trend_s` seconds (those
        after the first arrival), if it is clearly not flat; else 0."""
        last = math.floor(now / TREND_BUCKET_S) - 1  # the newest whole bucket
        first = last - int(self.trend_s / TREND_BUCKET_S) + 1
        if self.started_at is not None:
            first = max(first, math.ceil(self.started_at / TREND_BUCKET_S))
        for bucket in [b for b in self._buckets if b < first]:
            del self._buckets[bucket]
        n = last - first + 1
        if n < MIN_TREND_BUCKETS:
            return 0.0
        xs = [(b + 0.5) * TREND_BUCKET_S for b in range(first, last + 1)]
        ys = [self._buckets.get(b, 0) / TREND_BUCKET_S for b in range(first, last + 1)]
        x_mean, y_mean = sum(xs) / n, sum(ys) / n
        sxx = sum((x - x_mean) ** 2 for x in xs)
        slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True)) / sxx
        residual = sum(
            (y - y_mean - slope * (x - x_mean)) ** 2 for x, y in zip(xs, ys, strict=True)
        )
        stderr = math.sqrt(residual / (n - 2) / sxx)
        return slope if abs(slope) > 2 * stderr else 0.0


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None with fewer than
    MIN_SAMPLES values."""
    if len(values) < MIN_SAMPLES:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
