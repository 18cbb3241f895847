"""Coordinator: the disaggregated backend behind the HTTP app (an EngineClient).

For each request:
    route -> decode worker D (+ prefill worker P, unless D prefills it locally); the route
        counts against both workers' loads at once, so a burst spreads over the pools
    D.reserve(request, P) -> ticket;  P.prefill(request, ticket) -> first token (streamed at once)
        from then on the request depends on D alone
    D pushes its token batches, one frame per engine step for all its requests, over its own
        connection to the coordinator (coordinator/update_server.py); no per-token Ray call
Failures: a dead or hung P, a failed or expired transfer, or a dead or hung D end the attempt;
KV that fails its checksum is retried once as usual, then recomputed on the decode worker;
the request is placed again, on other workers when there are any, with the tokens generated so
far (a decode worker resumes it as if preempted), up to MAX_ATTEMPTS. Every remote call has a
deadline. Pool membership (health probes, replacements, drains, sizes) is the Supervisor's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from ray.exceptions import RayActorError

from coordinator.planner_loop import LoopSettings, PlannerLoop, PlannerSetup
from coordinator.request_state import TrackedRequest
from coordinator.room import RoomQueue
from coordinator.router import (
    NoWorkerError,
    Route,
    RouteCosts,
    Router,
    prefix_hashes,
    queued_tokens,
)
from coordinator.supervisor import Spawn, Supervisor, SupervisorConfig, WorkerEntry, WorkerState
from coordinator.telemetry import TelemetryStore
from coordinator.update_server import UpdateServer
from engine.outputs import RequestOutput, read_stream
from engine.tokenizer import Tokenizer
from planning.window import LoadWindow
from protocol.errors import (
    EngineDeadError,
    InvalidOutputError,
    PoolError,
    RequestFailedError,
    RoleSwitchError,
    TransferError,
)
from protocol.limits import ModelLimits
from protocol.messages import PrefillResult, RequestFailed, WorkerUpdate, WorkRequest
from protocol.sampling import SamplingParams
from protocol.stats import HANDOVER_BUCKETS, Histogram, PoolWorker, WorkerStats
from protocol.telemetry import StepRecord, Telemetry

log = logging.getLogger(__name__)

# A lost attempt waits this long for its prefill call's own verdict (coordinator._unless_lost).
PREFILL_VERDICT_S = 0.5
MAX_ATTEMPTS = 4
MAX_CORRUPT_TRANSFERS = 2  # KV checksum failures before a request is prefilled on its decoder
STATS_SECONDS = 1.0
STATS_TIMEOUT = 1.0  # per worker: a slow one keeps its last report (marked stale)
START_TIMEOUT = 600.0  # model loading on a cold node


@dataclass(frozen=True)
class CoordinatorConfig:
    block_size: int
    local_prefill_threshold: int = 0  # tokens; 0 = always prefill remotely ("load" routing)
    routing: str = "load"  # coordinator/router.py: "cost" | "load" | "round-robin"
    route_costs: RouteCosts = RouteCosts()
    call_timeout: float = 30.0  # any control call (reserve, abort, stats), on top of a poll
    prefill_base_timeout: float = 30.0  # queueing + prefill + transfer of one request ...
    prefill_seconds_per_token: float = 0.02  # ... plus this per prompt token
    capacity_wait: float = 60.0  # how long a request may wait for decode KV blocks
    # Waiting for decode room longer than this, a request is late (the TTFT objective, if any):
    # while the oldest waiter is, the newest is served first (coordinator/room.py).
    late_after_s: float | None = None
    placement_timeout: float = 30.0  # Ray must have placed every first worker by then
    update_host: str = "127.0.0.1"  # where decode workers reach this process (update streams)
    stream_interval: int = 1  # tokens per streamed output (the first and the last go at once)
    supervision: SupervisorConfig = SupervisorConfig()

    def prefill_timeout(self, num_tokens: int) -> float:
        return self.prefill_base_timeout + self.prefill_seconds_per_token * num_tokens


class Coordinator:
    def __init__(
        self,
        model_name: str,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        eos_ids: frozenset[int],
        prefill: dict[str, Any],  # worker id -> WorkerActor handle (prefill role)
        decode: dict[str, Any],  # worker id -> WorkerActor handle (decode role)
        config: CoordinatorConfig,
        spawn: Spawn | None = None,  # starts a worker of a pool: replacements, growth
        unplaced: Callable[[dict[str, Any]], str | None] | None = None,  # see _start
        decode_pool: str = "decode",  # "colocated" when the decode workers prefill everything
        release: Callable[[str], None] | None = None,  # frees a killed worker's reservations
        ranks: Callable[[str], int] | None = None,  # a worker's tensor-parallel ranks (1)
        planner: PlannerSetup | None = None,  # the SLO planner's loop (coordinator/planner_loop)
        request_capacity: Callable[[int], None] | None = None,  # asks an autoscaler for room
        room_for: Callable[[dict[str, int]], str | None] | None = None,  # see scale
    ) -> None:
        self.model_name = model_name
        self.ranks = ranks or (lambda worker_id: 1)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.limits = ModelLimits(max_model_len, vocab_size)
        self.eos_ids = eos_ids
        self.prefill = dict(prefill)
        self.decode = dict(decode)
        self.config = config
        self.router = Router(
            list(prefill),
            list(decode),
            config.block_size,
            config.local_prefill_threshold,
            config.routing,
            config.route_costs,
        )
        # requests waiting for a decode worker with room (newest first while the oldest is late)
        self.room = RoomQueue(time.monotonic, config.late_after_s)
        self.supervisor = Supervisor(
            spawn,
            config.supervision,
            self._worker_joined,
            self._worker_left,
            self._in_use,
            release,
        )
        for worker_id, handle in prefill.items():
            self.supervisor.add("prefill", worker_id, handle)
        for worker_id, handle in decode.items():
            self.supervisor.add(decode_pool, worker_id, handle)
        self._requests: dict[str, TrackedRequest] = {}  # by worker request id
        self._stats: dict[str, WorkerStats] = {}
        self.telemetry = TelemetryStore()
        self.handover = Histogram(HANDOVER_BUCKETS)  # seconds: see _attempt
        self._tasks: set[asyncio.Task] = set()
        self.updates = UpdateServer(config.update_host)
        self._followers: dict[str, asyncio.Task] = {}  # decode worker id -> its update reader
        self._ids = itertools.count()
        self._started: asyncio.Future | None = None
        self._unplaced = unplaced
        self._room_for = room_for  # why this many more workers per pool cannot start, or None
        self._closing = False
        seen = LoopSettings() if planner is None else planner.settings
        # the traffic the planner sees (on time.monotonic, as TrackedRequest.arrived_at)
        self.window = LoadWindow(seen.window_s, seen.percentile, opened_at=time.monotonic())
        self._request_capacity = request_capacity
        self.planner = None if planner is None else PlannerLoop(self, self.window, planner)

    # -- EngineClient ----------------------------------------------------------------------

    async def ready(self) -> None:
        """Waits for every worker's model, then starts the background loops, once: later calls
        only wait for that."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        workers = {**self.prefill, **self.decode}
        pings = asyncio.ensure_future(
            asyncio.gather(*(self._call(w.ping, timeout=START_TIMEOUT) for w in workers.values()))
        )
        await asyncio.wait({pings}, timeout=self.config.placement_timeout)
        # Loading a model may take minutes, but a worker Ray has not even placed by now never
        # starts on its own: say what it asked for instead of waiting.
        problem = None if pings.done() or self._unplaced is None else self._unplaced(workers)
        if problem is not None:
            pings.cancel()
            raise EngineDeadError(problem)
        limits = await pings
        self.max_model_len = min([self.max_model_len, *limits])
        self.limits = ModelLimits(self.max_model_len, self.vocab_size)
        await self.updates.start()
        for decode_id in self.decode:
            self._follow(decode_id)
        self._background(self._refresh_stats())
        self.supervisor.start()
        await self._refresh_once()
        if self.planner is not None:
            self.planner.start()

    def readiness(self) -> str | None:
        if self._started is None or not self._started.done():
            return "the workers are still starting"
        if self._closing:
            return "the server is shutting down"
        return self.supervisor.problem()

    async def shutdown(self) -> None:
        """Fails what is still in flight (no retries) and stops every worker actor."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        if self.planner is not None:
            await self.planner.stop()
        for request in list(self._requests.values()):
            request.fail(EngineDeadError("the server is shutting down"))
        await self.supervisor.stop()
        await self.updates.close()

    def check_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        self.limits.check_prompt(prompt_ids)
        if params is not None:
            self.limits.check_params(params)
            self.limits.check_scores(prompt_ids, params)

    def stats(self) -> list[WorkerStats]:
        return list(self._stats.values())

    def recent_steps(self, worker_id: str | None = None, limit: int | None = None) -> dict:
        return self.telemetry.recent(worker_id, limit)

    # -- pools (the admin API) -------------------------------------------------------------

    def pools(self) -> list[PoolWorker]:
        return self.supervisor.describe()

    def scale(self, sizes: dict[str, int]) -> None:
        """Sets pool sizes ({"prefill": N, "decode": M}); PoolError for a change it cannot make."""
        known = set(self.supervisor.pools)
        for pool, size in sizes.items():
            if pool not in known:
                raise PoolError(f"no pool {pool!r}; this server has {', '.join(sorted(known))}")
            if size < (0 if pool == "prefill" else 1):
                raise PoolError(f"the {pool} pool needs at least {int(pool != 'prefill')} worker")
        more = {p: n - self.supervisor.pools[p].target for p, n in sizes.items()}
        more = {p: n for p, n in more.items() if n > 0}
        if more and self.supervisor.spawn is None:
            raise PoolError("this server cannot start workers (no spawner)")
        problem = self._room_for(more) if more and self._room_for is not None else None
        if problem is not None:
            raise PoolError(problem)
        for pool, size in sizes.items():
            self.supervisor.scale(pool, size)

    def drain(self, worker_id: str) -> None:
        """KeyError for an unknown worker; PoolError for the last serving worker of a pool
        that needs one (decode, colocated)."""
        entry = self.supervisor.workers[worker_id]
        if entry.state is WorkerState.STARTING:  # loading, or switching roles: nothing to drain
            raise PoolError(f"worker {worker_id} is {entry.state.value}, not serving")
        if entry.pool != "prefill" and len(self.supervisor.serving(entry.pool)) < 2:
            raise PoolError(f"the {entry.pool} pool would have no worker left")
        self.supervisor.drain(worker_id)

    async def switch_role(self, worker_id: str, role: str) -> float:
        """Moves a worker to the other pool without reloading its model: it stops taking
        requests, the requests it holds are placed again elsewhere (decodes resume from the
        tokens already streamed), and it rejoins in its new role. Returns the seconds until it
        was routable again. KeyError for an unknown worker, PoolError for a switch that would
        empty a pool or where roles are fixed."""
        entry = self.supervisor.workers[worker_id]
        if entry.pool == role:
            return 0.0
        if entry.state is not WorkerState.SERVING:  # a drain or a switch is under way
            raise PoolError(f"worker {worker_id} is {entry.state.value}, not serving")
        if {entry.pool, role} != {"prefill", "decode"}:
            raise PoolError(f"a {entry.pool} worker cannot become a {role} worker")
        if entry.pool == "decode" and len(self.supervisor.serving("decode")) < 2:
            raise PoolError("the decode pool would be empty")
        started = time.monotonic()
        old_pool = entry.pool
        self._worker_left(entry, "switching role")  # (reads its old pool)
        self.supervisor.begin_switch(worker_id, role)
        self._unfollow(worker_id)
        # Begun, the switch ends one way or the other even if its caller is cancelled (the
        # planner's tick, when its mode changes): stopped half-way, the worker would sit out of
        # routing and probes, counted live, and its pool would stay one short for good.
        await asyncio.shield(self._background(self._finish_switch(entry, role, old_pool)))
        return time.monotonic() - started

    async def _finish_switch(self, entry: WorkerEntry, role: str, old_pool: str) -> None:
        try:
            await self._call(entry.handle.set_role, role)
        except Exception as err:
            self.supervisor.report_dead(entry.worker_id, f"role switch failed: {_brief(err)}")
            raise RoleSwitchError(f"worker {entry.worker_id}: {_brief(err)}") from err
        finally:  # its old role's handle (`_worker_left` kept it while the switch ran) goes,
            # whether the switch failed (the worker, retired, was not serving: nothing else
            # drops it) or not
            (self.prefill if old_pool == "prefill" else self.decode).pop(entry.worker_id, None)
        self.router.remove(entry.worker_id)
        if self.supervisor.workers.get(entry.worker_id) is not entry:
            return  # retired meanwhile (its process died): a replacement is on its way
        self.supervisor.end_switch(entry.worker_id)
        self._worker_joined(entry, self.max_model_len)

    # -- what the planner sees and does (coordinator/planner_loop.PoolControl) ---------------

    def layout(self) -> dict[str, tuple[int, int]]:
        """Per pool: (serving, on the way: starting or switching into it)."""
        sup = self.supervisor
        return {
            pool: (len(sup.serving(pool)), record.starting + sup.switching(pool))
            for pool, record in sup.pools.items()
        }

    def queued_prefill_tokens(self) -> int:
        return sum(s.queued_prefill_tokens for w, s in self._stats.items() if w in self.prefill)

    def decode_kv_tokens(self) -> int:
        sizes = [s.num_total_blocks for w, s in self._stats.items() if w in self.decode]
        return min((n for n in sizes if n), default=0) * self.router.block_size

    def waiting_for_room(self) -> int:
        return len(self.room)

    def worker_start_s(self) -> float | None:
        return self.supervisor.last_start_s

    def take_steps(self) -> list[StepRecord]:
        return self.telemetry.take_steps()

    def least_busy(self, pool: str) -> str:
        serving = self.supervisor.serving(pool)
        if not serving:
            raise PoolError(f"no {pool} worker is serving")
        return min(serving, key=lambda w: self._in_use(w.worker_id)).worker_id

    def request_capacity(self, workers: int) -> None:
        if self._request_capacity is not None:
            self._request_capacity(workers)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        self.check_request(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        request = TrackedRequest(
            request_id, list(prompt_ids), params, self.tokenizer, self.config.stream_interval
        )
        arrived, first = request.arrived_at, None
        self.window.arrived(arrived, len(prompt_ids))
        driver = asyncio.create_task(self._drive(request))
        try:
            async for output in read_stream(request.stream):
                now = time.monotonic()
                if first is None and output.token_ids:
                    first = now
                if output.finished and first is not None:
                    gaps = len(output.token_ids) - 1
                    itl = (now - first) / gaps if gaps > 0 else None
                    self.window.finished(now, len(output.token_ids), first - arrived, itl)
                yield output
        finally:
            if not driver.done():
                driver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await driver

    # -- one request -----------------------------------------------------------------------

    async def _drive(self, request: TrackedRequest) -> None:
        try:
            for _ in range(MAX_ATTEMPTS):
                work = request.next_attempt()
                request.route = None
                self._requests[work.request_id] = request
                try:
                    await self._attempt(request, work)
                finally:
                    self._end_attempt(request, work)
                if request.finished or request.failed:
                    return
                if self._closing:  # between attempts, shutdown's round of failures missed it
                    request.fail(EngineDeadError("the server is shutting down"))
                    return
                if request.finish_at_length(self.max_model_len):
                    return  # its last token came before the attempt was lost
                log.warning("request %s lost (%s); retrying", work.request_id, request.lost_reason)
            request.fail(
                EngineDeadError(f"request failed {MAX_ATTEMPTS} times: {request.lost_reason}")
            )
        except (NoWorkerError, EngineDeadError) as err:
            request.fail(EngineDeadError(str(err)))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # anything unexpected reaches the client as an error
            log.exception("request %s failed", request.request_id)
            request.fail(EngineDeadError(f"{type(err).__name__}: {err}"))

    async def _attempt(self, request: TrackedRequest, work: WorkRequest) -> None:
        try:
            ticket = await self._place(request, work)
        except TimeoutError:
            if request.route is not None:  # retried elsewhere when there is anywhere else
                request.avoid.add(request.route.decode_id)
            request.lose("a decode worker did not answer in time")
            return
        route = request.route
        if ticket is not None:
            prefill_id = route.prefill_id
            request.awaits_prompt = (  # (a retry may have them from an earlier attempt)
                request.params.prompt_logprobs is not None and request.prompt_logprobs is None
            )
            try:
                result: PrefillResult | None = await self._unless_lost(
                    request,
                    self._call(
                        self.prefill[prefill_id].prefill, request.aged(work), ticket,
                        timeout=self.config.prefill_timeout(len(work.token_ids)),
                    ),
                    verdict_s=PREFILL_VERDICT_S,
                )  # fmt: skip
                if result is None:  # its decode or prefill worker left meanwhile
                    return
                answered_at = time.monotonic()
            except RequestFailedError as err:  # this request broke the worker's step: no retry
                request.fail(RequestFailedError(_brief(err)))
                return
            except InvalidOutputError as err:  # the request is at fault (its response format)
                request.fail(InvalidOutputError(_brief(err)))
                return
            except Exception as err:
                self._note_failure(prefill_id, err)
                if isinstance(err, TransferError):  # its channel broke: the retry replaces it
                    request.broken_channel = (route.decode_id, ticket.channel_key)
                request.avoid.add(prefill_id)
                request.lose(f"prefill on {prefill_id} failed: {_brief(err)}")
                return
            finally:
                self._prefill_over(request, work)
            # The KV is with the decode worker: the request no longer needs its prefill worker.
            request.route = Route(route.decode_id, None)
            if request.queue_seconds is None:  # the decode worker's updates carry none
                request.queue_seconds = result.queue_seconds
            if request.accept_prompt(result.prompt_logprobs):  # (held updates, if any)
                self._stop_on(route.decode_id, work.request_id)
            if not request.params.stops_at(result.token_id, self.eos_ids) and (
                request.accept_first(len(work.output_ids), result.token_id, result.logprobs)
            ):  # a stop string in the first token: the decode worker must stop it too
                self._stop_on(route.decode_id, work.request_id)
            if result.age_s is not None and request.first_token_at is not None:
                # From the end of its prefill step to its first token leaving for the client
                # (by this path or, if it was quicker, from the decode worker): the answer's
                # age on the prefill worker's clock, then this process's own (the call's return
                # trip is not in it). No clock of one host is read against another's.
                since_answer = request.first_token_at - answered_at
                self.handover.observe(max(0.0, result.age_s + since_answer))
        await request.ended.wait()

    @staticmethod
    async def _unless_lost(
        request: TrackedRequest, call: Coroutine, verdict_s: float = 0.0
    ) -> Any | None:
        """The call's result, or None (the call cancelled) if the attempt is lost first: a
        worker that left never holds the request up until its deadline. Lost first, the call
        still has `verdict_s` to fail with the request's own fault (RequestFailedError,
        InvalidOutputError), which then ends it without a retry: a prefill worker that refuses
        a request aborts its KV, and its decode worker may report that abort sooner."""
        work = asyncio.ensure_future(call)
        lost = asyncio.ensure_future(request.ended.wait())
        try:
            await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and verdict_s > 0:
                await asyncio.wait({work}, timeout=verdict_s)
                if work.done() and not work.cancelled():
                    if isinstance(work.exception(), InvalidOutputError | RequestFailedError):
                        raise work.exception()
                    if work.exception() is not None:
                        return None  # (its failure came from the loss: nothing to note)
        finally:
            lost.cancel()
            if not work.done():
                work.cancel()
        return work.result() if work.done() and not work.cancelled() else None

    async def _place(self, request: TrackedRequest, work: WorkRequest) -> Any | None:
        """Chooses workers (request.route, counted against their loads at once) and gets a
        ticket (None: prefilled on the decode worker). A dead decode worker is skipped; one
        that does not answer in time fails the attempt (TimeoutError). When no decode worker
        has room the request waits its turn in `self.room` (coordinator/room.py)."""
        deadline = time.monotonic() + self.config.capacity_wait
        hashes = prefix_hashes(work.token_ids, self.router.block_size)  # once, not per try
        queued = False  # has it waited in line (a woken waiter passes the turn on once in)
        if len(self.room):  # others were refused before it: it waits in line with them
            await self._wait_for_room(deadline, request.arrived_at)
            queued = True
        while True:
            local = request.corrupt_transfers >= MAX_CORRUPT_TRANSFERS
            route = self.router.route(work.token_ids, frozenset(request.avoid), local, hashes)
            self.router.placed(route, work.token_ids, hashes)
            request.route = route  # from here on, ending the attempt frees what D reserved
            request.prefill_queued = route.prefill_id is not None
            decode = self.decode[route.decode_id]
            try:
                if route.prefill_id is None:
                    await self._call(decode.add_local, request.aged(work))
                    ticket = None
                else:
                    broken = request.broken_channel
                    key = broken[1] if broken is not None and broken[0] == route.decode_id else None
                    prefill_tp = self.ranks(route.prefill_id)  # the ticket's routes need it
                    # D holds the seat as long as this waits for P's answer (queue included).
                    lease_s = self.config.prefill_timeout(len(work.token_ids))
                    ticket = await self._call(
                        decode.reserve, work, route.prefill_id, key, prefill_tp, lease_s
                    )
            except RayActorError as err:
                self._unplace(request, work)
                self._note_failure(route.decode_id, err)
                continue
            except Exception:
                if route.decode_id in self.router.decode and self.router.is_alive(route.decode_id):
                    raise
                # It left the decode pool meanwhile (a role switch ends its engine thread
                # mid-call, which answers with an error of its own, not a dead actor's).
                self._unplace(request, work)
                continue
            if route.prefill_id is None or ticket is not None:
                if queued:
                    self.room.freed()  # there may be room for the next in line too
                return ticket
            self._unplace(request, work)
            self.router.refused(route.decode_id)
            if self.router.may_have_room():  # a decode worker not refused yet: try it
                continue
            if time.monotonic() > deadline:  # every decode worker stayed full
                raise EngineDeadError("no decode worker had room for the request in time")
            await self._wait_for_room(deadline, request.arrived_at)
            queued = True

    async def _wait_for_room(self, deadline: float, arrived: float) -> None:
        """Until `freed` wakes this waiter (at the latest, the next stats poll's) or the
        deadline comes."""
        woken = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        self.room.wait(wake, arrived)
        try:  # (asyncio.wait: see `_within`)
            await asyncio.wait({woken}, timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.CancelledError:
            if woken.done():  # its turn came as it left: the next in line gets it
                self.room.freed()
            raise
        finally:
            self.room.leave(wake)

    def _unplace(self, request: TrackedRequest, work: WorkRequest) -> None:
        """Undoes a placement that was not taken (refused, or its worker left mid-call): the
        attempt goes on, placed again."""
        self._prefill_over(request, work)
        self.router.finished(request.route)
        request.route = None
        request.forget_loss()  # (`_worker_left` lost it if its worker left meanwhile)

    def _prefill_over(self, request: TrackedRequest, work: WorkRequest) -> None:
        """Takes the attempt's prompt tokens off its prefill worker's queue in the router, once:
        its prefill ended, or the attempt ended without one (a refused or lost reservation, a
        timeout, a client gone mid-reserve)."""
        if request.prefill_queued and request.route is not None:
            request.prefill_queued = False
            self.router.prefilled(request.route, queued_tokens(request.route, work.token_ids))

    def _end_attempt(self, request: TrackedRequest, work: WorkRequest) -> None:
        """Frees the attempt's route here, and tells its workers to drop it. The aborts are
        sent, not awaited: a caller cancelled again (a client gone while its request ends)
        cannot stop them half-way, which left a decode worker generating for nobody."""
        self._requests.pop(work.request_id, None)
        route = request.route
        if route is None:
            return
        self._prefill_over(request, work)
        self.router.finished(route)
        self.room.freed()
        if request.finished and not request.abort_owed:
            return  # its worker already freed it (a stop string found here aborted it there)
        for worker_id, pool in ((route.decode_id, self.decode), (route.prefill_id, self.prefill)):
            # (not in `pool` any more: it switched roles meanwhile, and its old role is gone)
            handle = pool.get(worker_id) if worker_id is not None else None
            if handle is not None and self.router.is_alive(worker_id):
                self._background(self._call(handle.abort, work.request_id, timeout=5.0))

    # -- decode workers --------------------------------------------------------------------

    def _follow(self, decode_id: str) -> None:
        self._followers[decode_id] = self._background(self._read_updates(decode_id))

    def _unfollow(self, decode_id: str) -> None:
        follower = self._followers.pop(decode_id, None)
        if follower is not None:
            follower.cancel()
        self.updates.forget(decode_id)

    async def _read_updates(self, decode_id: str) -> None:
        """Asks the worker to connect, then dispatches its frames until the role ends. A
        worker whose stream cannot open, breaks or carries garbage leaves its pool."""
        connection = self.updates.expect(decode_id)
        try:
            await self._call(
                self.decode[decode_id].stream_updates, self.updates.endpoint, self.updates.secret
            )
            stream = await _within(connection, self.config.call_timeout)
            while True:
                for update in await stream.read():
                    self._dispatch(decode_id, update)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            reason = "its update stream closed" if _is_eof(err) else _brief(err)
            self._note_failure(decode_id, RuntimeError(reason), fatal=True)

    def _dispatch(self, decode_id: str, update: WorkerUpdate) -> None:
        request = self._requests.get(update.request_id)
        if request is None:  # an attempt that already ended
            return
        if isinstance(update, RequestFailed):
            request.corrupt_transfers += update.corrupt
            if update.retry:
                request.lose(update.reason)
            else:
                request.fail(update.error())
            return
        try:
            hit = request.accept(update)
        except Exception as err:  # this request's output broke here: it fails alone
            # (raised out of here, it would end the whole update stream and with it the
            # decode worker and every request on it)
            log.exception("request %s: its update could not be processed", update.request_id)
            request.fail(RequestFailedError(f"its output could not be processed: {_brief(err)}"))
            hit = True  # stop it on the worker
        if hit:  # a stop string ended it (or it failed here): stop the worker too
            self._stop_on(decode_id, update.request_id)

    def _stop_on(self, decode_id: str, request_id: str) -> None:
        """Aborts on its decode worker a request a stop string ended here (the worker does not
        see stop strings; `_end_attempt` sends nothing for a finished request)."""
        worker = self.decode.get(decode_id)
        if worker is not None:
            self._background(self._call(worker.abort, request_id, timeout=5.0))

    # -- pool membership (Supervisor callbacks) --------------------------------------------

    def _note_failure(self, worker_id: str, err: Exception, fatal: bool = False) -> None:
        """A dead actor (or, with `fatal`, a failing one) leaves its pool for good."""
        if fatal or isinstance(err, RayActorError):
            self.supervisor.report_dead(worker_id, _brief(err))

    def _worker_left(self, entry: WorkerEntry, reason: str) -> None:
        """The worker gets no new requests. A draining one keeps what it has; otherwise the
        requests that still rely on it are placed again."""
        if reason == "draining":
            self.router.set_accepting(entry.worker_id, False)
            return
        # Forgotten, not kept as dead: a replacement comes with a new id, and each worker's
        # load holds its whole reported cache (one hash per block) and is scanned per route.
        self.router.remove(entry.worker_id)
        if entry.pool != "prefill":  # the prefill workers' channels to it close
            for handle in self.prefill.values():
                self._background(self._call(handle.forget_peer, entry.worker_id, timeout=5.0))
        if reason != "switching role":
            self.prefill.pop(entry.worker_id, None)
            self.decode.pop(entry.worker_id, None)
        self._unfollow(entry.worker_id)
        self._stats.pop(entry.worker_id, None)
        self.telemetry.forget(entry.worker_id)  # back in a pool, it re-sends its whole cache
        for request in list(self._requests.values()):
            route = request.route
            if route is not None and entry.worker_id in (route.decode_id, route.prefill_id):
                request.avoid.add(entry.worker_id)
                request.lose(f"worker {entry.worker_id} left: {reason}")

    def _worker_joined(self, entry: WorkerEntry, max_model_len: int) -> None:
        pool = "prefill" if entry.pool == "prefill" else "decode"
        (self.prefill if pool == "prefill" else self.decode)[entry.worker_id] = entry.handle
        self.router.add_worker(pool, entry.worker_id)
        if pool == "decode":
            self._follow(entry.worker_id)
            self.room.freed()

    def _in_use(self, worker_id: str) -> int:
        return sum(
            1
            for request in self._requests.values()
            if request.route is not None
            and worker_id in (request.route.decode_id, request.route.prefill_id)
        )

    # -- stats -----------------------------------------------------------------------------

    async def _refresh_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_SECONDS)
            try:
                await asyncio.gather(self._refresh_once(), self._refresh_telemetry())
            except Exception:  # routing, room and the planner live on these: never stop
                log.exception("refreshing the workers' stats failed; trying again")

    def _alive_workers(self) -> dict[str, Any]:
        """Handles of the workers the router counts alive, by worker id."""
        workers = {**self.prefill, **self.decode}
        return {w: handle for w, handle in workers.items() if self.router.is_alive(w)}

    async def _refresh_telemetry(self) -> None:
        """Each worker's step records and prefix-cache events since the last reply (a lost
        reply is asked for again next time: the cursors only move on an answer)."""
        alive = self._alive_workers()
        replies = await asyncio.gather(
            *(
                self._call(handle.telemetry, *self.telemetry.cursor(w), timeout=STATS_TIMEOUT)
                for w, handle in alive.items()
            ),
            return_exceptions=True,
        )
        for worker_id, reply in zip(alive, replies, strict=True):
            if isinstance(reply, Telemetry) and self.router.is_alive(worker_id):  # not left since
                report = self.telemetry.apply(worker_id, reply)
                self.router.cache_changed(worker_id, *report)

    async def _refresh_once(self) -> None:
        """Each worker answers under its own deadline: a slow one keeps its last report,
        marked stale, and never holds up the others."""
        alive = self._alive_workers()
        results = await asyncio.gather(
            *(self._call(handle.stats, timeout=STATS_TIMEOUT) for handle in alive.values()),
            return_exceptions=True,
        )
        for worker_id, result in zip(alive, results, strict=True):
            if not self.router.is_alive(worker_id):  # it left while its answer was on the way
                continue
            if isinstance(result, WorkerStats):
                self._stats[worker_id] = result
                self.router.observe(worker_id, result.num_free_blocks, result.queued_prefill_tokens)
            elif worker_id in self._stats:
                self._stats[worker_id] = replace(self._stats[worker_id], stale=True)
            if isinstance(result, RayActorError):
                self._note_failure(worker_id, result)
        self.room.freed()  # fresh reports: the first in line may find room now

    def _background(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task) -> None:
        """An abort to a worker that died meanwhile fails, and nothing waits on it: said at
        debug level (asyncio's "exception was never retrieved" otherwise)."""
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        expected = isinstance(err, RayActorError | TimeoutError | asyncio.TimeoutError)
        level = logging.DEBUG if expected else logging.WARNING
        log.log(level, "%s: %r", task.get_coro().__qualname__, err)

    async def _call(self, method, *args: Any, timeout: float | None = None) -> Any:
        return await _within(method.remote(*args), timeout or self.config.call_timeout)


async def _within(awaitable: Awaitable, timeout: float) -> Any:
    """`awaitable`'s result, or TimeoutError once `timeout` seconds have passed (it is then
    cancelled). Not asyncio.wait_for: before Python 3.12 it returns a result that arrives with
    the caller's cancellation and drops the cancellation, so a request whose client left just
    as its reservation came back ran on to its end for nobody (and the client's close waited
    for that)."""
    future = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({future}, timeout=timeout)
    except asyncio.CancelledError:
        if not future.cancel() and not future.cancelled():
            future.exception()  # (read: asyncio would log an error of it as never retrieved)
        raise
    if not done:
        future.cancel()
        raise TimeoutError
    return future.result()


def _is_eof(err: BaseException) -> bool:
    return isinstance(err, (asyncio.IncompleteReadError, ConnectionError))


def _brief(err: BaseException) -> str:
    """One line about an error (Ray's messages run to many lines)."""
    if isinstance(err, RayActorError):
        return "the worker died"
    if isinstance(err, TimeoutError):
        return "no answer in time"
    lines = str(err).strip().splitlines()
    return lines[-1] if lines else type(err).__name__
