"""PrefillWorker: computes prompts and streams their KV, layer by layer, to decode workers.

    submit(request, ticket) -> engine thread: chunked prefill under a token budget
        before a step: announce each request's chunk, per leg (kvtransfer/legs.py)
        after layer l of a step: pack each request's new K/V of layer l -> KVSender (own thread)
        after the last chunk: sample the next token -> done frames -> PrefillReport to the caller

    The request's blocks are freed as soon as its step ends (the packed buffers own the bytes);
    its full blocks stay in this worker's prefix cache.

Tensor parallel: this is rank 0. Each step's chunks also go to the follower ranks with the
batch; each sends the routes from its own rank (worker/rank_roles.py), and this rank only
those from rank 0. The report waits for this rank's legs; a follower's failed leg fails the
transfer on the decode side.

Threads: the engine thread owns the engine and every field below; a sender lane reports a
finished transfer by submitting `_transfer_finished` to the engine thread, never by touching
state itself. A plain class (no Ray); `worker.actor` wraps it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

from engine.block_manager import slots_of
from engine.engine import LLMEngine
from engine.engine_thread import EngineThread
from engine.scheduler import StepPlan
from engine.tensor_parallel import RemoteError
from kvtransfer.lane import SendRecord
from kvtransfer.legs import ChannelStep, StepChunk, announce, pack_layer, ready_event
from kvtransfer.sender import KVSender
from kvtransfer.transport import TransferError, Transport
from protocol.errors import RequestError
from protocol.kv import Ticket
from protocol.messages import PrefillResult, RequestFailed, WorkRequest
from protocol.sampling import PromptLogprob, TokenLogprobs
from protocol.stats import TransferCounters, WorkerStats

log = logging.getLogger(__name__)


class PrefillTrace(NamedTuple):
    """When each layer of one request was computed and sent (for the pipelining checks)."""

    transfer_seconds: float  # first layer sent to done frame sent
    exposed_seconds: float  # of that, what came after the prefill step ended (TTFT pays it)
    layers_computed: list[tuple[int, float]]  # (layer, monotonic time its KV was packed)
    layers_sent: list[tuple[int, float, float]]  # (layer, send start, send end)


class PrefillReport(NamedTuple):
    """What the in-process caller hears: the result for the coordinator, and the trace."""

    result: PrefillResult
    trace: PrefillTrace


ResultCallback = Callable[[str, PrefillReport | Exception], None]


class _Sampled(NamedTuple):
    token_id: int
    logprobs: TokenLogprobs | None
    num_cached_tokens: int  # prompt tokens found in this worker's prefix cache
    step_end: float  # monotonic time its step ended
    queue_seconds: float | None  # arrival until its KV blocks (its age on arrival included)
    prompt_logprobs: list[PromptLogprob | None] | None


class _Pending:
    def __init__(self, request: WorkRequest, ticket: Ticket, on_result: ResultCallback) -> None:
        self.request = request
        self.ticket = ticket
        self.legs = [leg for leg, _ in ticket.legs(0)]  # what this rank sends: route 0>0 first
        self.legs_left = len(self.legs)
        self.bytes_sent = 0
        self.record: SendRecord | None = None  # route 0>0's
        self.on_result = on_result
        self.layers_computed: list[tuple[int, float]] = []
        self.sent_upto = ticket.num_cached_tokens  # tokens before this are sent or not needed
        self.sampled: _Sampled | None = None


class PrefillWorker:
    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        transport: Transport,
        transfer_timeout: float,
        pipeline_layers: bool = True,
        num_threads: int | None = None,
        pace: Callable[[bool], None] | None = None,
    ) -> None:
        """Serves `engine` (idle, owned by no thread yet) until shutdown(), which leaves it
        idle again for another role. `pipeline_layers=False` holds every layer back until the
        step's forward pass ends (send after prefill): the baseline that
        benchmarks/kv_transfer.py compares against. `num_threads`: the engine thread's cores
        (default: the caller's torch thread count); `pace`: what may change them between
        steps (EngineThread)."""
        self.worker_id = worker_id
        self.pipeline_layers = pipeline_layers
        self.engine = engine
        self.layout = self.engine.kv_layout
        self.sender = KVSender(transport, transfer_timeout, self._on_sent)
        self.transfers = TransferCounters(transport.name)
        self._pending: dict[str, _Pending] = {}
        self._step_legs: list[ChannelStep] = []  # this step's sends from this rank, in order
        self._held: list[tuple] = []
        self.ranks = engine.runner.ranks  # the follower ranks, under tensor parallelism
        self._pace = pace  # a prompt's step is long: its cores are paced layer by layer too
        if self.ranks is not None:  # each sends its own routes
            self.ranks.call(["prefill", transport.name, transfer_timeout])
        self.thread = EngineThread(
            f"prefill-{worker_id}",
            self._step,
            lambda: self.engine.has_unfinished,
            self._crashed,
            num_threads=num_threads,
            pace=pace,
        )

    # -- any thread ------------------------------------------------------------------------

    def submit(self, request: WorkRequest, ticket: Ticket, on_result: ResultCallback) -> None:
        """Queues a prefill; `on_result(request_id, report or error)` runs exactly once, on a
        worker thread."""
        if ticket.layout != self.layout:
            on_result(request.request_id, ValueError(f"KV layout {ticket.layout} != {self.layout}"))
            return
        self.thread.submit(self._add, request, ticket, on_result).add_done_callback(
            lambda f: f.exception() and on_result(request.request_id, f.exception())
        )

    def abort(self, request_id: str) -> None:
        self.thread.submit(self._abort, request_id)

    def forget_peer(self, decode_id: str) -> Future:
        """A decode worker left its pool: the channels to it close (every rank's)."""
        return self.thread.submit(self._forget_peer, decode_id)

    def stats(self) -> Future:
        return self.thread.submit(self._stats)

    @property
    def bytes_sent(self) -> int:
        return self.transfers.bytes

    def shutdown(self) -> None:
        """Stops serving: every request still here fails, and the engine is left idle."""
        self.thread.stop()
        # Sends still queued belong to requests that fail here anyway: no waiting for them (a
        # role switch must not wait on a slow link).
        self.sender.close(timeout=0.1)
        self._crashed(RuntimeError("the worker stopped serving"))
        self.engine.abort_all()
        if self.ranks is not None:
            with contextlib.suppress(Exception):  # a dead rank ends the worker anyway
                self.ranks.call(["idle"])

    # -- engine thread ---------------------------------------------------------------------

    def _add(self, request: WorkRequest, ticket: Ticket, on_result: ResultCallback) -> None:
        if request.request_id in self._pending:  # (its step ended, its transfer has not)
            raise RequestError(f"request id {request.request_id!r} is already in use")
        # Stop after one new token: its decode worker generates the rest.
        num_out = len(request.output_ids)
        params = dataclasses.replace(
            request.params,
            max_tokens=num_out + 1,
            min_tokens=min(request.params.min_tokens, num_out + 1),
        )
        self.engine.add_request(
            request.request_id, request.prompt_ids, params, request.output_ids, request.age_s
        )
        pending = _Pending(request, ticket, on_result)
        self._pending[request.request_id] = pending
        for leg in pending.legs:
            self.sender.open(leg)

    def _abort(self, request_id: str, error: Exception | None = None) -> None:
        """Ends a request here and tells its decode worker; its caller hears `error`."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        error = error or TransferError("aborted by the coordinator")
        self.engine.abort(request_id)
        for leg in pending.legs:
            self.sender.send_abort(leg, str(error))
        if self.ranks is not None:  # the follower ranks' legs of a prefill cut between chunks
            try:
                self.ranks.call(["abort", pending.ticket, str(error)])
            except (RemoteError, TimeoutError, OSError) as err:  # a rank gone fails the worker
                log.warning("follower ranks not told of the abort of %s: %s", request_id, err)
        pending.on_result(request_id, error)

    def _forget_peer(self, decode_id: str) -> None:
        self.sender.forget_peer(decode_id)
        if self.ranks is not None:
            self.ranks.call(["forget_peer", decode_id])

    def _step(self) -> None:
        self._step_legs = []
        updates = self.engine.step(on_layer=self._send_layer, on_plan=self._announce_step)
        for held in self._held:
            self.sender.send_layer(*held)
        self._held.clear()
        for update in updates:
            pending = self._pending.get(update.request_id)
            if pending is None:
                continue
            if isinstance(update, RequestFailed):
                self._abort(update.request_id, update.error())
                continue
            token, logprobs = update.token_ids[0], update.logprobs[0]
            pending.sampled = _Sampled(
                token,
                logprobs,
                update.num_cached_tokens,
                time.monotonic(),
                update.queue_seconds,
                update.prompt_logprobs,
            )
            self.sender.send_done(pending.legs[0], token, logprobs)  # route 0>0: the token
            for leg in pending.legs[1:]:
                self.sender.send_done(leg, -1, None)

    def _send_layer(self, plan: StepPlan, layer: int) -> None:
        if self._pace is not None:  # a decode worker that went idle leaves us its cores now
            self._pace(True)
        key_cache, value_cache = self.engine.kv_caches[layer]
        now = time.monotonic()
        for channel_step, payload in pack_layer(self._step_legs, key_cache, value_cache):
            job = (channel_step.parts, layer, payload, ready_event(payload))
            if self.pipeline_layers:
                self.sender.send_layer(*job)
            else:
                self._held.append(job)
            for leg in channel_step.legs:
                pending = self._pending[leg.ticket.request_id]
                if leg.ticket.channel_key == pending.ticket.channel_key:  # once per request
                    pending.layers_computed.append((layer, now))

    def _announce_step(self, plan: StepPlan) -> list | None:
        """Picks the tokens each request sends this step (its chunk, plus earlier tokens found
        in this worker's prefix cache that its decode worker lacks) and announces this rank's
        legs of them. Returns what the follower ranks need to send theirs: per chunk its
        ticket, first token, slots, and whether its prefill ends this step."""
        bs = self.engine.config.block_size
        chunks: list[StepChunk] = []
        followers: list[list] = []
        for chunk in plan.chunks:
            pending = self._pending.get(chunk.seq.request_id)
            if pending is None:
                continue
            if pending.sent_upto >= chunk.end:  # its decode worker holds all of it already
                if chunk.samples:  # the follower ranks still end their legs (done frames)
                    followers.append([pending.ticket, chunk.end, [], True])
                continue
            start = pending.sent_upto
            slots = slots_of(chunk.seq.block_table, start, chunk.end, bs)
            chunks.append(StepChunk(pending.ticket, start, slots))
            followers.append([pending.ticket, start, slots, chunk.samples])
            pending.sent_upto = chunk.end
        self._step_legs = announce(
            self.sender, chunks, 0, 0, self.layout.num_layers, self.engine.runner.device
        )
        return followers if self.ranks is not None and followers else None

    def _stats(self) -> WorkerStats:
        return WorkerStats.of(
            self.worker_id,
            "prefill",
            self.engine.snapshot(),
            **self.transfers.fields(),
            **self.thread.steps.fields(),
            kv_channels_open=self.sender.open_lanes,
        )

    def _transfer_finished(
        self, request_id: str, record: SendRecord, error: TransferError | None
    ) -> None:
        if error is not None:
            if request_id in self._pending:  # not the echo of an abort sent from here
                self.transfers.failures += 1
                self._abort(request_id, error)
            return
        self.transfers.bytes += record.bytes_sent
        pending = self._pending.get(request_id)
        if pending is None or pending.sampled is None:
            return
        pending.bytes_sent += record.bytes_sent
        if record.channel_key == pending.ticket.channel_key:
            pending.record = record
            self.transfers.seconds.observe(record.seconds)
        pending.legs_left -= 1
        if pending.legs_left > 0:
            return  # this rank's other legs are still sending
        del self._pending[request_id]
        record, sampled = pending.record or record, pending.sampled
        result = PrefillResult(
            request_id, sampled.token_id, sampled.logprobs, sampled.num_cached_tokens,
            pending.bytes_sent, time.monotonic() - sampled.step_end, sampled.queue_seconds,
            sampled.prompt_logprobs,
        )  # fmt: skip
        exposed = max(0.0, record.finished - sampled.step_end)
        self.transfers.exposed.observe(exposed)
        trace = PrefillTrace(
            record.seconds,
            exposed,
            pending.layers_computed,
            record.layer_sends,
        )
        pending.on_result(request_id, PrefillReport(result, trace))

    def _crashed(self, err: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for request_id, entry in pending.items():
            entry.on_result(request_id, RuntimeError(f"prefill worker crashed: {err}"))

    # -- a sender lane (or the caller, on a channel broken earlier) ------------------------

    def _on_sent(self, request_id: str, record: SendRecord, error: TransferError | None) -> None:
        self.thread.submit(self._transfer_finished, request_id, record, error)
