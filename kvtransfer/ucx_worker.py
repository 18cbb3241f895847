"""One UCX worker (ucxx) shared by a transport's channels, and how threads wait on it.

Any thread posts sends and receives on the worker (ucxx makes it thread-safe). A thread that
must wait progresses the worker itself, so a completion wakes the thread that wants it directly;
with several waiters one drives and the rest follow:

    driver    (holds `_driving`): progress, or sleep in the worker's epoll set until UCX's event
              fd, the wake-up eventfd or a lifeline fires; then mark hung-up lifelines and wake
              the followers whose requests completed.
    follower: sleeps on its own Event; on leaving, a waiter wakes another so someone drives.
    background thread: drives only while requests are in flight and nobody has waited for
              BACKGROUND_DELAY (a poster busy elsewhere), and hands over to the next waiter.

A wait ends when its request completes (its error raised as TransferError), its deadline passes,
or its channel failed: closed, or hung up for GRACE seconds (what arrived first still lands).
"""

from __future__ import annotations

import atexit
import math
import os
import select
import threading
import time
import weakref
from typing import Protocol

import torch

from kvtransfer.transport import TransferError

# ucxx sets UCX_MEMTYPE_CACHE, which UCX >= 1.19 no longer knows: without this UCX warns about it
# in every process. Read once, when ucxx is first imported.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

GRACE = 0.5  # seconds a hung-up channel keeps delivering what had already arrived
DRIVER_SLEEP = 0.1  # the driver re-checks deadlines and hang-ups at least this often
FOLLOWER_SLEEP = 0.05  # a follower re-checks whether it should drive at least this often
BACKGROUND_DELAY = 0.002  # in-flight requests nobody waits for this long get background progress
IDLE_SLEEP = 1.0
_WORKERS: weakref.WeakSet[UcxWorker] = weakref.WeakSet()


class Watched(Protocol):
    """What the worker needs from a channel: its lifeline, and where to record a hang-up."""

    lifeline_fd: int
    hung_up_at: float | None

    def failure(self, now: float) -> str | None: ...


def import_ucxx():
    try:
        import ucxx._lib.libucxx as ucx
        from ucxx._lib.arr import Array
    except ImportError as err:
        raise ValueError(
            "the ucx transport needs ucxx: pip install 'tandem[ucx]' (Python >= 3.11, Linux)"
        ) from err
    return ucx, Array


