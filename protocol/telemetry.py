"""Step telemetry and prefix-cache events: what workers batch to the coordinator, and how.

Every engine step appends one `StepRecord` (a tuple append, nothing more on the engine thread);
the block manager appends a `PrefixEvent` whenever a block's hash enters or leaves its prefix
cache. Both go into a `SeqLog`: a bounded log numbered from 0. The coordinator asks each worker,
once per stats poll, for everything after the last number it has seen (`Telemetry`), so nothing
crosses per step, and a reply lost to a timeout is simply asked for again. When the coordinator
falls further behind than the log holds, the reply says so (`complete=False`): step records are
then missing (counted), and prefix events are replaced by a snapshot of the whole cache.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")

STEP_LOG_SIZE = 8192  # steps kept for the coordinator (a few seconds at GPU step rates)
PREFIX_LOG_SIZE = 16384  # prefix-cache events kept between polls


class StepRecord(NamedTuple):
    """One engine step's shape and wall time: the inputs of the per-step cost model."""

    end: float  # time.time() when the step ended
    seconds: float  # schedule to sampled tokens, on the engine thread
    prefill_tokens: int  # tokens of multi-token chunks (prompt chunks) in the batch
    prefill_attention: int  # sum over prompt chunks of new tokens x context length at chunk end
    decode_seqs: int  # single-token chunks (decoding sequences)
    decode_context: int  # sum of the decoding sequences' context lengths
    kv_blocks_used: int  # after the step
    queue_length: int  # requests waiting for their first step, after the step
    # the engine thread's compute threads as the step began (workers that share a host's cores
    # change theirs between steps: kernels/core_share.py); 0: not recorded
    threads: int = 0


class PrefixEvent(NamedTuple):
    digest: int  # a full block's chained hash (engine/block_manager.py)
    stored: bool  # True: the block entered the prefix cache; False: it was evicted


class SeqLog(Generic[T]):
    """A bounded log numbered from 0; one thread appends, any thread reads `since`."""

    def __init__(self, capacity: int) -> None:
        self._items: deque[T] = deque(maxlen=capacity)
        self._next = 0  # the number the next item gets
        self._lock = threading.Lock()

    def append(self, item: T) -> None:
        with self._lock:
            self._items.append(item)
            self._next += 1

    def extend(self, items: list[T]) -> None:
        with self._lock:
            self._items.extend(items)
            self._next += len(items)

    def since(self, seq: int) -> tuple[int, list[T], bool]:
        """(next number, the items numbered `seq` and later that are still kept, whether
        those are all of them)."""
        with self._lock:
            first = self._next - len(self._items)
            items = list(self._items)[max(0, seq - first) :] if seq < self._next else []
            return self._next, items, seq >= first


class Telemetry(NamedTuple):
    """A worker's reply to `telemetry(step_seq, prefix_seq)`."""

    step_seq: int  # ask for this next
    steps: list[StepRecord]
    steps_missed: int  # records that fell out of the log before they were asked for
    prefix_seq: int
    prefix_events: list[PrefixEvent]
    prefix_snapshot: list[int] | None  # every cached digest, when events were missed


def read_telemetry(
    steps: SeqLog[StepRecord],
    prefix: SeqLog[PrefixEvent],
    snapshot: Callable[[], list[int]],
    step_seq: int,
    prefix_seq: int,
) -> Telemetry:
    """What a worker answers: the records and events after the coordinator's cursors."""
    next_step, records, _ = steps.since(step_seq)
    missed = max(0, next_step - step_seq - len(records))
    next_prefix, events, complete = prefix.since(prefix_seq)
    if complete:
        return Telemetry(next_step, records, missed, next_prefix, events, None)
    # Cut off: take the number first, then the cache, so events after the snapshot repeat
    # (harmless: applying an event twice gives the same index) rather than go missing.
    next_prefix, _, _ = prefix.since(next_prefix)
    return Telemetry(next_step, records, missed, next_prefix, [], snapshot())
