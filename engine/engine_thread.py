"""EngineThread: one thread that owns an engine, steps it while there is work, and runs calls
submitted from other threads between steps (the engine itself is not thread-safe)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from kernels.threads import use_threads
from protocol.stats import EngineHealth, StepTimer

log = logging.getLogger(__name__)
IDLE_WAIT_SECONDS = 0.05
EXIT_WAIT_SECONDS = 2.0
_live: weakref.WeakSet[EngineThread] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """Engine threads are daemons, so a process may exit while one steps. Past this point
    the interpreter ends any thread that asks for the GIL back, and one that does so inside
    torch's C++ code (freeing a tensor) aborts the whole process on its way out. So every
    engine thread is stopped here first, each given a step's time to finish."""
    engines = list(_live)
    for engine in engines:
        engine._stop.set()
    for engine in engines:
        with contextlib.suppress(TimeoutError):  # exiting anyway: as much time as we give
            engine.stop(EXIT_WAIT_SECONDS)


class EngineThread:
    def __init__(
        self,
        name: str,
        step: Callable[[], None],
        has_work: Callable[[], bool],
        on_crash: Callable[[BaseException], None],
        housekeeping: Callable[[], None] | None = None,
        num_threads: int | None = None,
        pace: Callable[[bool], None] | None = None,
    ) -> None:
        """`housekeeping()` runs every loop turn, at least every IDLE_WAIT_SECONDS.
        `num_threads`: the cores the engine's ops use (default: the creator's torch count).
        `pace(busy)` runs on the engine thread before each turn's step, and with False as the
        thread ends: it may change the thread's core count (kernels/core_share.py).
        Load the model on a thread kept at one torch thread, so that the engine thread's
        OpenMP team is the process's only one (kernels/threads.py)."""
        self._housekeeping = housekeeping
        self._pace = pace
        # OpenMP thread counts are per thread: carry the creator's over unless told, or a fresh
        # thread would use every core whatever the worker was given.
        self._num_threads = num_threads or torch.get_num_threads()
        self._step = step
        self._has_work = has_work
        self._on_crash = on_crash
        self._calls: queue.SimpleQueue[tuple[Future, Callable, tuple]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._last_turn = time.monotonic()  # written by the engine thread only
        self.steps = StepTimer()  # written by the engine thread only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Runs fn(*args) on the engine thread between steps; the future holds its result."""
        future: Future = Future()
        if self.error is not None:
            future.set_exception(RuntimeError(f"engine thread crashed: {self.error}"))
        elif self._stop.is_set():
            future.set_exception(RuntimeError("engine thread stopped"))
        else:
            self._calls.put((future, fn, args))
            if self._stop.is_set():  # stop() may have drained the queue just before the put
                self._fail_pending(RuntimeError("engine thread stopped"))
        return future

    def health(self) -> EngineHealth:
        """Any thread may call it: it reads two fields and never waits on the engine."""
        return EngineHealth(
            alive=self._thread.is_alive() and self.error is None,
            busy=self._has_work() or not self._calls.empty(),
            seconds_since_progress=time.monotonic() - self._last_turn,
            error=None if self.error is None else f"{type(self.error).__name__}: {self.error}",
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the loop after the current step; calls not yet run fail (nothing waits on
        them forever), and later submits fail at once. TimeoutError if the step still runs
        after `timeout`: the engine is not this thread's to give up then, and whoever goes on
        to use it (another role's thread, an abort of everything) would race a live step."""
        self._stop.set()
        self._thread.join(timeout)
        self._fail_pending(RuntimeError("engine thread stopped"))
        if self._thread.is_alive():
            raise TimeoutError(
                f"engine thread {self._thread.name} is still in a step after {timeout:g}s"
            )

    def _run(self) -> None:
        use_threads(self._num_threads)
        try:
            while not self._stop.is_set():
                self._last_turn = time.monotonic()
                self._run_calls(block=not self._has_work())
                if self._housekeeping is not None:
                    self._housekeeping()
                busy = self._has_work()
                if self._pace is not None:
                    self._pace(busy)
                if busy:
                    started = time.perf_counter()
                    self._step()
                    self.steps.seconds.observe(time.perf_counter() - started)
        except BaseException as err:  # every caller must learn about it; nothing hangs
            log.exception("engine thread crashed")
            self.error = err
            self._on_crash(err)
            self._fail_pending(err)
        finally:
            if self._pace is not None:
                self._pace(False)

    def _run_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=IDLE_WAIT_SECONDS) if block else self._calls.get_nowait()
            while True:
                future, fn, args = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except Exception as err:  # the caller's error, not the engine's
                        future.set_exception(err)
                item = self._calls.get_nowait()
        except queue.Empty:
            return

    def _fail_pending(self, err: BaseException) -> None:
        while True:
            try:
                future, _, _ = self._calls.get_nowait()
            except queue.Empty:
                return
            future.set_exception(RuntimeError(f"engine thread crashed: {err}"))
