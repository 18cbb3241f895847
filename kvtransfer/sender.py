"""KVSender: the prefill side of KV transfer. One thread sends queued frames in order.

The compute thread packs layer l of a step's chunks on a channel into one buffer of its own
(kvtransfer/legs.py) and queues it; this thread sends it while the compute thread runs layer
l+1. On CUDA it works on a stream of its own, ordered after the event recorded after the pack
(so nothing is sent before it is written) and after nothing else the compute thread queued
(kvtransfer/streams.py). Channels open lazily per ticket key.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvtransfer.integrity import DIGEST_START, fold, part_sums
from kvtransfer.streams import adopt, use_own_stream
from kvtransfer.transport import Channel, Pending, TransferError, Transport
from kvtransfer.wire import AbortFrame, DoneFrame, Frame, StepFrame, encode_frame
from protocol.kv import Ticket

log = logging.getLogger(__name__)
REMEMBERED_FAILURES = 10_000
WINDOW = 8  # sends in flight at once: the wire never waits for the next post


@dataclass
class SendRecord:
    """What one request's transfer did, for metrics and for the pipelining check."""

    bytes_sent: int = 0
    started: float | None = None  # monotonic time its first payload was posted
    finished: float | None = None
    layer_sends: list[tuple[int, float, float]] = field(default_factory=list)  # layer, start, end
    digest: int = DIGEST_START  # of the payloads posted so far (kvtransfer/integrity.py)
    channel_key: str = ""  # the leg it went on (a request has one per route from this rank)

    @property
    def seconds(self) -> float:
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started


class _OpenChannel(NamedTuple):
    """Opens the ticket's channel ahead of its first send."""

    ticket: Ticket

    @property
    def parts(self) -> list[tuple[Ticket, int]]:
        return [(self.ticket, 0)]


class _SendFrame(NamedTuple):
    ticket: Ticket  # its channel carries the frame
    frame: Frame

    @property
    def parts(self) -> list[tuple[Ticket, int]]:
        return [(self.ticket, 0)]


class _SendLayer(NamedTuple):
    parts: list[tuple[Ticket, int]]  # (ticket, tokens) per chunk, all on one channel, in order
    layer: int
    payload: torch.Tensor  # [2, tokens of all parts, kv_heads, head_dim]
    ready: torch.cuda.Event | None  # recorded after the pack on CUDA; None on CPU

    @property
    def ticket(self) -> Ticket:  # names the channel
        return self.parts[0][0]


class _Stop:
    """Tells the sender thread to retire what is in flight and exit."""


Job = _OpenChannel | _SendFrame | _SendLayer


SendCallback = Callable[[str, SendRecord, TransferError | None], None]


