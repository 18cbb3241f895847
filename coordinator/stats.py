"""WorkerStats: the plain-data snapshot each worker reports for metrics and routing.

Counters are cumulative since the worker started; the metrics endpoint exports them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

# Upper bounds (seconds) of the kv_transfer_seconds histogram buckets; +Inf is implied.
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def bucket_counts(seconds: list[float]) -> tuple[int, ...]:
    """Cumulative histogram counts of `seconds` over TRANSFER_BUCKETS."""
    return tuple(sum(s <= bound for s in seconds) for bound in TRANSFER_BUCKETS)


@dataclass(frozen=True)
class WorkerStats:
    worker: str  # e.g. "prefill-0", "decode-1", "colocated-0"
    pool: str  # "prefill" | "decode" | "colocated"
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens waiting to be prefilled
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    kv_transfer_bytes: int = 0  # KV bytes this worker sent (prefill) or received (decode)
    kv_transfer_failures: int = 0
    kv_transfer_count: int = 0  # completed request transfers
    kv_transfer_seconds_sum: float = 0.0
    kv_transfer_buckets: tuple[int, ...] = (0,) * len(TRANSFER_BUCKETS)  # cumulative counts
    requests_prefilled_locally: int = 0
    kv_transport: str = ""  # gloo | nccl | ucx; empty where nothing moves

    @property
    def kv_cache_usage(self) -> float:
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks
