"""RoomQueue: requests that found no decode worker with room wait here, first come first served.

A remote prefill needs its decode worker to reserve KV blocks first; when every decode worker
is full the reservation is refused and the request waits. Waiting by polling (each request
retrying on its own timer) costs a route and a refused call per request per tick, and lets a
late request overtake one that waited longer. Here the waiters form one line instead:

- whatever may have made room (a request ended on a decode worker, a decode worker joined, a
  stats report) calls `freed`, which wakes the first in line, only it;
- the woken request tries once: placed, it calls `freed` again to pass the turn on (there may be
  room for more); refused, it goes back to the front of the line;
- a request arriving while others wait joins the back of the line and wakes the first.

Pure bookkeeping on callbacks, no clock and no asyncio: the coordinator's waiters resolve a
future (and give up after their own deadline), the simulator's schedule an event.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable

Wake = Callable[[], None]


class RoomQueue:
    def __init__(self) -> None:
        self._line: deque[Wake] = deque()

    def __len__(self) -> int:
        return len(self._line)

    def wait(self, wake: Wake, front: bool = False) -> None:
        """Queues a waiter; `front`: it was first in line and was refused again."""
        if front:
            self._line.appendleft(wake)
        else:
            self._line.append(wake)

    def leave(self, wake: Wake) -> None:
        """A waiter that gave up (deadline, cancelled) leaves the line."""
        with contextlib.suppress(ValueError):
            self._line.remove(wake)

    def freed(self) -> None:
        """Room may have appeared: the first in line tries."""
        if self._line:
            self._line.popleft()()
