"""TelemetryStore: what the coordinator keeps of its workers' step records and cache reports.

Once per stats poll the coordinator asks each worker for what it logged after the cursors kept
here (`cursor`), and hands the reply to `apply`. A worker's recent steps stay in a bounded
window (for /admin/telemetry, `tandem profile --from-telemetry` and the planner); prefix-cache
events go on to the router's index. Pure Python on plain data.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from protocol.telemetry import StepRecord, Telemetry

RECENT_STEPS = 4096  # per worker
UNREAD_STEPS = 65536  # of every worker, not taken yet by the one reader (the planner)


class CacheReport(NamedTuple):
    stored: list[int]
    evicted: list[int]
    snapshot: bool  # `stored` is everything the worker's cache holds


@dataclass
class WorkerTelemetry:
    step_seq: int = 0
    prefix_seq: int = 0
    steps_total: int = 0
    steps_missed: int = 0  # records the worker dropped before they were asked for
    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))


class TelemetryStore:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerTelemetry] = {}
        # Every record once, in arrival order: no cursor by step end time, which would compare
        # the clocks of different workers (hosts) and drop a late reply's steps.
        self.unread: deque[StepRecord] = deque(maxlen=UNREAD_STEPS)

    def cursor(self, worker_id: str) -> tuple[int, int]:
        """(step_seq, prefix_seq) to ask the worker for next."""
        kept = self.workers.get(worker_id)
        return (0, 0) if kept is None else (kept.step_seq, kept.prefix_seq)

    def apply(self, worker_id: str, reply: Telemetry) -> CacheReport:
        kept = self.workers.setdefault(worker_id, WorkerTelemetry())
        kept.step_seq, kept.prefix_seq = reply.step_seq, reply.prefix_seq
        records = [StepRecord(*record) for record in reply.steps]
        kept.recent.extend(records)
        self.unread.extend(records)
        kept.steps_total += len(reply.steps)
        kept.steps_missed += reply.steps_missed
        if reply.prefix_snapshot is not None:
            return CacheReport(list(reply.prefix_snapshot), [], snapshot=True)
        last = {digest: stored for digest, stored in reply.prefix_events}  # the latest wins
        stored = [digest for digest, now in last.items() if now]
        return CacheReport(stored, [digest for digest, now in last.items() if not now], False)

    def forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def take_steps(self) -> list[StepRecord]:
        """Every worker's step records that arrived since the last call, each handed out once."""
        taken = list(self.unread)
        self.unread.clear()
        return taken

    def recent(self, worker_id: str | None = None, limit: int | None = None) -> dict:
        """Each worker's (or one worker's) latest step records, oldest first."""
        chosen = {
            w: kept for w, kept in self.workers.items() if worker_id is None or w == worker_id
        }
        return {
            w: {
                "steps_total": kept.steps_total,
                "steps_missed": kept.steps_missed,
                "steps": [r._asdict() for r in list(kept.recent)[-(limit or RECENT_STEPS) :]],
            }
            for w, kept in chosen.items()
        }