class UcxWorker:
    def __init__(self, device: torch.device, options: dict[str, str]) -> None:
        self.ucx, self.Array = import_ucxx()
        self.device = device
        flags = (self.ucx.Feature.TAG, self.ucx.Feature.WAKEUP)
        self.context = self.ucx.UCXContext(config_dict=options, feature_flags=flags)
        self.worker = self.ucx.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self.address = self.worker.address.tobytes()
        # A second handle on ucxx's epoll instance, so our fds wake the same sleep.
        self._epoll = select.epoll.fromfd(os.dup(self.worker.epoll_file_descriptor))
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake, select.EPOLLIN)
        weakref.finalize(self, _close_fds, self._epoll, self._wake).atexit = False
        self._lock = threading.Lock()  # guards the tables below
        self._driving = threading.Lock()
        self._waiting: dict[int, tuple[object, threading.Event, Watched | None]] = {}
        self._watched: dict[int, Watched] = {}  # lifeline fd -> channel
        # (request, buffer) posted and not seen complete: the buffer lives until UCX is done
        self._in_flight: list[tuple[object, object]] = []
        self._posted = threading.Event()
        self._last_waited = 0.0
        self._next_tag = 0
        self._local = threading.local()
        self._stopping = False
        self._background = threading.Thread(
            target=_background, args=(weakref.ref(self),), name="tandem-ucx", daemon=True
        )
        self._background.start()
        _WORKERS.add(self)

    def close(self) -> None:
        self._stopping = True
        self._posted.set()
        os.eventfd_write(self._wake, 1)
        self._background.join(timeout=2)

    def track(self, request, buffer) -> None:
        """Keeps `buffer` alive while `request` is in flight, and the request progressing."""
        with self._lock:
            self._in_flight.append((request, buffer))
        self._posted.set()

    def new_tag(self) -> int:
        """A channel tag unique on this worker (receives match tags worker-wide)."""
        with self._lock:
            self._next_tag += 1
            return self._next_tag

    def endpoint(self, address: bytes, peer_error_handling: bool):
        try:
            remote = self.ucx.UCXAddress.create_from_buffer(address)
            return self.ucx.UCXEndpoint.create_from_worker_address(
                self.worker, remote, peer_error_handling
            )
        except self.ucx.UCXError as err:
            raise TransferError(f"UCX cannot reach the peer: {err}") from err

    def watch(self, channel: Watched) -> None:
        with self._lock:
            self._watched[channel.lifeline_fd] = channel
        self._epoll.register(channel.lifeline_fd, select.EPOLLIN | select.EPOLLRDHUP)

    def unwatch(self, channel: Watched) -> None:
        with self._lock:
            if self._watched.pop(channel.lifeline_fd, None) is None:
                return
        self._epoll.unregister(channel.lifeline_fd)

    def hang_up(self, channel: Watched) -> None:
        """Wakes every thread waiting on `channel`, which then sees its failure."""
        with self._lock:
            for _, event, watched in self._waiting.values():
                if watched is channel:
                    event.set()
        os.eventfd_write(self._wake, 1)  # and the driver, in case it waits on the channel

    def wait(self, request, buffer, timeout: float | None, channel: Watched | None) -> None:
        """Blocks until `request` completes; TransferError on its error, on timeout, or once
        `channel` (if any) has failed. `buffer` stays referenced while UCX may still use it."""
        if not request.completed:
            self._block(request, buffer, timeout, channel)
        try:
            request.check_error()
        except self.ucx.UCXError as err:
            raise TransferError(f"UCX: {err}") from err

    def _block(self, request, buffer, timeout: float | None, channel: Watched | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        event = threading.Event()
        with self._lock:
            self._waiting[id(event)] = (request, event, channel)
        followed = False
        try:
            while not request.completed:
                now = time.monotonic()
                reason = channel.failure(now) if channel is not None else None
                if reason is None and deadline is not None and now >= deadline:
                    reason = f"timed out after {timeout:.3g}s"
                if reason is not None:
                    self.track(request, buffer)  # UCX may still write into it
                    raise TransferError(reason)
                sleep = _sleep_for(now, deadline, channel)
                if self._driving.acquire(blocking=False):
                    try:
                        self._drive(DRIVER_SLEEP if sleep is None else min(sleep, DRIVER_SLEEP))
                    finally:
                        self._driving.release()
                    continue
                if not followed:  # the driver may sleep: have it progress this new request
                    os.eventfd_write(self._wake, 1)
                    followed = True
                event.wait(FOLLOWER_SLEEP if sleep is None else min(sleep, FOLLOWER_SLEEP))
                event.clear()
        finally:
            with self._lock:
                del self._waiting[id(event)]
                self._last_waited = time.monotonic()
            self._hand_over()

    def _hand_over(self) -> None:
        """Wakes one waiter, which takes over driving."""
        with self._lock:
            for _, other, _ in self._waiting.values():
                other.set()
                break

    def _drive(self, seconds: float) -> None:
        if self.device.type == "cuda" and not getattr(self._local, "in_context", False):
            # UCX's CUDA transports need the device's context current on the progressing thread.
            torch.cuda.set_device(self.device)
            torch.cuda.synchronize(self.device)
            self._local.in_context = True
        self.worker.progress_worker_event(math.ceil(seconds * 1000))  # GIL released inside
        ready = {fd for fd, _ in self._epoll.poll(0)}
        if self._wake in ready:
            os.eventfd_read(self._wake)
        with self._lock:
            gone = [self._watched[fd] for fd in ready if fd in self._watched]
        for channel in gone:
            # After the handshake a lifeline carries nothing: readable means closed or broken.
            channel.hung_up_at = time.monotonic()
            self.unwatch(channel)
            self.hang_up(channel)
        with self._lock:
            for request, event, _ in self._waiting.values():
                if request.completed:
                    event.set()
            self._in_flight = [(r, b) for r, b in self._in_flight if not r.completed]

    def _background_step(self) -> None:
        with self._lock:
            idle_for = time.monotonic() - self._last_waited
            self._in_flight = [(r, b) for r, b in self._in_flight if not r.completed]
            wanted = bool(self._in_flight) and not self._waiting
        if not wanted:
            self._posted.wait(IDLE_SLEEP)
            self._posted.clear()
        elif idle_for < BACKGROUND_DELAY:
            time.sleep(BACKGROUND_DELAY - idle_for)
        elif self._driving.acquire(blocking=False):
            try:
                self._drive(DRIVER_SLEEP)  # a new waiter's wake-up ends the sleep
            finally:
                self._driving.release()
            self._hand_over()
        else:
            time.sleep(BACKGROUND_DELAY)


def _sleep_for(now: float, deadline: float | None, channel: Watched | None) -> float | None:
    waits = [] if deadline is None else [deadline - now]
    if channel is not None and channel.hung_up_at is not None:
        waits.append(channel.hung_up_at + GRACE - now)
    return max(min(waits), 0.0) if waits else None


def _background(worker_ref: weakref.ref[UcxWorker]) -> None:
    while (worker := worker_ref()) is not None and not worker._stopping:
        worker._background_step()
        del worker


@atexit.register
def _stop_background_threads() -> None:
    """Before the interpreter tears UCX down under them."""
    for worker in list(_WORKERS):
        worker.close()


def _close_fds(epoll: select.epoll, wake: int) -> None:
    epoll.close()
    os.close(wake)
