"""Admission: a bounded queue in front of the backend, and draining on shutdown.

A sequence (one prompt x choice of a request) is *waiting* from admission until its first
token arrives (queued in a scheduler or being prefilled), then *running* until its response is
complete. Only waiting sequences are bounded: running ones are already bounded by the workers'
batch limits, and a full waiting queue means the backend is behind, so a new request gets 503
with `Retry-After` instead of a wait no client would accept. While draining every new request
gets 503.

Everything here runs on the event loop thread; no locks.
"""

from __future__ import annotations

from coordinator.api.errors import ApiError


class Admission:
    def __init__(self, max_waiting: int, retry_after_s: int = 1) -> None:
        if max_waiting < 1:
            raise ValueError("the admission queue must hold at least one sequence")
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.num_waiting = 0  # sequences admitted without output yet
        self.num_in_flight = 0  # requests admitted and not yet released
        self.draining = False
        self.cut_off = False  # the drain's grace is over: streams end at their next output

    def admit(self, num_sequences: int = 1) -> Ticket:
        """A ticket for one request that fans out to `num_sequences` engine sequences (prompts
        x n), or ApiError: 503 when full or draining, 400 when it could never fit."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if num_sequences > self.max_waiting:
            raise ApiError(
                400,
                f"the request fans out to {num_sequences} sequences (prompts x n); this server "
                f"admits at most {self.max_waiting} at once",
                code="too_many_sequences",
            )
        if self.num_waiting + num_sequences > self.max_waiting:
            raise ApiError(
                503,
                f"the server is overloaded: {self.num_waiting} sequences are waiting to start; "
                "retry later",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.num_waiting += num_sequences
        self.num_in_flight += 1
        return Ticket(self, num_sequences)

    def start_draining(self) -> None:
        self.draining = True

    def end_in_flight(self) -> None:
        """Past the drain's grace: each request still running ends at its next output, with
        an error that says why (a stream gets it as its last event), instead of a connection
        cut mid-body."""
        self.cut_off = True

    @property
    def idle(self) -> bool:
        return self.num_in_flight == 0


class Ticket:
    """One admitted request's place. `started(index)` as each of its sequences has output,
    `release()` when it is done; both are idempotent, so every exit path may call them."""

    def __init__(self, admission: Admission, num_sequences: int = 1) -> None:
        self._admission = admission
        self._waiting: set[int] | None = None  # indices not started yet (None: all of them)
        self._num_sequences = num_sequences
        self._released = False

    def started(self, index: int = 0) -> None:
        if self._waiting is None:
            self._waiting = set(range(self._num_sequences))
        if index in self._waiting:
            self._waiting.discard(index)
            self._admission.num_waiting -= 1

    def release(self) -> None:
        if self._released:
            return
        for index in range(self._num_sequences):
            self.started(index)
        self._released = True
        self._admission.num_in_flight -= 1
