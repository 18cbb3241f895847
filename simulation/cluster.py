"""The discrete-event simulation of one deployment serving one workload.

Simulated time only moves between events (a heap of callbacks). The policies are the real ones:
`coordinator.router.Router` picks every route, from the same stale view the coordinator has
(loads it counts itself, free blocks, queues and cached prefixes as of the last stats poll);
`engine.scheduler.Scheduler` plans every step on every worker. Around them this file plays the
parts that take time: a client that sends at the workload's arrival times (at most
`max_concurrency` in flight), engine steps as long as the cost model says, KV that leaves a
prefill worker layer by layer while later layers compute, and workers that die or join.

Request flow, as in `coordinator/coordinator.py`:
    arrive -> (dispatch) route -> local: the decode worker queues it
                               -> remote: the decode worker reserves blocks (no room: retry),
                                  the prefill worker queues it
    prefill step ends with its first token -> the KV's last layer lands -> (handover) the decode
        worker admits it and the client gets the first token
    each decode step -> one token per running request -> (delivery) the client
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from coordinator.room import RoomQueue
from coordinator.router import NoWorkerError, Route, Router, prefix_hashes, queued_tokens
from engine.block_manager import num_blocks_for
from engine.scheduler import StepPlan
from engine.sequence import Sequence as EngineSequence
from loadtest.config import LoadConfig
from protocol.sampling import FinishReason
from simulation.deployment import Scenario
from simulation.interference import slowed
from simulation.leap import Leap, cut, plan_leap, settle
from simulation.worker import PacedStep, SimWorker
from simulation.workload import MAX_ARRIVAL_S, SimRequest, SimulationError

FRESH_TOKEN_BASE = 1 << 40  # made-up output tokens of real (list) prompts: shared by none

MAX_SIMULATED_S = 2 * MAX_ARRIVAL_S  # the last arrival, then as long again to finish


@contextmanager
def collector_paused() -> Iterator[None]:
    """CPython's cycle collector off for the block. A simulation makes millions of short-lived
    objects beside millions of long-lived ones (runs, token times, block tables), and the
    collector kept rescanning the long-lived ones: a third of a 128-GPU run, and 40% of making
    its report. Nothing here makes cyclic garbage worth collecting meanwhile (peak memory is
    the same without the collector)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@dataclass(eq=False)
class Run:
    """One request's life in the simulation."""

    index: int
    request: SimRequest
    sent_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    token_times: array = field(default_factory=lambda: array("d"))
    route: Route | None = None
    prefill_seq: EngineSequence | None = None
    decode_seq: EngineSequence | None = None
    attempts: int = 0
    avoid: set[str] = field(default_factory=set)
    resume_ids: Sequence[int] | None = None  # prompt and output of a lost attempt
    moves: int = 0  # attempts ended by a pool change, not a failure
    error: str | None = None
    _hashes: tuple[int, list[int]] = (-1, [])  # (token count, their prefix hashes)

    @property
    def key(self) -> str:
        return f"{self.index}.{self.attempts}"

    @property
    def num_output(self) -> int:
        return len(self.token_times)

    def prefix_hashes(self, block_size: int) -> list[int]:
        """The prompt's block hashes, computed once per token list (a reservation that finds
        no room is tried again whenever room may have freed: 8,000 tokens to hash each time)."""
        ids = self.token_ids()
        if self._hashes[0] != len(ids):
            self._hashes = (len(ids), prefix_hashes(ids, block_size))  # type: ignore[arg-type]
        return self._hashes[1]

    def forget_hashes(self) -> None:
        self._hashes = (-1, [])

    def token_ids(self) -> Sequence[int]:
        """Prompt and output so far (a retried request resumes where it stopped)."""
        if self.decode_seq is not None:
            return self.decode_seq.token_ids
        return self.resume_ids if self.resume_ids is not None else self.request.prompt_ids


