"""AsyncEngine: an LLMEngine stepping in its own thread, streaming outputs to asyncio callers.

    caller (event loop)                     engine thread
    generate() --add--> commands queue --> add_request / abort
                                            step() -> SeqUpdates
    RequestState.apply  <--call_soon_threadsafe--+
    yield RequestOutput

Detokenization and stop strings run on the event loop, off the engine thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.engine import LLMEngine, RequestError
from engine.output_processor import RequestState
from engine.outputs import RequestOutput, SeqUpdate
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
IDLE_POLL_SECONDS = 0.05


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can make progress."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._streams: dict[str, tuple[RequestState, asyncio.Queue]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ids = itertools.count()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's output each time it has new tokens; the last one is finished.
        Leaving the iteration early (or being cancelled) aborts the request."""
        if self._thread is None:
            self.start()
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.engine.check_request(prompt_ids)
        stream: asyncio.Queue = asyncio.Queue()
        state = RequestState(request_id, prompt_ids, params, self.tokenizer)
        self._streams[request_id] = (state, stream)
        self._commands.put(_Add(request_id, prompt_ids, params))
        try:
            while True:
                item = await stream.get()
                if isinstance(item, RequestError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine stopped: {item}") from item
                yield item
                if item.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None and not state.finished:
                self._commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # -- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self.engine.has_unfinished)
                if self.engine.has_unfinished:
                    updates = self.engine.step()
                    if updates:
                        self._loop.call_soon_threadsafe(self._deliver, updates)
        except BaseException as err:  # surfaced to every waiting caller, never swallowed
            log.exception("engine thread failed")
            self._error = err
            self._loop.call_soon_threadsafe(self._fail_all, err)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_SECONDS) if block else None
            while True:
                if command is None:
                    command = self._commands.get_nowait()
                if isinstance(command, _Add):
                    self._add(command)
                else:
                    self.engine.abort(command.request_id)
                command = None
        except queue.Empty:
            return

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_ids, command.params)
        except RequestError as err:  # this request fails; the engine goes on
            self._loop.call_soon_threadsafe(self._fail_one, command.request_id, err)

    # -- event loop ----------------------------------------------------------------------------

    def _deliver(self, updates: list[SeqUpdate]) -> None:
        for update in updates:
            entry = self._streams.get(update.request_id)
            if entry is None:  # the caller left; its abort is on the way
                continue
            state, stream = entry
            output, stop_string_hit = state.apply(update)
            if stop_string_hit:
                self._commands.put(_Abort(update.request_id))
            stream.put_nowait(output)

    def _fail_one(self, request_id: str, err: BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            entry[1].put_nowait(err)

    def _fail_all(self, err: BaseException) -> None:
        for _, stream in self._streams.values():
            stream.put_nowait(err)
