"""RoomQueue: requests that found no decode worker with room wait here, in one line.

A remote prefill needs its decode worker to reserve KV blocks first; when every decode worker
is full the reservation is refused and the request waits. Waiting by polling (each request
retrying on its own timer) costs a route and a refused call per request per tick, and lets a
late request overtake one that waited longer. Here the waiters form one line instead, ordered
by when each request arrived:

- whatever may have made room (a request ended on a decode worker, a decode worker joined, a
  stats report) calls `freed`, which wakes one waiter, only it;
- the woken request tries once: placed, it calls `freed` again to pass the turn on (there may be
  room for more); refused, it takes its place in the line again;
- a request arriving while others wait joins the line without trying (room appears only by
  the events above, each of which wakes someone).

Which waiter: the oldest, unless the oldest has already waited longer than `late_after_s` (the
TTFT objective, when one is set). Then the line is overloaded and the oldest will miss its
objective whatever happens; serving it first would make every request behind it miss too. So
while the oldest is late the newest goes first (adaptive LIFO): requests that can still be on
time are, and the late ones are served as soon as the load falls back under capacity.

Pure bookkeeping on callbacks and times (no asyncio): the coordinator's waiters resolve a future
(and give up after their own deadline), the simulator's schedule an event.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

Wake = Callable[[], None]


class RoomQueue:
    def __init__(self, clock: Callable[[], float], late_after_s: float | None = None) -> None:
        self.clock = clock
        self.late_after_s = late_after_s
        self._line: list[tuple[float, int, Wake]] = []  # (arrived, order, wake), oldest first
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._line)

    def wait(self, wake: Wake, arrived: float) -> None:
        """Queues a waiter for a request that arrived at `arrived` (on `clock`)."""
        bisect.insort(self._line, (arrived, next(self._order), wake))

    def leave(self, wake: Wake) -> None:
        """A waiter that gave up (deadline, cancelled) leaves the line."""
        for i, (_, _, waiting) in enumerate(self._line):
            if waiting is wake:
                del self._line[i]
                return

    def freed(self) -> None:
        """Room may have appeared: one waiter tries (the oldest, or the newest while the
        oldest is late)."""
        if not self._line:
            return
        late = self.late_after_s is not None and (
            self.clock() - self._line[0][0] > self.late_after_s
        )
        _, _, wake = self._line.pop(-1 if late else 0)
        wake()
