"""One UCX worker (ucxx) shared by a transport's channels, and how threads wait on it.

Any thread posts sends and receives on the worker (ucxx makes it thread-safe). A thread that
must wait progresses the worker itself, so a completion wakes the thread that wants it directly;
with several waiters one drives and the rest follow:

    driver    (holds `_driving`): progress, or sleep in ucxx's epoll set until UCX's event fd or
              our own epoll set (wake-up eventfd, lifelines) fires; mark hung-up lifelines and
              wake the followers whose requests completed.
    follower: sleeps on its own Event; on leaving, a waiter wakes another so someone drives.
    background thread: drives only while requests are in flight and nobody has posted or
              waited for BACKGROUND_DELAY (a poster busy elsewhere); hands over to the next
              waiter.

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
DRIVER_SLEEP = 0.1  # the driver re-checks deadlines at least this often
FOLLOWER_SLEEP = 0.05  # a follower re-checks whether it should drive at least this often
BACKGROUND_DELAY = 0.002  # in-flight requests nobody waits for this long get background progress
IDLE_SLEEP = 0.25
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
        # Our fds live in an epoll set of their own, nested in ucxx's: they wake the driver's
        # sleep, and polling them alone costs one call.
        self._fds = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._fds.register(self._wake, select.EPOLLIN)
        with select.epoll.fromfd(os.dup(self.worker.epoll_file_descriptor)) as ucxx_set:
            ucxx_set.register(self._fds.fileno(), select.EPOLLIN)
        weakref.finalize(self, _close_fds, self._fds, self._wake).atexit = False
        self._lock = threading.Lock()  # guards the tables below
        self._driving = threading.Lock()
        self._waiting: dict[int, tuple[object, threading.Event, Watched | None]] = {}
        self._watched: dict[int, Watched] = {}  # lifeline fd -> channel
        # (request, buffer) posted and not seen complete: the buffer lives until UCX is done
        self._in_flight: list[tuple[object, object]] = []
        self._last_active = 0.0  # last post or end of a wait
        self._next_tag = 0
        self._local = threading.local()
        self._posted = threading.Event()  # wakes an idle background thread
        self._background_idle = False
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

    def track(self, request, buffer) -> None:
        """Keeps `buffer` alive while `request` is in flight, and the request progressing."""
        with self._lock:
            self._in_flight.append((request, buffer))
            self._last_active = time.monotonic()
            idle = self._background_idle
        if idle:
            self._posted.set()

    def watch(self, channel: Watched) -> None:
        with self._lock:
            self._watched[channel.lifeline_fd] = channel
        self._fds.register(channel.lifeline_fd, select.EPOLLIN | select.EPOLLRDHUP)

    def unwatch(self, channel: Watched) -> None:
        # Under the lock: the channel's close waits for it before it closes the fd. Only if
        # the fd is still this channel's: closed meanwhile, its number may be a new channel's
        # lifeline, which would lose its watch (and hang on its peer's death).
        with self._lock:
            fd = channel.lifeline_fd
            if self._watched.get(fd) is channel:
                del self._watched[fd]
                self._fds.unregister(fd)

    def close_blocking(self, endpoint) -> None:
        """ucxx's blocking close: it cancels the endpoint's posted requests and progresses
        the worker itself, so no other thread may progress it meanwhile."""
        with self._driving:
            self._in_device_context()
            endpoint.close_blocking()

    def _in_device_context(self) -> None:
        if self.device.type == "cuda" and not getattr(self._local, "in_context", False):
            # UCX's CUDA transports need the device's context current on the progressing thread.
            torch.cuda.set_device(self.device)
            torch.cuda.synchronize(self.device)
            self._local.in_context = True

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
                sleep = DRIVER_SLEEP if sleep is None else min(sleep, DRIVER_SLEEP)
                if self._driving.acquire(blocking=False):
                    try:
                        self._drive(request, sleep)
                    finally:
                        self._driving.release()
                    continue
                if not followed:  # the driver may sleep: have it progress this new request
                    os.eventfd_write(self._wake, 1)
                    followed = True
                event.wait(min(sleep, FOLLOWER_SLEEP))
                event.clear()
        finally:
            with self._lock:
                del self._waiting[id(event)]
                self._last_active = time.monotonic()
            self._hand_over()

    def _hand_over(self) -> None:
        """Wakes one waiter, which takes over driving."""
        with self._lock:
            for _, other, _ in self._waiting.values():
                other.set()
                break

    def _drive(self, request, seconds: float) -> None:
        """Progresses until `request` (if any) completes, one of our fds fires, or `seconds`
        pass. The hot loop of every transfer: keep it lean."""
        self._in_device_context()
        own_waiter = 0 if request is None else 1
        end = time.monotonic() + seconds
        while True:
            left = end - time.monotonic()
            if left <= 0 or (request is not None and request.completed):
                return
            self.worker.progress_worker_event(math.ceil(left * 1000))  # GIL released inside
            ready = self._fds.poll(0)
            if ready:
                self._service(ready)
            if len(self._waiting) > own_waiter:
                self._wake_completed()
            if ready:
                return

    def _service(self, ready: list[tuple[int, int]]) -> None:
        with self._lock:
            gone = [self._watched[fd] for fd, _ in ready if fd in self._watched]
        if any(fd == self._wake for fd, _ in ready):
            os.eventfd_read(self._wake)
        for channel in gone:
            # After the handshake a lifeline carries nothing: readable means closed or broken.
            channel.hung_up_at = time.monotonic()
            self.unwatch(channel)
            self.hang_up(channel)

    def _wake_completed(self) -> None:
        with self._lock:
            for request, event, _ in self._waiting.values():
                if request.completed:
                    event.set()

    def _background_step(self) -> None:
        with self._lock:
            self._in_flight = [(r, b) for r, b in self._in_flight if not r.completed]
            wanted = bool(self._in_flight) and not self._waiting
            idle_for = time.monotonic() - self._last_active
            self._background_idle = not wanted
        if not wanted:
            self._posted.wait(IDLE_SLEEP)
            self._posted.clear()
        elif idle_for < BACKGROUND_DELAY:
            time.sleep(BACKGROUND_DELAY - idle_for)
        elif self._driving.acquire(blocking=False):
            try:
                self._drive(None, DRIVER_SLEEP)  # a new waiter's wake-up ends it
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


def _close_fds(fds: select.epoll, wake: int) -> None:
    fds.close()
    os.close(wake)
