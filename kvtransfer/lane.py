"""A lane: the thread that drives one KV channel on the prefill side (KVSender keeps one per
channel, kvtransfer/sender.py).

It dials the channel at its first job, posts its jobs in order with up to WINDOW sends in
flight, and waits for each, oldest first, within the deadline. What the jobs did goes to the
sender's books (`Ledger`): bytes and layer times per request leg, digests, completions and
failures. A send that fails breaks the channel for good: the lane fails every job in flight or
queued on it, and the sender takes it out of service. A lane told to stop sends what is queued,
says goodbye with the reason (`CloseFrame`, so that the receiver ends without taking it for a
crash), closes the channel and exits.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from kvtransfer.integrity import DIGEST_START, fold, part_sums
from kvtransfer.streams import adopt, use_own_stream
from kvtransfer.transport import Channel, Pending, TransferError, Transport, connect_within
from kvtransfer.wire import AbortFrame, CloseFrame, DoneFrame, Frame, encode_frame
from protocol.kv import Ticket

log = logging.getLogger(__name__)
WINDOW = 8  # sends in flight at once on a channel: the wire never waits for the next post
GOODBYE_WAIT_S = 2.0  # for a closing channel's last frame


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


class OpenChannel(NamedTuple):
    """Opens the ticket's channel ahead of its first send."""

    ticket: Ticket

    @property
    def parts(self) -> list[tuple[Ticket, int]]:
        return [(self.ticket, 0)]


class SendFrame(NamedTuple):
    ticket: Ticket  # its channel carries the frame
    frame: Frame

    @property
    def parts(self) -> list[tuple[Ticket, int]]:
        return [(self.ticket, 0)]


class SendLayer(NamedTuple):
    parts: list[tuple[Ticket, int]]  # (ticket, tokens) per chunk, all on one channel, in order
    layer: int
    payload: torch.Tensor  # [2, tokens of all parts, kv_heads, head_dim]
    ready: torch.cuda.Event | None  # recorded after the pack on CUDA; None on CPU

    @property
    def ticket(self) -> Ticket:  # names the channel
        return self.parts[0][0]


class Stop(NamedTuple):
    """Tells a lane to retire what is in flight, close its channel (saying why) and exit."""

    reason: str


Job = OpenChannel | SendFrame | SendLayer


class Ledger(Protocol):
    """What a lane reports to: the sender's books, shared by all its lanes (thread-safe)."""

    transport: Transport
    timeout: float  # every dial and send

    def record(self, ticket: Ticket) -> SendRecord: ...

    def has_failed(self, request_id: str) -> bool: ...

    def complete(self, ticket: Ticket, last: DoneFrame | AbortFrame) -> None: ...

    def refuse(self, job: Job, err: TransferError) -> None:
        """The job's requests fail (a step frame's each on its own next job)."""

    def retire(self, lane: Lane) -> bool:
        """Takes the broken lane out of service unless a job is queued on it (True: exit)."""


