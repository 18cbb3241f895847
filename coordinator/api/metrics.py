"""Request-level Prometheus metrics, observed by the HTTP layer from the streams it relays.

Names carry the `tandem:` prefix and follow vLLM's where they mean the same thing, so existing
dashboards need only the prefix changed. Worker-level metrics come from `worker_metrics`.
Each app has its own registry: several servers in one process (tests) never share counters.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.api.planner_metrics import PlannerCollector
from coordinator.api.streams import closing
from coordinator.api.worker_metrics import WorkerStatsCollector, histogram_buckets
from coordinator.planner_loop import PlannerLoop
from engine.outputs import RequestOutput
from protocol.stats import Histogram as ProtocolHistogram
from protocol.stats import PoolWorker, WorkerStats

LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
TOKEN_GAP_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 20.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0,
)  # fmt: skip


class ServerMetrics:
    """The request-level series. The inter-token histogram and the token counter move once
    per token per stream, so all of them are plain fixed-bucket histograms and integers
    (`protocol.stats.Histogram`: a bisect and three additions, 0.4 us) exported at scrape time
    by `_RequestCollector`, where prometheus-client's Histogram takes a lock and walks its
    buckets in Python (1.4 us, and its Counter 0.7 us). Observed and scraped on the event
    loop's thread only."""

    def __init__(
        self,
        model: str,
        worker_stats: Callable[[], list[WorkerStats]],
        admission_waiting: Callable[[], int],
        pools: Callable[[], list[PoolWorker]] = list,
        handover: ProtocolHistogram | None = None,
        planner: PlannerLoop | None = None,
    ) -> None:
        self.model = model
        self.registry = r = CollectorRegistry()
        self.ttft = ProtocolHistogram(LATENCY_BUCKETS)
        self.itl = ProtocolHistogram(TOKEN_GAP_BUCKETS)
        self.e2e = ProtocolHistogram(REQUEST_BUCKETS)
        self.queue_time = ProtocolHistogram(REQUEST_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = Counter(
            "tandem:request_success", "Finished requests, by finish reason.",
            ["model", "finished_reason"], registry=r,
        )  # fmt: skip
        waiting = Gauge(
            "tandem:admission_queue_depth", "Sequences admitted over HTTP with no output yet.",
            ["model"], registry=r,
        )  # fmt: skip
        waiting.labels(model).set_function(admission_waiting)
        r.register(_RequestCollector(self))
        r.register(WorkerStatsCollector(model, worker_stats, pools, handover))
        if planner is not None:
            r.register(PlannerCollector(model, planner))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def track(
        self, stream: AsyncIterator[RequestOutput], arrival: float
    ) -> AsyncIterator[RequestOutput]:
        """Relays one request's outputs unchanged, observing its timings and tokens.
        `arrival` is a time.monotonic() reading taken when the HTTP request came in. A request
        that ends unfinished counts as finished for reason "abort" (its client went away) or
        "error" (it failed), as vLLM counts them."""
        last: float | None = None
        queued = False  # its queue time observed (it may come after the first token, from a
        # prefill worker whose answer the decode worker's first update overtook)
        unfinished = "abort"
        try:
            async with closing(stream):
                async for output in stream:
                    now = time.monotonic()
                    num_new = len(output.delta_token_ids)
                    if not queued and output.queue_seconds is not None:
                        self.queue_time.observe(output.queue_seconds)
                        queued = True
                    if last is None:
                        self._first_output(output, now - arrival)
                        if num_new > 1:  # tokens joined to the first came with it
                            self.itl.observe(0.0, num_new - 1)
                    elif num_new:  # a batch of k tokens counts as k gaps of 1/k of the wait
                        self.itl.observe((now - last) / num_new, num_new)
                    last = now
                    self.generation_tokens += num_new
                    if output.finished:
                        self.e2e.observe(now - arrival)
                        self.success.labels(self.model, output.finish_reason).inc()
                        unfinished = ""
                    yield output
        except Exception:
            unfinished = unfinished and "error"
            raise
        finally:
            if unfinished:
                self.success.labels(self.model, unfinished).inc()

    def _first_output(self, output: RequestOutput, ttft: float) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens += len(output.prompt_token_ids)


# (name, help, ServerMetrics attribute) of the request-level histograms and counters.
_HISTOGRAMS = (
    ("tandem:time_to_first_token_seconds", "Arrival to first token.", "ttft"),
    ("tandem:inter_token_latency_seconds", "Time between output tokens.", "itl"),
    ("tandem:e2e_request_latency_seconds", "Arrival to last token.", "e2e"),
    ("tandem:request_queue_time_seconds", "Time waiting to be scheduled.", "queue_time"),
)
_COUNTERS = (
    ("tandem:prompt_tokens", "Prompt tokens of started requests.", "prompt_tokens"),
    ("tandem:generation_tokens", "Generated tokens.", "generation_tokens"),
)


class _RequestCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration; the names are fixed above

    def collect(self) -> Iterator[Metric]:
        m, labels = self.metrics, [self.metrics.model]
        for name, text, attribute in _HISTOGRAMS:
            h: ProtocolHistogram = getattr(m, attribute)
            family = HistogramMetricFamily(name, text, labels=["model"])
            family.add_metric(labels, histogram_buckets(h), h.total)
            yield family
        for name, text, attribute in _COUNTERS:
            family = CounterMetricFamily(name, text, labels=["model"])
            family.add_metric(labels, float(getattr(m, attribute)))
            yield family
