"""AsyncEngine: an LLMEngine stepping in its EngineThread, streaming outputs to asyncio callers.

    caller (event loop)                          engine thread (owns the engine)
    generate() --submit(add_request)-->          add_request / abort between steps
                                                 step() -> TokenUpdates
    RequestState.apply  <--call_soon_threadsafe--+
    yield RequestOutput

Detokenization and stop strings run on the event loop, off the engine thread. `_streams` belongs
to the event loop; the engine belongs to its thread; they meet only through submit() and
call_soon_threadsafe().
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

from engine.engine import LLMEngine
from engine.engine_thread import EngineThread
from engine.output_processor import RequestState
from engine.outputs import RequestOutput, StreamFailed, read_stream
from engine.tokenizer import Tokenizer
from protocol.errors import EngineDeadError, RequestError
from protocol.messages import RequestFailed, WorkerUpdate
from protocol.sampling import SamplingError, SamplingParams
from protocol.stats import EngineHealth

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, tokenizer: Tokenizer, num_threads: int | None = None
    ) -> None:
        """`num_threads`: the engine thread's cores (default: the torch thread count of the
        thread that calls start())."""
        self.engine = engine
        self.num_threads = num_threads
        self.tokenizer = tokenizer
        self._streams: dict[str, tuple[RequestState, asyncio.Queue]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: EngineThread | None = None
        self._ids = itertools.count()

    def start(self) -> None:
        """Starts the engine thread; outputs are delivered to the calling event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = EngineThread(
            "tandem-engine",
            self._step,
            lambda: self.engine.has_unfinished,
            self._crashed,
            num_threads=self.num_threads,
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            try:
                self._thread.stop(timeout)
            except TimeoutError as err:  # the process is ending: close what can be closed
                log.warning("%s; closing the engine anyway", err)
        self.engine.close()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's output each time it has new tokens; the last one is finished.
        Leaving the iteration early (or being cancelled) aborts the request."""
        if self._thread is None:
            self.start()
        thread = self._thread
        if thread.error is not None:
            raise EngineDeadError(f"engine stopped: {thread.error}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.engine.check_request(prompt_ids, params)
        stream: asyncio.Queue[RequestOutput | StreamFailed] = asyncio.Queue()
        state = RequestState(request_id, prompt_ids, params, self.tokenizer)
        self._streams[request_id] = (state, stream)
        thread.submit(self._add, request_id, prompt_ids, params)
        try:
            async for output in read_stream(stream):
                yield output
        finally:
            if self._streams.pop(request_id, None) is not None and not state.finished:
                thread.submit(self.engine.abort, request_id)

    def step_fields(self) -> dict[str, object]:
        """WorkerStats fields for the engine thread's step timings."""
        return {} if self._thread is None else self._thread.steps.fields()

    def health(self) -> EngineHealth | None:
        """The engine thread's health; None before start()."""
        return None if self._thread is None else self._thread.health()

    def abort(self, request_id: str) -> None:
        if self._thread is not None:
            self._thread.submit(self.engine.abort, request_id)

    # -- engine thread -------------------------------------------------------------------------

    def _step(self) -> None:
        updates = self.engine.step()
        if updates:
            self._loop.call_soon_threadsafe(self._deliver, updates)

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except (RequestError, SamplingError) as err:  # this request fails; the engine goes on
            self._loop.call_soon_threadsafe(self._fail_one, request_id, err)

    def _crashed(self, err: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._fail_all, err)

    def recent_steps(self, worker_id: str | None = None, limit: int | None = None) -> dict:
        """This engine's latest step records (as many as its log keeps), as worker "engine"."""
        if worker_id not in (None, "engine"):
            return {}
        total, records, _ = self.engine.step_log.since(0)
        records = records[-limit:] if limit else records
        steps = [r._asdict() for r in records]
        return {"engine": {"steps_total": total, "steps_missed": 0, "steps": steps}}

    # -- event loop ----------------------------------------------------------------------------

    def _deliver(self, updates: list[WorkerUpdate]) -> None:
        for update in updates:
            entry = self._streams.get(update.request_id)
            if entry is None:  # the caller left; its abort is on the way
                continue
            state, stream = entry
            if isinstance(update, RequestFailed):  # the engine already dropped it
                stream.put_nowait(StreamFailed(update.error()))
                continue
            output, stop_string_hit = state.apply(update)
            if stop_string_hit:
                self.abort(update.request_id)
            stream.put_nowait(output)

    def _fail_one(self, request_id: str, err: Exception) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            entry[1].put_nowait(StreamFailed(err))

    def _fail_all(self, err: BaseException) -> None:
        failure = StreamFailed(EngineDeadError(f"engine stopped: {err}"))
        for _, stream in self._streams.values():
            stream.put_nowait(failure)