class Lane:
    """One channel's thread: opens the channel, posts its jobs in order with up to WINDOW sends
    in flight, and waits for each (oldest first) within the ledger's deadline."""

    def __init__(self, ledger: Ledger, key: str, decode_id: str) -> None:
        self.ledger = ledger
        self.key = key
        self.decode_id = decode_id
        self.jobs: queue.SimpleQueue[Job | Stop] = queue.SimpleQueue()
        self.channel: Channel | None = None
        self.broken: TransferError | None = None
        self._inflight: deque[tuple[Pending, SendFrame | SendLayer, float]] = deque()
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{key}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        stop = None
        while stop is None:
            if self.broken is not None and self.jobs.empty() and self.ledger.retire(self):
                break
            match job := self.jobs.get():
                case Stop():
                    stop = job
                case _:
                    self._handle(job)
            # Nothing else to post: retire sends oldest first, looking for new jobs after each,
            # so a job that arrives meanwhile is posted behind what is in flight, not after it.
            while self._inflight and self.jobs.empty():
                self._drain(len(self._inflight) - 1)
        self._drain(0)
        if self.channel is not None and self.broken is None:
            if stop is not None:  # the receiver then ends without taking it for a failure
                self._say_goodbye(stop.reason)
            self.channel.close()

    def _say_goodbye(self, reason: str) -> None:
        with contextlib.suppress(TransferError):  # the peer is gone already
            for tensor in encode_frame(CloseFrame(reason)):
                self.channel.send(tensor, min(self.ledger.timeout, GOODBYE_WAIT_S))

    def _handle(self, job: Job) -> None:
        ledger = self.ledger
        if self.broken is not None:
            ledger.refuse(job, self.broken)
            return
        match job:
            case SendFrame(ticket, DoneFrame() | AbortFrame() as last):
                if ledger.has_failed(ticket.request_id):
                    return  # its failure was reported already
                if isinstance(last, DoneFrame) and ticket.verify:
                    # Every payload of the request was posted before its done frame.
                    job = SendFrame(ticket, last._replace(digest=ledger.record(ticket).digest))
                if self._start(job):
                    self._drain(0)
                    ledger.complete(ticket, last)
            case _:
                self._start(job)

    def _start(self, job: Job) -> bool:
        """Opens the channel and posts what the job sends; False if that failed (reported)."""
        try:
            if self.channel is None:
                ticket = job.ticket
                self.channel = connect_within(
                    self.ledger.transport, ticket.rendezvous, self.key, self.ledger.timeout
                )
            if not isinstance(job, OpenChannel):
                self._post(job)
        except Exception as err:  # noqa: BLE001  (a CUDA or wire error too: see _unexpected)
            self._break(job, _unexpected(err))
            return False
        return True

    def _post(self, job: SendFrame | SendLayer) -> None:
        """Posts the frame or payload without waiting, keeping at most WINDOW in flight."""
        records = [self.ledger.record(ticket) for ticket, _ in job.parts]
        start = time.monotonic()
        match job:
            case SendFrame(frame=frame):
                tensors = encode_frame(frame)
            case SendLayer(parts=parts, payload=payload, ready=ready):
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
            self._inflight.append((self.channel.send_async(tensor), job, start))
        self._drain(WINDOW)

    def _drain(self, keep: int) -> None:
        while len(self._inflight) > keep:
            pending, job, start = self._inflight.popleft()
            if self.broken is not None:
                # The channel broke on an earlier send (a peer killed mid-transfer): waiting here
                # would time out again, once per send in flight.
                self.ledger.refuse(job, self.broken)
                continue
            try:
                pending.wait(self.ledger.timeout)
            except Exception as err:  # noqa: BLE001  (see _unexpected)
                self._break(job, _unexpected(err))
                continue
            if isinstance(job, SendLayer):
                self._sent(job, start)

    def _sent(self, job: SendLayer, start: float) -> None:
        end = time.monotonic()
        token_bytes = job.payload[:, :1].numel() * job.payload.element_size()
        for ticket, tokens in job.parts:
            record = self.ledger.record(ticket)
            record.bytes_sent += tokens * token_bytes
            record.layer_sends.append((job.layer, start, end))

    def _break(self, job: Job, err: TransferError) -> None:
        """The channel is broken for good: the job's requests fail, and so does every job
        still in flight or queued on it."""
        ids = ", ".join(ticket.request_id for ticket, _ in job.parts)
        log.warning("KV transfer of %s to %s failed: %s", ids, job.ticket.decode_id, err)
        self.broken = TransferError(f"channel {self.key} broke earlier")
        if self.channel is not None:
            self.channel.close()
        self.ledger.refuse(job, err)


def _unexpected(err: Exception) -> TransferError:
    """An error a send raised, as a TransferError. Anything else (a CUDA error staging a payload,
    a UCX error from its progress thread) breaks the channel the same way: had it ended the
    lane's thread instead, nothing would read its queue, and every request on the channel would
    wait for the coordinator's prefill deadline while the queue held their payloads."""
    if isinstance(err, TransferError):
        return err
    log.error("KV lane: unexpected %r; the channel is given up", err)
    return TransferError(f"unexpected {type(err).__name__}: {err}")
