"""Supervisor: keeps each pool at its target size with workers that answer and step.

    every probe_interval: health() of every worker, each under its own deadline
        no answer, a crash, or an engine with work that stopped stepping -> a failure
        max_probe_failures in a row, or a dead actor -> retire: out of routing, actor killed
    below target -> spawn a replacement (exponential backoff, a cap per minute); it joins
        routing once it has loaded its model
    drain(worker) -> no new requests; it leaves when its requests are done (or moved)

The Coordinator owns requests and routing; it learns of joins and leaves through the two
callbacks and tells the supervisor of failures it sees itself (`report_dead`). Runs on the event
loop; no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from protocol.stats import EngineHealth, PoolWorker

log = logging.getLogger(__name__)

Spawn = Callable[[str], tuple[str, Any]]  # pool -> (worker id, actor handle)


class WorkerState(str, enum.Enum):
    STARTING = "starting"  # loading its model; not routed to yet
    SERVING = "serving"
    DRAINING = "draining"  # no new requests; leaves once idle
    DEAD = "dead"


@dataclass(frozen=True)
class SupervisorConfig:
    probe_interval: float = 0.25
    probe_timeout: float = 0.75  # one health() call (the actor answers from its own loop)
    max_probe_failures: int = 2  # in a row: a hung worker is out within 2 x (interval+timeout)
    stuck_after: float = 30.0  # seconds an engine with work may go without a loop turn
    start_timeout: float = 600.0  # model loading on a cold node
    restart_backoff: float = 1.0  # first delay before a replacement; doubles per failure
    max_backoff: float = 30.0
    max_restarts_per_minute: int = 6  # per pool


@dataclass
class WorkerEntry:
    worker_id: str
    pool: str  # "prefill" | "decode" | "colocated"
    handle: Any
    state: WorkerState = WorkerState.SERVING
    probe_failures: int = 0
    last_problem: str | None = None


@dataclass
class _PoolRecord:
    target: int
    restarts: int = 0  # replacements started for retired workers
    recent: deque[float] = field(default_factory=deque)  # monotonic times of restarts
    failed_starts: int = 0  # in a row; sets the backoff
    starting: int = 0  # start tasks: waiting to spawn, or waiting for their worker to load
    queued: int = 0  # of those, the ones not spawned yet (a spawned one is a STARTING worker)


class Supervisor:
    def __init__(
        self,
        spawn: Spawn | None,
        config: SupervisorConfig,
        on_join: Callable[[WorkerEntry, int], None],
        on_leave: Callable[[WorkerEntry, str], None],
        in_use: Callable[[str], int],
        release: Callable[[str], None] | None = None,
    ) -> None:
        """`on_join(entry, max_model_len)` once a worker may be routed to; `on_leave(entry,
        reason)` once it may not; `in_use(worker_id)` counts requests still relying on it;
        `release(worker_id)` frees what its spawn reserved, once its process is killed."""
        self.spawn = spawn
        self.config = config
        self.on_join = on_join
        self.on_leave = on_leave
        self.in_use = in_use
        self.release = release
        self.workers: dict[str, WorkerEntry] = {}
        self.pools: dict[str, _PoolRecord] = {}
        self._switching: set[str] = set()  # workers between begin_switch and end_switch
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.last_start_s: float | None = None  # spawn -> answering, of the newest worker

    # -- membership ------------------------------------------------------------------------

    def add(self, pool: str, worker_id: str, handle: Any) -> WorkerEntry:
        """A worker placed at launch (serving once the coordinator's ready() has pinged it)."""
        self.pools.setdefault(pool, _PoolRecord(target=0)).target += 1
        entry = WorkerEntry(worker_id, pool, handle)
        self.workers[worker_id] = entry
        return entry

    def serving(self, pool: str) -> list[WorkerEntry]:
        return [
            w for w in self.workers.values() if w.pool == pool and w.state is WorkerState.SERVING
        ]

    def describe(self) -> list[PoolWorker]:
        return [
            PoolWorker(w.worker_id, w.pool, w.state.value, self.pools[w.pool].restarts)
            for w in self.workers.values()
        ]

    def restarts(self) -> dict[str, int]:
        return {pool: record.restarts for pool, record in self.pools.items()}

    def problem(self) -> str | None:
        """Why the pools cannot serve (a pool with a target but no serving worker), or None."""
        for pool, record in self.pools.items():
            if record.target > 0 and not self.serving(pool):
                return f"no {pool} worker is serving"
        return None

    # -- loops -----------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn_task(self._probe_loop())

    async def stop(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for entry in self.workers.values():
            self._kill(entry.worker_id, entry.handle)

    def _spawn_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe_loop(self) -> None:
        while not self._closed:
            try:
                await self._probe_all()
            except Exception:  # the loop that heals the pools never ends on one bad round
                log.exception("probing the workers failed; probing again")
            await asyncio.sleep(self.config.probe_interval)

    async def _probe_all(self) -> None:
        watched = [
            w
            for w in self.workers.values()
            if w.state in (WorkerState.SERVING, WorkerState.DRAINING)
        ]
        await asyncio.gather(*(self._probe(w) for w in watched))
        for entry in watched:
            if entry.state is WorkerState.DRAINING and self.in_use(entry.worker_id) == 0:
                self.retire(entry.worker_id, "drained", replace=False)

    async def _probe(self, entry: WorkerEntry) -> None:
        try:
            health: EngineHealth = await asyncio.wait_for(
                entry.handle.health.remote(), self.config.probe_timeout
            )
            problem = health.problem(self.config.stuck_after)
        except RayActorError:
            self.report_dead(entry.worker_id, "its process died")
            return
        except (TimeoutError, asyncio.TimeoutError):
            problem = f"no health answer within {self.config.probe_timeout:g}s"
        except Exception as err:  # an answer we cannot read is as bad as none
            problem = f"health check failed: {type(err).__name__}"
        if entry.state not in (WorkerState.SERVING, WorkerState.DRAINING):
            return  # it began a role switch (or left) while the probe was out: not its verdict
        if problem is None:
            entry.probe_failures, entry.last_problem = 0, None
            return
        entry.probe_failures += 1
        entry.last_problem = problem
        if entry.probe_failures >= self.config.max_probe_failures:
            self.retire(entry.worker_id, problem)

    # -- changes ---------------------------------------------------------------------------

    def report_dead(self, worker_id: str, reason: str) -> None:
        """A failure seen elsewhere (a dead actor on a call): the worker leaves at once."""
        self.retire(worker_id, reason)

    def retire(self, worker_id: str, reason: str, replace: bool = True) -> None:
        """Takes a worker out of routing for good and kills its process; a replacement is
        started if the pool is below its target."""
        entry = self.workers.get(worker_id)
        if entry is None or entry.state is WorkerState.DEAD:
            return
        self._switching.discard(worker_id)
        was_serving = entry.state in (WorkerState.SERVING, WorkerState.DRAINING)
        entry.state = WorkerState.DEAD
        if replace:
            log.error("worker %s is out of service: %s", worker_id, reason)
        else:
            log.info("worker %s left its pool: %s", worker_id, reason)
        if was_serving:
            self.on_leave(entry, reason)
        self._kill(worker_id, entry.handle)
        del self.workers[worker_id]
        # A drained worker's pool was made smaller when it began draining: nothing to refill.
        self._fill(entry.pool, replacing=replace)

    def begin_switch(self, worker_id: str, role: str) -> None:
        """The worker changes roles: out of probes and routing until end_switch, and counted in
        its new pool (its target included) from now on, so a pool resized meanwhile is sized
        with it where it will be. (Moved at the end instead, a decode pool scaled to 1 while
        its second worker switched away ended with a target of 0 and one worker, never
        replaced when that one died.)"""
        entry = self.workers[worker_id]
        self.pools[entry.pool].target -= 1
        self.pools.setdefault(role, _PoolRecord(target=0)).target += 1
        entry.pool, entry.state = role, WorkerState.STARTING
        self._switching.add(worker_id)

    def end_switch(self, worker_id: str) -> None:
        self._switching.discard(worker_id)
        entry = self.workers.get(worker_id)
        if entry is not None:  # (not retired meanwhile)
            entry.state, entry.probe_failures = WorkerState.SERVING, 0

    def switching(self, pool: str) -> int:
        """Workers on their way into `pool` by a role switch."""
        return sum(1 for w in self._switching if self.workers[w].pool == pool)

    def drain(self, worker_id: str) -> WorkerEntry:
        """Stops routing new requests to the worker; it leaves once nothing relies on it, and
        the pool shrinks by one (KeyError for an unknown worker)."""
        entry = self.workers[worker_id]
        if entry.state is WorkerState.SERVING:
            self.pools[entry.pool].target -= 1
            self._drain(entry)
        return entry

    def _drain(self, entry: WorkerEntry) -> None:
        entry.state = WorkerState.DRAINING
        self.on_leave(entry, "draining")

    def scale(self, pool: str, size: int) -> None:
        """Sets a pool's target size: starts workers, or drains the newest extra ones."""
        record = self.pools.setdefault(pool, _PoolRecord(target=0))
        record.target = size
        live = [
            w
            for w in self.workers.values()
            if w.pool == pool and w.state in (WorkerState.SERVING, WorkerState.STARTING)
        ]
        for entry in reversed(live[size:]):
            if entry.state is WorkerState.SERVING:
                self._drain(entry)  # the target is `size` already
        self._fill(pool, replacing=False)

    def _live(self, pool: str) -> int:
        """The pool's workers serving or on their way to it (loading, or switching roles)."""
        return sum(
            1
            for w in self.workers.values()
            if w.pool == pool and w.state in (WorkerState.SERVING, WorkerState.STARTING)
        )

    def _fill(self, pool: str, replacing: bool) -> None:
        record = self.pools[pool]
        if self.spawn is None or self._closed:
            return
        for _ in range(record.target - self._live(pool) - record.queued):
            record.starting += 1
            record.queued += 1
            self._spawn_task(self._start_one(pool, record, replacing))

    async def _start_one(self, pool: str, record: _PoolRecord, replacing: bool) -> None:
        queued = True
        try:
            while not self._closed:
                await asyncio.sleep(self._delay(record))
                if self._live(pool) + record.queued - 1 >= record.target:
                    return  # the pool shrank while this start waited: it is not needed
                if self._start_allowed(record):
                    record.queued, queued = record.queued - 1, False
                    if await self._try_start(pool, record, replacing):
                        return
                    record.failed_starts += 1
                    record.queued, queued = record.queued + 1, True
        finally:
            record.starting -= 1
            record.queued -= queued

    def _delay(self, record: _PoolRecord) -> float:
        if record.failed_starts == 0 and not record.recent:
            return 0.0
        scale = 2.0 ** min(record.failed_starts, 16)
        return min(self.config.max_backoff, self.config.restart_backoff * scale)

    def _start_allowed(self, record: _PoolRecord) -> bool:
        now = time.monotonic()
        while record.recent and now - record.recent[0] > 60.0:
            record.recent.popleft()
        return len(record.recent) < self.config.max_restarts_per_minute

    async def _try_start(self, pool: str, record: _PoolRecord, replacing: bool) -> bool:
        began = time.monotonic()
        record.recent.append(began)
        try:
            worker_id, handle = self.spawn(pool)
        except Exception as err:  # Ray's control plane refused: a failed start, retried
            log.error("a new %s worker could not be placed: %s", pool, err)
            return False
        entry = WorkerEntry(worker_id, pool, handle, WorkerState.STARTING)
        self.workers[worker_id] = entry
        try:
            max_model_len = await asyncio.wait_for(handle.ping.remote(), self.config.start_timeout)
        except Exception as err:
            log.error("new %s worker %s did not start: %s", pool, worker_id, err)
            del self.workers[worker_id]
            self._kill(worker_id, handle)
            return False
        if self._closed or record.target <= len(self.serving(pool)):
            del self.workers[worker_id]  # the pool shrank meanwhile
            self._kill(worker_id, handle)
            return True
        entry.state = WorkerState.SERVING
        self.last_start_s = time.monotonic() - began
        record.restarts += replacing
        record.failed_starts = 0
        log.info("worker %s joined the %s pool", worker_id, pool)
        self.on_join(entry, max_model_len)
        return True

    def _kill(self, worker_id: str, handle: Any) -> None:
        _kill(handle)
        if self.release is not None:
            try:
                self.release(worker_id)
            except Exception as err:  # the worker is out either way; its loop goes on
                log.error("could not free what worker %s reserved: %s", worker_id, err)


def _kill(handle: Any) -> None:
    with contextlib.suppress(Exception):
        ray.kill(handle)