@dataclass
class Outcome:
    runs: list[Run]
    duration_s: float
    num_aborted: int  # in flight when max_duration ran out
    num_unsent: int
    workers: dict[str, SimWorker]
    num_events: int


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        requests: Sequence[SimRequest],
        load: LoadConfig | None = None,
        max_attempts: int = 4,
        leaping: bool = True,
        noise_seed: int = 1,
    ) -> None:
        """`noise_seed`: the draws of the measured step-time spread (Deployment.step_noise)."""
        self.scenario = scenario
        # off: every decode step through the scheduler (same outcome). Workers that share a
        # host step one at a time: how long a step takes depends on who else is stepping.
        dep = scenario.deployment
        # A leap prices its steps ahead without noise.
        noisy = dep.step_noise or dep.prefill_step_noise or dep.thread_noise
        self.leaping = leaping and not dep.shares_host and not noisy
        self._draws = random.Random(0)  # measured interference factors: the same every run
        self._noise = random.Random(noise_seed)  # measured step-time spread
        self.load = load or LoadConfig()
        self.max_attempts = max_attempts
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._fresh = FRESH_TOKEN_BASE  # the next made-up output token
        self.runs = [Run(i, r) for i, r in enumerate(requests)]
        self._run_by_key: dict[str, Run] = {}  # every attempt's sequence key (Run.key)
        self.workers: dict[str, SimWorker] = {}
        dep = scenario.deployment
        prefill_ids = [f"prefill-{i}" for i in range(dep.prefill_workers)]
        decode_ids = [
            f"{'worker' if dep.colocated else 'decode'}-{i}" for i in range(dep.decode_workers)
        ]
        self.router = Router(
            prefill_ids,
            decode_ids,
            dep.engine.block_size,
            dep.local_threshold,
            dep.routing,
            dep.route_costs,
        )
        for worker_id in prefill_ids:
            self.workers[worker_id] = self._new_worker(worker_id, "prefill")
        for worker_id in decode_ids:
            self.workers[worker_id] = self._new_worker(worker_id, "decode")
        unknown = sorted({f.worker_id for f in scenario.faults} - set(self.workers))
        if unknown:  # (a fault that kills nothing is a typo, not a scenario)
            raise SimulationError(
                f"no worker {', '.join(unknown)} to kill; this deployment has "
                f"{', '.join(self.workers)}"
            )
        # Who holds what, in placing order (a set would re-place a dead worker's requests in an
        # order that changes from one process to the next).
        self._holders: dict[str, dict[Run, None]] = {w: {} for w in self.workers}
        self._waiting_to_send: deque[Run] = deque()
        # requests waiting for a decode worker with room, as in the coordinator
        self.room = RoomQueue(lambda: self.now, dep.late_after_s)
        self.sent: deque[tuple[float, int, int]] = deque()  # (when, prompt, output), for planners
        self.finished: deque[Run] = deque()  # in finishing order, for planners
        self._in_flight = 0
        self._unfinished = len(self.runs)
        self._joining: dict[str, SimWorker] = {}  # starting, or switching pools
        self.on_poll: Callable[[Simulation], None] | None = None  # the planner's hook

    # -- the event loop ------------------------------------------------------------------

    def at(self, when: float, action: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (when, next(self._order), action, args))

    def run(self) -> Outcome:
        for run in self.runs:
            self.at(run.request.arrival, self._arrive, run)
        for fault in self.scenario.faults:
            self.at(fault.at, self.kill, fault.worker_id)
        self.at(0.0, self._poll)
        with collector_paused():
            # However long the steps a profile prices (a typo of 1e6 s a step), the simulated
            # time ends: past it, what is unfinished counts as aborted, as at --max-duration.
            limit = min(self.load.max_duration_s or math.inf, MAX_SIMULATED_S)
            num_events = self._loop(limit)
        for worker in self.workers.values():
            self._settle(worker)
        ended = [r.finished_at for r in self.runs if r.finished_at is not None]
        duration = self.now if self._unfinished else max(ended, default=0.0)
        aborted = sum(1 for r in self.runs if r.finished_at is None and r.sent_at is not None)
        unsent = sum(1 for r in self.runs if r.sent_at is None)
        return Outcome(self.runs, duration, aborted, unsent, self.workers, num_events)

    def _loop(self, limit: float) -> int:
        """Plays events in time order until every request ended or `limit`; the event count."""
        num_events = 0
        while self._events and self._unfinished:
            when, _, action, args = heapq.heappop(self._events)
            if when > limit:
                self.now = limit
                break
            self.now = when
            action(*args)
            num_events += 1
        return num_events

    # -- the client ----------------------------------------------------------------------

    def _arrive(self, run: Run) -> None:
        cap = self.load.max_concurrency
        if cap is not None and self._in_flight >= cap:
            self._waiting_to_send.append(run)
            return
        self._send(run)

    def _send(self, run: Run) -> None:
        self._in_flight += 1
        run.sent_at = self.now
        num_prompt, num_output = len(run.request.prompt_ids), run.request.output_len
        self.sent.append((self.now, num_prompt, num_output))
        # The server's check (protocol/limits.py, coordinator/api/prompts.py): a worker's
        # context is at most its KV pool, since one sequence alone must always fit (preempting
        # could not make room); a prompt that fills it is refused, an output stops at its end.
        engine = self.scenario.deployment.engine
        context = engine.num_blocks * engine.block_size
        if num_prompt >= context:
            self._done(
                run,
                f"HTTP 400 Bad Request: the prompt has {num_prompt} tokens; this server serves "
                f"at most {context} tokens of context, prompt and output together",
            )
            return
        if num_output > context:
            self._done(
                run,
                f"HTTP 400 Bad Request: max_tokens is {num_output}, more than this model's "
                f"context ({context} tokens)",
            )
            return
        if num_prompt + num_output > context:
            run.request = run.request._replace(output_len=context - num_prompt)
        self.at(self.now + self.scenario.overheads.dispatch, self._place, run)

    def _done(self, run: Run, error: str | None = None) -> None:
        run.finished_at = self.now
        run.error = error
        run.forget_hashes()  # an hour of 8,000-token prompts: ~1 GB of hashes otherwise
        self.finished.append(run)
        self._in_flight -= 1
        self._unfinished -= 1
        if self._waiting_to_send:
            self._send(self._waiting_to_send.popleft())

    # -- the coordinator -----------------------------------------------------------------

    def _place(self, run: Run, queued: bool = False) -> None:
        """Routes the request, as `Coordinator._place` does. No decode worker with room: it
        waits its turn in `self.room` (coordinator/room.py), woken when room may have freed;
        `queued`: it was woken there (placed, it passes the turn on)."""
        if not queued and len(self.room):  # others wait for room first
            self._wait_for_room(run)
            return
        if self._no_decode_room(run):  # what routing would find, without routing
            self._wait_for_room(run)
            return
        ids = run.token_ids()
        try:
            hashes = run.prefix_hashes(self.router.block_size)
            route = self.router.route(ids, frozenset(run.avoid), hashes=hashes)  # type: ignore[arg-type]
        except NoWorkerError as err:
            self._done(run, str(err))
            return
        decode = self.workers[route.decode_id]
        num_prompt = len(run.request.prompt_ids)
        seq = decode.new_sequence(run.key, ids, num_prompt, run.request.output_len, hashes)
        self._run_by_key[run.key] = run
        if route.prefill_id is not None and not self._reserve(decode, seq):
            # The coordinator counts the route before its reserve call and undoes it on a
            # refusal; nothing happens in between here, so a refused route is never counted.
            self.router.refused(route.decode_id)
            if self.router.may_have_room():
                self._place(run, queued)
            else:
                self._wait_for_room(run)
            return
        if queued:
            self.room.freed()  # there may be room for the next in line too
        self.router.placed(route, ids, hashes)  # type: ignore[arg-type]
        if route.prefill_id is None:
            self._interrupt(decode)
            seq.arrival_time = run.sent_at
            decode.scheduler.add(seq)
            self._hold(run, route, decode_seq=seq)
            self._wake(decode)
            return
        prefill = self.workers[route.prefill_id]
        pseq = prefill.new_sequence(run.key, ids, num_prompt, run.request.output_len, hashes)
        pseq.arrival_time = run.sent_at
        prefill.scheduler.add(pseq)
        self._hold(run, route, decode_seq=seq, prefill_seq=pseq)
        self._wake(prefill)

    def _wait_for_room(self, run: Run) -> None:
        assert run.sent_at is not None
        self.room.wait(lambda: self.at(self.now, self._place, run, True), run.sent_at)

    def _no_decode_room(self, run: Run) -> bool:
        """Every decode worker has all its sequence slots taken, or fewer free blocks than the
        prompt needs beyond what its prefix cache might hold, while the route is sure to be
        remote (load routing, no local prefill, a prefill worker up): the reservation would be
        refused wherever the router sent it. (At a 128-GPU peak hundreds of requests wait for
        room; the first in line is woken at every finish.)"""
        deployment = self.scenario.deployment
        if (
            deployment.routing == "cost"
            or deployment.local_threshold
            or not self.serving("prefill")
        ):
            return False
        decodes = self.serving("decode")
        if not decodes:
            return False
        block_size = self.router.block_size
        need = num_blocks_for(len(run.token_ids()), block_size)
        hashes = run.prefix_hashes(block_size)
        for worker in decodes:
            if not worker.has_room():
                continue
            self._settle(worker)
            cached = worker.blocks.hash_to_block
            hits = next((i for i, digest in enumerate(hashes) if digest not in cached), len(hashes))
            if worker.blocks.num_free_blocks >= need - hits:
                return False
        return True

    def _hold(
        self,
        run: Run,
        route: Route,
        decode_seq: EngineSequence,
        prefill_seq: EngineSequence | None = None,
    ) -> None:
        run.route, run.decode_seq, run.prefill_seq = route, decode_seq, prefill_seq
        self._holders[route.decode_id][run] = None
        if route.prefill_id is not None:
            self._holders[route.prefill_id][run] = None

    def _release(self, run: Run) -> None:
        route = run.route
        if route is None:
            return
        for worker_id in (route.decode_id, route.prefill_id):
            if worker_id is not None:
                self._holders[worker_id].pop(run, None)

    def _poll(self) -> None:
        """The coordinator's stats and telemetry poll: what the router knows is this old."""
        for worker in self.workers.values():
            if not worker.alive:
                continue
            self._settle(worker)
            self.router.observe(
                worker.worker_id, worker.blocks.num_free_blocks, worker.queued_prompt_tokens
            )
            if worker.cache_stored or worker.cache_evicted:
                stored, evicted = worker.cache_stored, worker.cache_evicted
                worker.cache_stored, worker.cache_evicted = [], []
                self.router.cache_changed(worker.worker_id, stored, evicted)
        self._retire_drained()
        self.room.freed()  # fresh reports: the first in line may find room now
        if self.on_poll is not None:
            self.on_poll(self)
        if not self._events:  # nothing left that could ever move a request on
            self._give_up()
        if self._events:
            self.at(self.now + self.scenario.overheads.stats_interval, self._poll)

    def _give_up(self) -> None:
        for run in self.runs:
            if run.finished_at is None and run.sent_at is not None:
                self._done(run, "stuck: no worker could take it")

    # -- workers -------------------------------------------------------------------------

    def _wake(self, worker: SimWorker) -> None:
        if worker.stepping or not worker.alive or not worker.scheduler.num_unfinished:
            return
        worker.stepping = True
        self.at(self.now + self.scenario.overheads.step_gap, self._start_step, worker, worker.epoch)

    def _start_step(self, worker: SimWorker, epoch: int) -> None:
        if not worker.alive or epoch != worker.epoch or self._leap(worker):
            return
        plan = worker.scheduler.schedule(len(worker.reserved))
        if not plan.chunks:  # nothing fits until blocks free up; a finish wakes it
            worker.stepping = False
            return
        threads = self._threads(worker)
        noise = self._step_noise(plan, threads)
        seconds = self._step_seconds(worker, self._modelled(worker, plan, threads, noise))
        worker.step_ends_at = self.now + seconds
        landed = self._send_kv(worker, plan, seconds) if worker.pool == "prefill" else {}
        worker.step_id += 1
        self.at(
            self.now + seconds, self._end_step, worker, plan, seconds, landed, epoch, worker.step_id
        )
        if threads is not None:
            worker.threads_used[threads] = worker.threads_used.get(threads, 0) + 1
            costs = self.scenario.costs
            if worker.pool == "decode" or costs.transfer is None or costs.kv is None:
                # A prefill step whose KV sends are timed per layer on the link keeps its pace.
                worker.paced = PacedStep(plan, threads, seconds, self.now, noise, list(landed))
            self._repace(worker)

    def _modelled(
        self, worker: SimWorker, plan: StepPlan, threads: int | None, noise: float
    ) -> float:
        """Seconds a step of `plan` takes on `worker` starting now, before interference: the
        model's (the one for `threads` on paced cores), times its noise draw and the
        oversubscription of paced cores."""
        costs = self.scenario.costs
        model = costs.step if threads is None else costs.step_on(threads)
        return max(model.predict(plan.shape()), 1e-6) * noise * self._oversubscribed(worker)

    def _step_noise(self, plan: StepPlan, threads: int | None) -> float:
        """A step's draw of the measured spread around the model (Deployment.step_noise, or
        prefill_step_noise for a step with prompt tokens; on paced cores, the spread measured
        on `threads` threads when there is one: Deployment.thread_noise)."""
        dep = self.scenario.deployment
        prompt = any(chunk.num_tokens > 1 for chunk in plan.chunks)
        noise = dep.prefill_step_noise if prompt else dep.step_noise
        if threads is not None and threads in dep.thread_noise:
            decodes, prompts = dep.thread_noise[threads]
            noise = (prompts if prompt else decodes) or noise
        return self._noise.choice(noise) if noise else 1.0

    def _oversubscribed(self, worker: SimWorker) -> float:
        """On workers that pace their cores: how much slower a step of `worker` runs now for
        the threads in steps outnumbering the cores (k workers in a step, itself included,
        each on at least one thread: k / cores when k is more). Else 1."""
        cores = self.scenario.deployment.paced_cores
        if cores is None:
            return 1.0
        k = 1 + sum(
            1
            for w in self.workers.values()
            if w is not worker and w.alive and w.step_ends_at > self.now
        )
        return max(1.0, k / cores)

    def _threads(self, worker: SimWorker) -> int | None:
        """On workers that pace their cores (Deployment.paced_cores): the threads a step of
        `worker` gets now, its share of the cores among the workers with work. Else None."""
        cores = self.scenario.deployment.paced_cores
        if cores is None:
            return None
        busy = sum(
            1
            for w in self.workers.values()
            if w.alive and (w is worker or w.scheduler.num_unfinished)
        )
        return max(1, cores // busy)

    def _repace(self, changed: SimWorker) -> None:
        """`changed` started or ended a step: every other paced step in progress runs the rest
        of its way on its new share of the cores (workers re-pace between layers) and at the
        new oversubscription, its end moved to match (a prefill step's KV, sent at its end
        without a transfer model, too)."""
        for worker in self.workers.values():
            step = worker.paced
            if worker is changed or step is None or not worker.alive:
                continue
            if worker.step_ends_at <= self.now:
                worker.paced = None
                continue
            threads = self._threads(worker)  # paced steps exist only on paced cores
            total = self._modelled(worker, step.plan, threads, step.noise)
            if threads == step.threads and total == step.total:
                continue
            step.done += (self.now - step.since) / step.total
            step.total = total
            step.threads, step.since = threads, self.now
            ends = self.now + max(0.0, 1.0 - step.done) * step.total
            worker.step_ends_at = ends
            worker.step_id += 1
            self.at(
                ends, self._end_step, worker, step.plan, ends - step.started,
                dict.fromkeys(step.landed, ends), worker.epoch,
                worker.step_id,
            )  # fmt: skip

    def _step_seconds(self, worker: SimWorker, seconds: float) -> float:
        """How long a step of `worker` starting now lasts (`seconds` as modelled) when workers
        share a CPU host: the workers in a step (this one included) over the host's cores
        (Deployment.host_cores); a decode step beside a prefill step slowed while that step
        lasts (Deployment.prefill_interference, simulation/interference.py); a prefill step
        beside a decode step slowed all along (Deployment.decode_interference: decode steps
        follow each other back to back)."""
        dep = self.scenario.deployment
        if not dep.shares_host:
            return seconds
        busy = [w for w in self.workers.values() if w.alive and w.step_ends_at > self.now]
        if dep.host_cores is not None:
            seconds *= max(1.0, (1 + len(busy)) / dep.host_cores)
        other = "prefill" if worker.pool == "decode" else "decode"
        beside = [w for w in busy if w.pool == other]
        if not beside:
            return seconds
        worker.steps_beside += 1
        factors = dep.prefill_interference if other == "prefill" else dep.decode_interference
        factor = self._draws.choice(factors) if isinstance(factors, tuple) else factors
        if factor == 1:
            return seconds
        if worker.pool == "prefill":
            return seconds * factor
        return slowed(seconds, factor, max(w.step_ends_at for w in beside) - self.now)

    def _send_kv(self, worker: SimWorker, plan: StepPlan, seconds: float) -> dict[str, float]:
        """When each sampling chunk's KV has fully landed: layer l of every chunk is sent once
        computed (at l+1 / L of the step) and the worker's link is free, one send at a time."""
        transfer, kv = self.scenario.costs.transfer, self.scenario.costs.kv
        if transfer is None or kv is None:
            return {c.seq.request_id: self.now + seconds for c in plan.chunks if c.samples}
        layers, per_token = kv.num_layers, kv.bytes_per_token_layer()
        per_layer = [transfer.predict(c.num_tokens * per_token) for c in plan.chunks]
        link = max(worker.link_free_at, self.now)
        for layer in range(layers):
            ready = self.now + seconds * (layer + 1) / layers
            for cost in per_layer:
                link = max(link, ready) + cost
        worker.link_free_at = link
        return {c.seq.request_id: link for c in plan.chunks if c.samples}

    def _end_step(
        self,
        worker: SimWorker,
        plan: StepPlan,
        seconds: float,
        landed: dict[str, float],
        epoch: int,
        step_id: int,
    ) -> None:
        if not worker.alive or epoch != worker.epoch or step_id != worker.step_id:
            return  # the worker died or moved, or this step's end was re-timed
        worker.paced = None
        worker.busy_seconds += seconds
        worker.num_steps += 1
        # A request aborted during the step (its other worker died or moved) is not committed;
        # on a real worker aborts land between steps, here they may land in the middle of one.
        live = tuple(c for c in plan.chunks if not c.seq.is_finished)
        if len(live) < len(plan.chunks):
            plan = StepPlan(live, plan.preempted)
        worker.scheduler.commit(plan)
        delivery = self.now + self.scenario.overheads.delivery
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            seq = chunk.seq
            run = self._run_of(seq)
            if worker.pool == "prefill":
                worker.scheduler.finish(seq, FinishReason.LENGTH)
                when = landed[seq.request_id] + self.scenario.overheads.handover
                self.at(when, self._kv_landed, run, seq.request_id)
                continue
            self._token(worker, run, seq, delivery)
        worker.stepping = False
        if self.scenario.deployment.paced_cores is not None:
            self._repace(worker)  # out of its step (idle, maybe): the others re-pace
        self._wake(worker)

    def _run_of(self, seq: EngineSequence) -> Run:
        return self._run_by_key[seq.request_id]

    def _token(self, worker: SimWorker, run: Run, seq: EngineSequence, at: float) -> None:
        seq.token_ids.append(self._fresh)
        self._fresh += 1
        if run.first_token_at is None:
            run.first_token_at = at
        run.token_times.append(at)
        if run.num_output >= run.request.output_len:
            worker.scheduler.finish(seq, FinishReason.LENGTH)
            self._finish(run)

    def _finish(self, run: Run) -> None:
        self._release(run)
        if run.route is not None:
            self.router.finished(run.route)
            self.room.freed()
        self._done(run)

    def _kv_landed(self, run: Run, key: str) -> None:
        if key != run.key or run.route is None:  # an attempt that was lost meanwhile
            return
        route = run.route
        self.router.prefilled(route, queued_tokens(route, run.token_ids()))  # type: ignore[arg-type]
        decode = self.workers[route.decode_id]
        if not decode.alive:
            return
        self._interrupt(decode)
        if route.prefill_id is not None:
            self._holders[route.prefill_id].pop(run, None)
        run.route = Route(route.decode_id, None)
        seq = decode.admit(key)
        self._token(decode, run, seq, self.now)
        self._wake(decode)

    # -- leaps over decode steps (simulation/leap.py) -------------------------------------

    def _leap(self, worker: SimWorker) -> bool:
        """Starts a leap if the worker's next steps are plain decodes; True if it did."""
        if not self.leaping or worker.pool != "decode":
            return False
        running = worker.scheduler.running
        left = min((self._tokens_left(seq) for seq in running), default=0)
        gap, cost = self.scenario.overheads.step_gap, self.scenario.costs.step
        leap = plan_leap(worker.scheduler, left - 1, self.now, gap, cost.predict_decodes)
        if leap is None:
            return False
        worker.leap = leap
        self._settle(worker)  # the first step's blocks
        self.at(leap.end, self._end_leap, worker, leap, leap.version, worker.epoch)
        return True

    def _tokens_left(self, seq: EngineSequence) -> int:
        run = self._run_of(seq)
        return run.request.output_len - run.num_output

    def _settle(self, worker: SimWorker) -> None:
        """Brings a leaping worker up to now (anything that reads or changes it calls this)."""
        if worker.leap is None:
            return
        for seconds in settle(worker.leap, worker.scheduler, self.now, self._deliver):
            worker.busy_seconds += seconds
            worker.num_steps += 1

    def _deliver(self, seqs: list[EngineSequence], ends: list[float]) -> None:
        delay = self.scenario.overheads.delivery
        times = array("d", [end + delay for end in ends])
        count = len(times)
        for seq in seqs:
            seq.token_ids.extend(range(self._fresh, self._fresh + count))  # type: ignore[attr-defined]
            self._fresh += count
            self._run_of(seq).token_times.extend(times)

    def _interrupt(self, worker: SimWorker) -> None:
        """Before the worker's batch changes: its leap ends after the step in progress."""
        leap = worker.leap
        if leap is None:
            return
        self._settle(worker)
        in_step = leap.in_step
        cut(leap)
        if in_step:
            self.at(leap.end, self._end_leap, worker, leap, leap.version, worker.epoch)
            return
        worker.leap = None  # between two steps: the next one goes through the scheduler
        next_start = leap.ends[leap.done - 1] + self.scenario.overheads.step_gap
        self.at(next_start, self._start_step, worker, worker.epoch)

    def _end_leap(self, worker: SimWorker, leap: Leap, version: int, epoch: int) -> None:
        if worker.leap is not leap or leap.version != version or epoch != worker.epoch:
            return
        self._settle(worker)
        worker.leap = None
        worker.stepping = False
        self._wake(worker)

    def _reserve(self, decode: SimWorker, seq: EngineSequence) -> bool:
        """`SimWorker.reserve`, on a settled worker; a leap that no longer fits its blocks
        ends after the step in progress (the scheduler then preempts as it would)."""
        self._settle(decode)
        if not decode.reserve(seq):
            return False
        leap = decode.leap
        if leap is not None and leap.blocks_left > decode.blocks.num_free_blocks:
            self._interrupt(decode)
        return True

    # -- faults and pool changes ---------------------------------------------------------

    def kill(self, worker_id: str) -> None:
        """The worker dies: the router forgets it (as the coordinator's `_worker_left` does:
        its load and cached prefixes are gone); its requests are placed again."""
        worker = self.workers.get(worker_id)
        if worker is None or not worker.alive:
            return
        self._settle(worker)
        self._void_steps(worker)
        worker.alive = False
        self.router.remove(worker_id)
        for run in list(self._holders[worker_id]):
            self._lose(run, worker_id)

    def _void_steps(self, worker: SimWorker) -> None:
        """The worker stops stepping for good (it dies, leaves, or changes pools): the events
        of its steps in progress are void (a new epoch), and a paced step in progress is no
        longer re-timed or counted as computing."""
        worker.leap = None
        worker.paced = None
        worker.stepping = False
        worker.step_ends_at = min(worker.step_ends_at, self.now)
        worker.epoch += 1

    def _lose(self, run: Run, culprit: str, failed: bool = True) -> None:
        """Ends the attempt everywhere; the request goes on from the tokens it has. `failed`:
        the worker broke (the attempt counts, the worker is avoided); else it was moved."""
        route = run.route
        assert route is not None
        self._release(run)
        for worker_id, seq in (
            (route.decode_id, run.decode_seq),
            (route.prefill_id, run.prefill_seq),
        ):
            if worker_id is not None and self.workers[worker_id].alive:
                self._interrupt(self.workers[worker_id])
                self.workers[worker_id].drop(run.key, seq)
                self._wake(self.workers[worker_id])
        self.router.unplace(route, run.token_ids())  # type: ignore[arg-type]
        self.room.freed()
        run.resume_ids = run.token_ids()
        run.route, run.prefill_seq, run.decode_seq = None, None, None
        run.attempts += 1  # (a new attempt key: events of the old one are void)
        if not failed:
            run.moves += 1
            self.at(self.now, self._place, run)
            return
        run.avoid.add(culprit)
        if run.attempts - run.moves >= self.max_attempts:
            self._done(run, f"gave up after {run.attempts} attempts")
            return
        self.at(self.now + self.scenario.overheads.failure_detect, self._place, run)

    def add_worker(self, pool: str, ready_in: float) -> str:
        """A new worker for `pool`, serving after `ready_in` seconds; returns its id."""
        prefix = "prefill" if pool == "prefill" else "decode"
        number = len(self.workers)
        worker_id = f"{prefix}-{number}"
        self.workers[worker_id] = worker = self._new_worker(worker_id, pool)
        worker.alive = False
        self._holders[worker_id] = {}
        self._joining[worker_id] = worker
        self.at(self.now + ready_in, self._join, worker)
        return worker_id

    def _new_worker(self, worker_id: str, pool: str) -> SimWorker:
        dep = self.scenario.deployment
        return SimWorker(worker_id, pool, dep.engine, lambda: self.now, dep.late_after_s)

    def _join(self, worker: SimWorker) -> None:
        self._joining.pop(worker.worker_id, None)
        worker.alive, worker.stepping = True, False
        self.router.add_worker(worker.pool, worker.worker_id)
        self.router.observe(worker.worker_id, worker.blocks.num_free_blocks, 0)
        if worker.pool == "decode":
            self.room.freed()

    def switch_role(self, worker_id: str, pool: str) -> None:
        """Moves a worker to the other pool, as `POST /admin/workers/{id}/role` does: its
        requests are placed again elsewhere (decodes resume from their tokens), and it rejoins
        after `role_switch` seconds with its model (and prefix cache) still loaded."""
        worker = self.workers[worker_id]
        self.router.set_accepting(worker_id, False)
        for run in list(self._holders[worker_id]):
            self._lose(run, worker_id, failed=False)
        self.router.remove(worker_id)
        self._settle(worker)
        self._void_steps(worker)
        worker.alive = False
        worker.pool = pool
        self._joining[worker_id] = worker
        self.at(self.now + self.scenario.overheads.role_switch, self._join, worker)

    def drain(self, worker_id: str) -> None:
        """The worker takes nothing new and leaves once its requests finish."""
        self.router.set_accepting(worker_id, False)
        self.workers[worker_id].draining = True

    def _retire_drained(self) -> None:
        for worker in self.workers.values():
            if (
                worker.draining
                and worker.alive
                and worker.idle
                and not self._holders[worker.worker_id]
            ):
                self._void_steps(worker)
                worker.alive, worker.draining = False, False
                self.router.remove(worker.worker_id)

    def serving(self, pool: str) -> list[SimWorker]:
        """Workers of `pool` that take requests (alive, not draining)."""
        return [w for w in self.workers.values() if w.pool == pool and w.alive and not w.draining]

    def pending(self, pool: str) -> int:
        """Workers asked for (starting or switching) that will join `pool`."""
        return sum(1 for worker in self._joining.values() if worker.pool == pool)