class KVSender:
    def __init__(self, transport: Transport, timeout: float, on_finished: SendCallback) -> None:
        """`on_finished(request_id, record, error)` runs on the sender thread once each of a
        request's done frames is sent (error None; one per leg, `record.channel_key` says
        which), or once if its transfer failed."""
        self.transport = transport
        self.timeout = timeout
        self.on_finished = on_finished
        self._jobs: queue.SimpleQueue[Job | _Stop] = queue.SimpleQueue()
        self._channels: dict[str, Channel] = {}
        self._dead_keys: set[str] = set()
        self._records: dict[tuple[str, str], SendRecord] = {}  # (request id, channel key)
        self._failed: OrderedDict[str, None] = OrderedDict()  # recent failures, bounded
        self._inflight: deque[tuple[Pending, _SendFrame | _SendLayer, float]] = deque()
        self._thread = threading.Thread(target=self._run, name="tandem-kv-sender", daemon=True)
        self._thread.start()

    def open(self, ticket: Ticket) -> None:
        """Starts opening the ticket's channel now, so the first layer does not wait for it."""
        self._jobs.put(_OpenChannel(ticket))

    def send_step(self, chunks: list[tuple[Ticket, int, int]], num_layers: int) -> None:
        """Announces a step's chunks (ticket, start, num_tokens), all on one channel; their
        payloads follow layer by layer through send_layer, in this order."""
        entries = [(ticket.request_id, start, n) for ticket, start, n in chunks]
        self._jobs.put(_SendFrame(chunks[0][0], StepFrame(entries, num_layers)))

    def send_layer(
        self, parts: list[tuple[Ticket, int]], layer: int, payload: torch.Tensor, ready=None
    ) -> None:
        """One layer of the step's chunks `parts` (ticket, tokens), in the order announced,
        back to back in `payload` (kvtransfer/legs.py)."""
        self._jobs.put(_SendLayer(parts, layer, payload, ready))

    def send_done(self, ticket: Ticket, token_id: int, logprobs) -> None:
        top = [list(pair) for pair in logprobs.top] if logprobs is not None else None
        logprob = logprobs.logprob if logprobs is not None else None
        self._jobs.put(_SendFrame(ticket, DoneFrame(ticket.request_id, token_id, logprob, top)))

    def send_abort(self, ticket: Ticket, reason: str) -> None:
        self._jobs.put(_SendFrame(ticket, AbortFrame(ticket.request_id, reason)))

    def close(self, timeout: float = 5.0) -> None:
        """Stops after the queued jobs; waits up to `timeout` s (the sends go on in the
        background after that: they read only their own packed buffers)."""
        self._jobs.put(_Stop())
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while not isinstance(job := self._jobs.get(), _Stop):
            self._handle(job)
            # Nothing else to post: retire sends oldest first, looking for new jobs after each,
            # so a job that arrives meanwhile is posted behind what is in flight, not after it.
            while self._inflight and self._jobs.empty():
                self._drain(len(self._inflight) - 1)
        self._drain(0)

    def _handle(self, job: Job) -> None:
        match job:
            case _SendFrame(ticket, DoneFrame() | AbortFrame() as last):
                if ticket.request_id in self._failed:
                    return  # its failure was reported already
                if isinstance(last, DoneFrame) and ticket.verify:
                    # Every payload of the request was posted before its done frame.
                    record = self._records.get(_leg(ticket), SendRecord())
                    job = _SendFrame(ticket, last._replace(digest=record.digest))
                if self._start(job):
                    self._drain(0)
                    self._complete(ticket, last)
            case _:
                self._start(job)

    def _start(self, job: Job) -> bool:
        """Opens the job's channel and posts what it sends; False if that failed (reported)."""
        try:
            channel = self._channel(job.ticket)
            if not isinstance(job, _OpenChannel):
                self._post(channel, job)
        except TransferError as err:
            self._fail_job(job, err)
            return False
        return True

    def _post(self, channel: Channel, job: _SendFrame | _SendLayer) -> None:
        """Posts the frame or payload without waiting, keeping at most WINDOW in flight."""
        records = [
            self._records.setdefault(_leg(ticket), SendRecord(channel_key=ticket.channel_key))
            for ticket, _ in job.parts
        ]
        start = time.monotonic()
        match job:
            case _SendFrame(frame=frame):
                tensors = encode_frame(frame)
            case _SendLayer(parts=parts, payload=payload, ready=ready):
                use_own_stream(payload.device)
                adopt(payload, ready)
                verified = any(ticket.verify for ticket, _ in parts)
                sums = part_sums(payload, [n for _, n in parts]) if verified else None
                for index, ((ticket, _), record) in enumerate(zip(parts, records, strict=True)):
                    record.started = record.started or start  # it starts with its first KV
                    if sums is not None and ticket.verify:
                        record.digest = fold(record.digest, sums[index])
                tensors = [payload]
        for tensor in tensors:
            self._inflight.append((channel.send_async(tensor), job, start))
        self._drain(WINDOW)

    def _drain(self, keep: int) -> None:
        while len(self._inflight) > keep:
            pending, job, start = self._inflight.popleft()
            key = job.ticket.channel_key
            if key in self._dead_keys:
                # Its channel broke on an earlier send (a peer killed mid-transfer): waiting here
                # would time out again, once per send in flight, and hold every other channel's
                # transfers behind this thread for that long.
                self._fail_quietly(job, TransferError(f"channel {key} broke earlier"))
                continue
            try:
                pending.wait(self.timeout)
            except TransferError as err:
                self._fail_job(job, err)
                continue
            if isinstance(job, _SendLayer):
                self._sent(job, start)

    def _sent(self, job: _SendLayer, start: float) -> None:
        end = time.monotonic()
        token_bytes = job.payload[:, :1].numel() * job.payload.element_size()
        for ticket, tokens in job.parts:
            record = self._records.get(_leg(ticket))
            if record is not None:
                record.bytes_sent += tokens * token_bytes
                record.layer_sends.append((job.layer, start, end))

    def _complete(self, ticket: Ticket, last: DoneFrame | AbortFrame) -> None:
        request_id = ticket.request_id
        record = self._records.pop(_leg(ticket), None)
        if record is None or request_id in self._failed:
            return
        record.finished = time.monotonic()
        error = TransferError(last.reason) if isinstance(last, AbortFrame) else None
        self.on_finished(request_id, record, error)

    def _fail_job(self, job: Job, err: TransferError) -> None:
        ids = ", ".join(ticket.request_id for ticket, _ in job.parts)
        log.warning("KV transfer of %s to %s failed: %s", ids, job.ticket.decode_id, err)
        self._drop_channel(job.ticket.channel_key)
        self._fail_quietly(job, err)

    def _fail_quietly(self, job: Job, err: TransferError) -> None:
        """Fails the job's requests unless they failed already. A step frame speaks for several
        requests: each fails on its own next job instead."""
        if isinstance(job, _SendFrame) and isinstance(job.frame, StepFrame):
            return
        for ticket, _ in job.parts:
            if ticket.request_id not in self._failed:
                self._fail(ticket.request_id, err)

    def _channel(self, ticket: Ticket) -> Channel:
        key = ticket.channel_key
        if key in self._dead_keys:
            raise TransferError(f"channel {key} broke earlier")
        if key not in self._channels:
            self._channels[key] = self.transport.connect(ticket.rendezvous, key, self.timeout)
        return self._channels[key]

    def _drop_channel(self, key: str) -> None:
        self._dead_keys.add(key)
        channel = self._channels.pop(key, None)
        if channel is not None:
            channel.close()

    def _fail(self, request_id: str, err: TransferError) -> None:
        legs = [leg for leg in self._records if leg[0] == request_id]
        record = SendRecord()
        for leg in legs:
            record = self._records.pop(leg)
        self._failed[request_id] = None
        if len(self._failed) > REMEMBERED_FAILURES:
            self._failed.popitem(last=False)
        self.on_finished(request_id, record, err)


def _leg(ticket: Ticket) -> tuple[str, str]:
    return ticket.request_id, ticket.channel_key
