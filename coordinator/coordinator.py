"""Coordinator: the disaggregated backend behind the HTTP app (an EngineClient).

For each request:
    route -> decode worker D (+ prefill worker P, unless D prefills it locally)
    D.reserve(request, P) -> ticket;  P.prefill(request, ticket) -> first token (streamed at once)
    D's token batches arrive through one long-poll loop per decode worker, for all its requests
Failures: a dead P, a failed or expired transfer, or a dead D end the attempt; the request is
placed again with the tokens generated so far (a decode worker resumes it as if preempted), up
to MAX_ATTEMPTS. Every remote call has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from coordinator.request_state import TrackedRequest
from coordinator.router import NoWorkerError, Route, Router
from engine.outputs import RequestOutput, read_stream
from engine.tokenizer import Tokenizer
from protocol.errors import EngineDeadError, RequestFailedError
from protocol.limits import ModelLimits
from protocol.messages import PrefillResult, RequestFailed, WorkerUpdate, WorkRequest
from protocol.sampling import SamplingParams
from protocol.stats import WorkerStats

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 4
POLL_SECONDS = 1.0
MAX_POLL_FAILURES = 3
STATS_SECONDS = 1.0


@dataclass(frozen=True)
class CoordinatorConfig:
    block_size: int
    local_prefill_threshold: int = 0  # tokens; 0 = always prefill remotely
    call_timeout: float = 30.0  # any control call (reserve, abort, stats, one poll)
    prefill_timeout: float = 300.0  # queueing + prefill + transfer of one request
    capacity_wait: float = 60.0  # how long a request may wait for decode KV blocks


class Coordinator:
    def __init__(
        self,
        model_name: str,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        eos_ids: frozenset[int],
        prefill: dict[str, Any],  # worker id -> PrefillActor handle
        decode: dict[str, Any],  # worker id -> DecodeActor handle
        config: CoordinatorConfig,
    ) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.limits = ModelLimits(max_model_len, vocab_size)
        self.eos_ids = eos_ids
        self.prefill = prefill
        self.decode = decode
        self.config = config
        self.router = Router(
            list(prefill), list(decode), config.block_size, config.local_prefill_threshold
        )
        self._requests: dict[str, TrackedRequest] = {}  # by worker request id
        self._stats: dict[str, WorkerStats] = {}
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count()

    # -- EngineClient ----------------------------------------------------------------------

    async def ready(self) -> None:
        workers = {**self.prefill, **self.decode}
        limits = await asyncio.gather(  # model loading can take minutes on a cold node
            *(self._call(w.ping, timeout=600.0) for w in workers.values())
        )
        self.max_model_len = min([self.max_model_len, *limits])
        self.limits = ModelLimits(self.max_model_len, self.vocab_size)
        self._tasks = [asyncio.create_task(self._poll(w)) for w in self.decode]
        self._tasks.append(asyncio.create_task(self._refresh_stats()))
        await self._refresh_once()

    async def shutdown(self) -> None:
        """Fails what is still in flight and stops every worker actor."""
        for task in self._tasks:
            task.cancel()
        for request in list(self._requests.values()):
            request.fail(EngineDeadError("the server is shutting down"))
        for worker in (*self.prefill.values(), *self.decode.values()):
            with contextlib.suppress(Exception):
                ray.kill(worker)

    def check_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        self.limits.check_prompt(prompt_ids)
        if params is not None:
            self.limits.check_params(params)

    def stats(self) -> list[WorkerStats]:
        return list(self._stats.values())

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        self.check_request(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        request = TrackedRequest(request_id, list(prompt_ids), params, self.tokenizer)
        driver = asyncio.create_task(self._drive(request))
        try:
            async for output in read_stream(request.stream):
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
                    await self._end_attempt(request, work)
                if request.finished:
                    return
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
            route, ticket = await self._place(request, work)
        except TimeoutError:
            request.lose("a decode worker did not answer in time")
            return
        request.route = route
        if ticket is not None:
            try:
                result: PrefillResult = await self._call(
                    self.prefill[route.prefill_id].prefill, work, ticket,
                    timeout=self.config.prefill_timeout,
                )  # fmt: skip
            except RequestFailedError as err:  # this request broke the worker's step: no retry
                request.fail(RequestFailedError(_brief(err)))
                return
            except Exception as err:
                self._note_failure(route.prefill_id, err)
                request.lose(f"prefill on {route.prefill_id} failed: {_brief(err)}")
                return
            finally:
                self.router.prefilled(route, len(work.token_ids))
            if result.token_id not in request.params.stop_ids(self.eos_ids):
                request.accept_first(len(work.output_ids), result.token_id, result.logprobs)
        await request.ended.wait()

    async def _place(self, request: TrackedRequest, work: WorkRequest) -> tuple[Route, Any | None]:
        """Chooses workers and gets a ticket (None: prefilled on the decode worker). A dead
        decode worker is skipped; a decode worker that does not answer in time fails the
        attempt (TimeoutError)."""
        deadline = time.monotonic() + self.config.capacity_wait
        while True:
            route = self.router.route(work.token_ids)
            decode = self.decode[route.decode_id]
            try:
                if route.prefill_id is None:
                    await self._call(decode.add_local, work)
                    ticket = None
                else:
                    ticket = await self._call(decode.reserve, work, route.prefill_id)
            except RayActorError as err:
                self._note_failure(route.decode_id, err)
                continue
            if route.prefill_id is None or ticket is not None:
                self.router.placed(route, work.token_ids)
                return route, ticket
            if time.monotonic() > deadline:  # every decode worker stayed full
                raise EngineDeadError("no decode worker had room for the request in time")
            await asyncio.sleep(0.05)

    async def _end_attempt(self, request: TrackedRequest, work: WorkRequest) -> None:
        self._requests.pop(work.request_id, None)
        route = request.route
        if route is None:
            return
        self.router.finished(route)
        if request.finished:  # its worker already freed it (a stop string aborted it there)
            return
        for worker_id, pool in ((route.decode_id, self.decode), (route.prefill_id, self.prefill)):
            if worker_id is not None and self.router.is_alive(worker_id):
                with contextlib.suppress(Exception):
                    await self._call(pool[worker_id].abort, work.request_id, timeout=5.0)

    # -- decode workers --------------------------------------------------------------------

    async def _poll(self, decode_id: str) -> None:
        worker = self.decode[decode_id]
        failures = 0  # in a row; a worker that keeps failing its polls is as good as dead
        while self.router.is_alive(decode_id):
            try:
                updates = await self._call(worker.updates, POLL_SECONDS)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                failures += 1
                self._note_failure(decode_id, err, fatal=failures >= MAX_POLL_FAILURES)
                await asyncio.sleep(POLL_SECONDS)
                continue
            failures = 0
            for update in updates:
                self._dispatch(decode_id, update)

    def _dispatch(self, decode_id: str, update: WorkerUpdate) -> None:
        request = self._requests.get(update.request_id)
        if request is None:  # an attempt that already ended
            return
        if isinstance(update, RequestFailed):
            if update.retry:
                request.lose(update.reason)
            else:
                request.fail(RequestFailedError(update.reason))
            return
        if request.accept(update):  # a stop string ended it: stop the worker too
            worker = self.decode[decode_id]
            asyncio.create_task(self._call(worker.abort, update.request_id, timeout=5.0))

    def _note_failure(self, worker_id: str, err: Exception, fatal: bool = False) -> None:
        """A dead actor (or, with `fatal`, a failing one) leaves its pool for good; its
        requests are placed again."""
        dead = fatal or isinstance(err, RayActorError)
        if not dead or not self.router.is_alive(worker_id):
            return
        log.error("worker %s is out of service: %s", worker_id, _brief(err))
        self.router.mark_dead(worker_id)
        self._stats.pop(worker_id, None)
        for request in list(self._requests.values()):
            route = request.route
            if route is not None and worker_id in (route.decode_id, route.prefill_id):
                request.lose(f"worker {worker_id} died")

    # -- stats -----------------------------------------------------------------------------

    async def _refresh_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_SECONDS)
            await self._refresh_once()

    async def _refresh_once(self) -> None:
        workers = {**self.prefill, **self.decode}
        alive = [w for w in workers if self.router.is_alive(w)]
        results = await asyncio.gather(
            *(self._call(workers[w].stats) for w in alive), return_exceptions=True
        )
        for worker_id, result in zip(alive, results, strict=True):
            if isinstance(result, WorkerStats):
                self._stats[worker_id] = result
                self.router.observe(worker_id, result.num_free_blocks)
            elif isinstance(result, Exception):
                self._note_failure(worker_id, result)

    async def _call(self, method, *args: Any, timeout: float | None = None) -> Any:
        return await asyncio.wait_for(
            method.remote(*args), timeout=timeout or self.config.call_timeout
        )


def _brief(err: BaseException) -> str:
    """One line about an error (Ray's messages run to many lines)."""
    if isinstance(err, RayActorError):
        return "the worker died"
    if isinstance(err, TimeoutError):
        return "no answer in time"
    lines = str(err).strip().splitlines()
    return lines[-1] if lines else type(err).__name__
