"""Admission: a bounded queue in front of the backend, and draining on shutdown.

A generation request is *waiting* from admission until its first token arrives (queued in a
scheduler or being prefilled), then *running* until its response is complete. Only waiting
requests are bounded: running ones are already bounded by the workers' batch limits, and a full
waiting queue means the backend is behind, so a new request gets 503 with `Retry-After` instead
of a wait no client would accept. While draining every new request gets 503.

Everything here runs on the event loop thread; no locks.
"""

from __future__ import annotations

from coordinator.api.errors import ApiError


class Admission:
    def __init__(self, max_waiting: int, retry_after_s: int = 1) -> None:
        if max_waiting < 1:
            raise ValueError("the admission queue must hold at least one request")
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.num_waiting = 0
        self.num_in_flight = 0
        self.draining = False

    def admit(self) -> Ticket:
        """A ticket for one request, or ApiError(503) when full or draining."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.num_waiting >= self.max_waiting:
            raise ApiError(
                503,
                f"the server is overloaded: {self.num_waiting} requests are waiting to start; "
                "retry later",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.num_waiting += 1
        self.num_in_flight += 1
        return Ticket(self)

    def start_draining(self) -> None:
        self.draining = True

    @property
    def idle(self) -> bool:
        return self.num_in_flight == 0


class Ticket:
    """One admitted request's place; `started()` once it has output, `release()` when done.
    Both are idempotent, so every exit path may call them."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._waiting = True
        self._released = False

    def started(self) -> None:
        if self._waiting:
            self._waiting = False
            self._admission.num_waiting -= 1

    def release(self) -> None:
        if self._released:
            return
        self.started()
        self._released = True
        self._admission.num_in_flight -= 1
