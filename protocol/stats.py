"""What each worker reports for metrics and routing: plain data, fixed size whatever the uptime.

Counters are cumulative since the worker started; the metrics endpoint exports them as they are.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

# Upper bounds (seconds) of the kv_transfer_seconds histogram buckets; +Inf is implied.
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HANDOVER_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25,
    0.5, 1.0, 2.5,
)  # fmt: skip


@dataclass
class Histogram:
    """Counts per bucket, a count and a sum: O(1) memory and O(log buckets) per observation."""

    bounds: tuple[float, ...] = TRANSFER_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, the last one is +Inf
    count: int = 0
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        """`times` observations of `value`."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.count += times
        self.total += value * times

    def cumulative(self) -> tuple[int, ...]:
        """Cumulative counts per finite bound, as Prometheus buckets are."""
        out, running = [], 0
        for n in self.counts[:-1]:
            running += n
            out.append(running)
        return tuple(out)


class EngineHealth(NamedTuple):
    """What a supervisor needs to tell a working engine from a dead or stuck one."""

    alive: bool  # the engine thread runs (False after a crash or stop)
    busy: bool  # it has work queued or running
    seconds_since_progress: float  # since its loop last turned (a step, or an idle wait)
    error: str | None  # why it crashed

    def problem(self, stuck_after: float) -> str | None:
        """Why this engine cannot serve, or None when it can."""
        if not self.alive:
            return f"its engine thread stopped ({self.error or 'no error'})"
        if self.busy and self.seconds_since_progress > stuck_after:
            return f"its engine made no progress for {self.seconds_since_progress:.1f}s"
        return None


class PoolWorker(NamedTuple):
    """One worker as the supervisor sees it (for /admin/pools and /metrics)."""

    worker_id: str
    pool: str  # "prefill" | "decode" | "colocated"
    state: str  # "starting" | "serving" | "draining" | "dead"
    pool_restarts: int  # replacements this pool has started for retired workers


class EngineSnapshot(NamedTuple):
    """One engine's counts at a moment (LLMEngine.snapshot())."""

    num_running: int
    num_waiting: int
    queued_prefill_tokens: int  # prompt tokens admitted but not yet computed
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached


@dataclass(frozen=True)
class WorkerStats:
    worker: str  # e.g. "prefill-0", "decode-1", "colocated-0"
    pool: str  # "prefill" | "decode" | "colocated"
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_transfer_bytes: int = 0  # KV bytes this worker sent (prefill) or received (decode)
    kv_transfer_failures: int = 0
    kv_transfer_count: int = 0  # completed request transfers
    kv_transfer_seconds_sum: float = 0.0
    kv_transfer_buckets: tuple[int, ...] = (0,) * len(TRANSFER_BUCKETS)  # cumulative counts
    kv_exposed_count: int = 0  # prefill: transfers timed after their prefill step ended ...
    kv_exposed_seconds_sum: float = 0.0  # ... and that exposed part (what TTFT pays for KV)
    kv_exposed_buckets: tuple[int, ...] = (0,) * len(TRANSFER_BUCKETS)
    kv_checksum_failures: int = 0  # transfers whose bytes failed their checksum (decode)
    kv_stale_frames: int = 0  # frames and payloads of attempts no longer expected (decode)
    kv_channels_open: int = 0  # prefill: sender lanes; decode: receiver threads (rank 0's)
    requests_prefilled_locally: int = 0
    kv_transport: str = ""  # its name (gloo, ipc/nccl, ucx...); empty where nothing moves
    stale: bool = False  # the worker missed its last report; these are older values
    engine_busy_seconds: float = 0.0  # time its engine thread spent inside step()
    engine_step_count: int = 0
    engine_step_buckets: tuple[int, ...] = (0,) * len(TRANSFER_BUCKETS)  # cumulative counts

    @classmethod
    def of(cls, worker: str, pool: str, engine: EngineSnapshot, **transfer: object) -> WorkerStats:
        """An engine's snapshot plus the worker's own transfer counters."""
        return cls(worker, pool, **engine._asdict(), **transfer)  # type: ignore[arg-type]

    @property
    def kv_cache_usage(self) -> float:
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass
class StepTimer:
    """How long an engine's steps take (written by its thread only)."""

    seconds: Histogram = field(default_factory=Histogram)

    def fields(self) -> dict[str, object]:
        """WorkerStats fields for these timings."""
        return {
            "engine_busy_seconds": self.seconds.total,
            "engine_step_count": self.seconds.count,
            "engine_step_buckets": self.seconds.cumulative(),
        }


@dataclass
class TransferCounters:
    """A worker's KV transfer counters (owned by its engine thread)."""

    transport: str
    bytes: int = 0
    failures: int = 0
    checksum_failures: int = 0
    stale_frames: int = 0
    seconds: Histogram = field(default_factory=Histogram)
    exposed: Histogram = field(default_factory=Histogram)  # of that, after the prefill step

    def fields(self) -> dict[str, object]:
        """WorkerStats fields for these counters."""
        return {
            "kv_transfer_bytes": self.bytes,
            "kv_transfer_failures": self.failures,
            "kv_checksum_failures": self.checksum_failures,
            "kv_stale_frames": self.stale_frames,
            "kv_transfer_count": self.seconds.count,
            "kv_transfer_seconds_sum": self.seconds.total,
            "kv_transfer_buckets": self.seconds.cumulative(),
            "kv_exposed_count": self.exposed.count,
            "kv_exposed_seconds_sum": self.exposed.total,
            "kv_exposed_buckets": self.exposed.cumulative(),
            "kv_transport": self.transport,
        }
