"""Benchmark metrics with vLLM's definitions, as pure functions of the request results.

TTFT: send -> first generated text. TPOT: (E2EL - TTFT) / (output_tokens - 1), only for requests
with more than one output token. ITL: every gap between consecutive text chunks. E2EL: send ->
last generated text. Throughputs divide by the benchmark duration; only successful requests count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from loadtest.client import RequestResult
from loadtest.config import GoodputSLO

MS_PER_S = 1000.0


@dataclass(frozen=True)
class Distribution:
    """One latency metric over all requests, in milliseconds. An empty sample summarizes to
    zeros, as vLLM's does, so the JSON keeps its shape."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    max_output_tokens_per_s: float  # the most text chunks in one second, as vLLM counts them
    max_concurrent_requests: int  # vLLM's: the most requests active in one whole second
    peak_concurrent_requests: int  # the most requests between send and last chunk at once


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
    values = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * MS_PER_S
    return Distribution(
        mean=float(np.mean(values)),
        median=float(np.median(values)),
        std=float(np.std(values)),
        percentiles={p: float(np.percentile(values, p)) for p in percentiles},
    )


def output_len(result: RequestResult) -> int:
    """Output tokens of a successful request; 0 for a failed one, as vLLM counts them."""
    return (result.output_tokens or 0) if result.success else 0


def tpot_s(result: RequestResult) -> float | None:
    """Seconds per output token after the first; None with fewer than two output tokens."""
    tokens = output_len(result)
    if tokens < 2 or result.latency is None or result.ttft is None:
        return None
    return (result.latency - result.ttft) / (tokens - 1)


def meets_slo(result: RequestResult, slo: GoodputSLO) -> bool:
    """True when the request meets every objective set; like vLLM, a request without a TPOT
    (one output token) counts as TPOT 0."""
    measured = {
        "ttft": result.ttft,
        "tpot": tpot_s(result) or 0.0,
        "e2el": result.latency,
    }
    limits = {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms, "e2el": slo.e2el_ms}
    return all(
        limit is None or (measured[name] is not None and measured[name] * MS_PER_S <= limit)
        for name, limit in limits.items()
    )


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float],
    slo: GoodputSLO | None,
) -> BenchmarkMetrics:
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(output_len(r) for r in done)
    good = None if slo is None else sum(meets_slo(r, slo) for r in done) / duration_s
    tpots = [t for t in map(tpot_s, done) if t is not None]
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(results) - len(done),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(done) / duration_s,
        request_goodput=good,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft=summarize([r.ttft for r in done if r.ttft is not None], percentiles),
        tpot=summarize(tpots, percentiles),
        itl=summarize(list(chain.from_iterable(r.itl for r in done)), percentiles),
        e2el=summarize([r.latency for r in done if r.latency is not None], percentiles),
        max_output_tokens_per_s=peak_chunks_per_s(done),
        max_concurrent_requests=busiest_second(done),
        peak_concurrent_requests=peak_concurrency(done),
    )


def chunk_times(result: RequestResult) -> np.ndarray:
    """perf_counter times of the chunks carrying generated text."""
    if result.ttft is None:
        return np.empty(0)
    first = result.sent_at + result.ttft
    return np.concatenate(([first], first + np.cumsum(np.asarray(result.itl, dtype=float))))


def peak_chunks_per_s(done: Sequence[RequestResult]) -> float:
    """vLLM's max_output_tokens_per_s: text chunks (one counted as one token) in the busiest
    whole second, seconds counted from the first send."""
    times = np.concatenate([chunk_times(r) for r in done]) if done else np.empty(0)
    if not len(times):
        return 0.0
    start = min(r.sent_at for r in done)
    seconds = np.floor(times - start).astype(int)
    return float(np.bincount(seconds[seconds >= 0]).max())


def busiest_second(done: Sequence[RequestResult]) -> int:
    """vLLM's max_concurrent_requests: the most requests active at any time within one whole
    second (seconds counted from the first send), so up to about twice the requests in flight
    at once when requests are short."""
    timed = [r for r in done if r.latency is not None]
    if not timed:
        return 0
    start = min(r.sent_at for r in timed)
    end = max(r.sent_at + r.latency for r in timed)
    active = np.zeros(int(np.ceil(end - start)) + 1, dtype=int)
    for r in timed:
        active[int(r.sent_at - start) : int(r.sent_at + r.latency - start) + 1] += 1
    return int(active.max())


def peak_concurrency(done: Sequence[RequestResult]) -> int:
    """The most requests in flight at once, each over [sent, sent + E2EL)."""
    events = [(r.sent_at, 1) for r in done if r.latency is not None]
    events += [(r.sent_at + r.latency, -1) for r in done if r.latency is not None]
    level = peak = 0
    for _, step in sorted(events):  # at a tie an end (-1) sorts before a start
        level += step
        peak = max(peak, level)
    return peak
