"""Worker-level Prometheus metrics: a collector that reads `EngineClient.stats()` at scrape time.

Workers keep cumulative counters (see `protocol.stats.WorkerStats`); they are exported as they
are, one series per worker, labelled model / worker / pool. Pool-wide queue depths are sums over
the pool's workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from protocol.stats import TRANSFER_BUCKETS, Histogram, PoolWorker, WorkerStats

WORKER_LABELS = ["model", "worker", "pool"]

# (metric name, help, WorkerStats attribute) for the per-worker series.
GAUGES = (
    ("tandem:num_requests_running", "Requests in the worker's running batch.", "num_running"),
    ("tandem:num_requests_waiting", "Requests queued at the worker.", "num_waiting"),
    ("tandem:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", "kv_cache_usage"),
    ("tandem:queued_prefill_tokens", "Prompt tokens waiting to be prefilled.",
     "queued_prefill_tokens"),
    ("tandem:kv_channels_open", "KV channels the worker holds open, each with a thread (a "
     "prefill worker's sender lanes, a decode worker's receivers; rank 0's).",
     "kv_channels_open"),
)  # fmt: skip
COUNTERS = (
    ("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("tandem:kv_transfer_bytes", "KV bytes sent (prefill) or received (decode).",
     "kv_transfer_bytes"),
    ("tandem:kv_transfer_failures", "KV transfers that failed.", "kv_transfer_failures"),
    ("tandem:kv_checksum_failures", "KV transfers whose bytes failed their checksum.",
     "kv_checksum_failures"),
    ("tandem:kv_stale_frames", "KV frames and payloads of attempts no longer expected, dropped "
     "unread into any block.", "kv_stale_frames"),
    ("tandem:requests_prefilled_locally", "Requests a decode worker prefilled itself.",
     "requests_prefilled_locally"),
    ("tandem:engine_busy_seconds", "Time the worker's engine thread spent inside step(): its "
     "busy fraction is this counter's rate.", "engine_busy_seconds"),
)  # fmt: skip


class WorkerStatsCollector(Collector):
    def __init__(
        self,
        model: str,
        stats: Callable[[], list[WorkerStats]],
        pools: Callable[[], list[PoolWorker]] = list,
        handover: Histogram | None = None,
    ) -> None:
        self.model = model
        self.stats = stats
        self.pools = pools
        self.handover = handover
        # Pools seen, with their restarts: a pool whose last worker is gone still reads 0
        # serving workers (an alert on "< 1" fires) instead of vanishing from the scrape.
        self._seen: dict[str, int] = {}

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration; the names are fixed above

    def collect(self) -> Iterator[Metric]:
        snapshot = self.stats()
        for name, text, attribute in GAUGES:
            family = GaugeMetricFamily(name, text, labels=WORKER_LABELS)
            for s in snapshot:
                family.add_metric(self._labels(s), float(getattr(s, attribute)))
            yield family
        for name, text, attribute in COUNTERS:
            family = CounterMetricFamily(name, text, labels=WORKER_LABELS)
            for s in snapshot:
                family.add_metric(self._labels(s), float(getattr(s, attribute)))
            yield family
        yield self._transfer_seconds(snapshot)
        yield self._histogram(
            "tandem:kv_transfer_exposed_seconds",
            "Of a request's KV transfer, the part after its prefill step ended (TTFT pays it).",
            snapshot,
            lambda s: (s.kv_exposed_buckets, s.kv_exposed_count, s.kv_exposed_seconds_sum),
        )
        yield self._step_seconds(snapshot)
        yield self._pool_queue_depth(snapshot)
        yield self._transport(snapshot)
        yield from self._pool_states(self.pools())
        stale = GaugeMetricFamily(
            "tandem:worker_stats_stale",
            "1 while the worker's last stats report is missing (values are older).",
            labels=WORKER_LABELS,
        )
        for s in snapshot:
            stale.add_metric(self._labels(s), float(s.stale))
        yield stale
        if self.handover is not None:
            yield self._handover(self.handover)

    def _handover(self, handover: Histogram) -> Metric:
        family = HistogramMetricFamily(
            "tandem:kv_handover_seconds",
            "Disaggregated requests: from the end of the prefill step on the prefill worker to "
            "the first token leaving the coordinator for the client (KV transfer, result, "
            "dispatch). Wall clocks: across hosts it includes their skew.",
            labels=["model"],
        )
        family.add_metric([self.model], histogram_buckets(handover), handover.total)
        return family

    def _pool_states(self, workers: list[PoolWorker]) -> Iterator[Metric]:
        sizes = GaugeMetricFamily(
            "tandem:pool_workers", "Workers per pool and state.", labels=["model", "pool", "state"]
        )
        counts = {(pool, "serving"): 0 for pool in self._seen}
        restarts = self._seen
        for w in workers:
            counts[(w.pool, w.state)] = counts.get((w.pool, w.state), 0) + 1
            restarts[w.pool] = w.pool_restarts
        for (pool, state), count in sorted(counts.items()):
            sizes.add_metric([self.model, pool, state], float(count))
        yield sizes
        states = GaugeMetricFamily(
            "tandem:worker_state", "Each worker's state (value always 1).",
            labels=[*WORKER_LABELS, "state"],
        )  # fmt: skip
        for w in workers:
            states.add_metric([self.model, w.worker_id, w.pool, w.state], 1.0)
        yield states
        restarted = CounterMetricFamily(
            "tandem:worker_restarts", "Replacements started for retired workers.",
            labels=["model", "pool"],
        )  # fmt: skip
        for pool, count in sorted(restarts.items()):
            restarted.add_metric([self.model, pool], float(count))
        yield restarted

    def _labels(self, s: WorkerStats) -> list[str]:
        return [self.model, s.worker, s.pool]

    def _transfer_seconds(self, snapshot: list[WorkerStats]) -> Metric:
        return self._histogram(
            "tandem:kv_transfer_seconds", "Duration of one request's KV transfer.", snapshot,
            lambda s: (s.kv_transfer_buckets, s.kv_transfer_count, s.kv_transfer_seconds_sum),
        )  # fmt: skip

    def _step_seconds(self, snapshot: list[WorkerStats]) -> Metric:
        return self._histogram(
            "tandem:engine_step_seconds", "Duration of one engine step.", snapshot,
            lambda s: (s.engine_step_buckets, s.engine_step_count, s.engine_busy_seconds),
        )  # fmt: skip

    def _histogram(
        self,
        name: str,
        text: str,
        snapshot: list[WorkerStats],
        series: Callable[[WorkerStats], tuple[tuple[int, ...], int, float]],
    ) -> Metric:
        """A histogram family from each worker's (cumulative bucket counts, count, sum)."""
        family = HistogramMetricFamily(name, text, labels=WORKER_LABELS)
        for s in snapshot:
            counts, count, total = series(s)
            family.add_metric(self._labels(s), _buckets(TRANSFER_BUCKETS, counts, count), total)
        return family

    def _transport(self, snapshot: list[WorkerStats]) -> Metric:
        family = GaugeMetricFamily(
            "tandem:kv_transport_info",
            "The KV transport each worker uses (value always 1).",
            labels=[*WORKER_LABELS, "transport"],
        )
        for s in snapshot:
            if s.kv_transport:
                family.add_metric([*self._labels(s), s.kv_transport], 1.0)
        return family

    def _pool_queue_depth(self, snapshot: list[WorkerStats]) -> Metric:
        family = GaugeMetricFamily(
            "tandem:pool_queue_depth",
            "Requests queued at the pool's workers, summed.",
            labels=["model", "pool"],
        )
        depths: dict[str, int] = {}
        for s in snapshot:
            depths[s.pool] = depths.get(s.pool, 0) + s.num_waiting
        for pool, depth in sorted(depths.items()):
            family.add_metric([self.model, pool], float(depth))
        return family


def _buckets(
    bounds: tuple[float, ...], cumulative: tuple[int, ...], count: int
) -> list[tuple[str, float]]:
    """Prometheus' (le, cumulative count) pairs, +Inf last."""
    return [*((str(b), n) for b, n in zip(bounds, cumulative, strict=True)), ("+Inf", count)]


def histogram_buckets(histogram: Histogram) -> list[tuple[str, float]]:
    return _buckets(histogram.bounds, histogram.cumulative(), histogram.count)
