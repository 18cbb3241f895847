"""KVSender: the prefill side of KV transfer. Each channel has a lane: a thread of its own that
opens the channel and sends its queued frames in order.

The compute thread packs layer l of a step's chunks on a channel into one buffer of its own
(kvtransfer/legs.py) and queues it on that channel's lane; the lane sends it while the compute
thread runs layer l+1. On CUDA a lane works on a stream of its own, ordered after the event
recorded after the pack (so nothing is sent before it is written) and after nothing else the
compute thread queued (kvtransfer/streams.py).

Lanes keep channels apart: a peer that is slow, dead or still connecting holds up only its own
channel. (With one thread for every channel, a connect to a decode worker killed a moment before
held every other decode worker's transfers for the connect's whole deadline, and their requests
expired one lease after another.) A lane whose channel broke fails what is queued on it and
exits; anything sent on that key later fails at once. So does a lane to a decode worker that
left its pool (`forget_peer`), after sending what was queued.
"""

from __future__ import annotations

import contextlib
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
from kvtransfer.transport import Channel, Pending, TransferError, Transport, connect_within
from kvtransfer.wire import AbortFrame, CloseFrame, DoneFrame, Frame, StepFrame, encode_frame
from protocol.kv import Ticket, base_key

log = logging.getLogger(__name__)
REMEMBERED = 10_000  # failed requests and broken channel keys, the most recent
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


class _Stop(NamedTuple):
    """Tells a lane to retire what is in flight, close its channel (saying why) and exit."""

    reason: str


Job = _OpenChannel | _SendFrame | _SendLayer


SendCallback = Callable[[str, SendRecord, TransferError | None], None]


class KVSender:
    def __init__(self, transport: Transport, timeout: float, on_finished: SendCallback) -> None:
        """`on_finished(request_id, record, error)` runs on a lane's thread once each of a
        request's done frames is sent (error None; one per leg, `record.channel_key` says
        which), or once if its transfer failed (on the calling thread if its channel had
        broken before)."""
        self.transport = transport
        self.timeout = timeout
        self.on_finished = on_finished
        self._lock = threading.Lock()  # the lanes, the records and the failures
        self._lanes: dict[str, _Lane] = {}  # channel key -> its lane
        self._closed = False
        self._broken: OrderedDict[str, None] = OrderedDict()  # keys whose lane has exited
        self._records: dict[tuple[str, str], SendRecord] = {}  # (request id, channel key)
        self._failed: OrderedDict[str, None] = OrderedDict()  # recent failures, bounded

    def open(self, ticket: Ticket) -> None:
        """Starts opening the ticket's channel now, so the first layer does not wait for it."""
        self._put(_OpenChannel(ticket))

    def send_step(self, chunks: list[tuple[Ticket, int, int]], num_layers: int) -> None:
        """Announces a step's chunks (ticket, start, num_tokens), all on one channel; their
        payloads follow layer by layer through send_layer, in this order."""
        entries = [(ticket.request_id, start, n) for ticket, start, n in chunks]
        self._put(_SendFrame(chunks[0][0], StepFrame(entries, num_layers)))

    def send_layer(
        self, parts: list[tuple[Ticket, int]], layer: int, payload: torch.Tensor, ready=None
    ) -> None:
        """One layer of the step's chunks `parts` (ticket, tokens), in the order announced,
        back to back in `payload` (kvtransfer/legs.py)."""
        self._put(_SendLayer(parts, layer, payload, ready))

    def send_done(self, ticket: Ticket, token_id: int, logprobs) -> None:
        top = [list(pair) for pair in logprobs.top] if logprobs is not None else None
        logprob = logprobs.logprob if logprobs is not None else None
        self._put(_SendFrame(ticket, DoneFrame(ticket.request_id, token_id, logprob, top)))

    def send_abort(self, ticket: Ticket, reason: str) -> None:
        self._put(_SendFrame(ticket, AbortFrame(ticket.request_id, reason)))

    @property
    def open_lanes(self) -> int:
        with self._lock:
            return len(self._lanes)

    def forget_peer(self, decode_id: str) -> None:
        """A decode worker left its pool: its lanes send what is queued on them, close their
        channels and exit (each holds a thread and a channel); jobs for it from now on fail at
        once."""
        with self._lock:
            lanes = [lane for lane in self._lanes.values() if lane.decode_id == decode_id]
            for lane in lanes:
                del self._lanes[lane.key]
                self._remember_broken(lane.key)
                lane.jobs.put(_Stop(f"decode worker {decode_id} left its pool"))

    def close(self, timeout: float = 5.0) -> None:
        """Stops every lane after its queued jobs; waits up to `timeout` s in all (the sends go
        on in the background after that: they read only their own packed buffers)."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.jobs.put(_Stop("the prefill worker stopped sending"))
        deadline = time.monotonic() + timeout
        for lane in lanes:
            lane.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # -- any thread ------------------------------------------------------------------------

    def _put(self, job: Job) -> None:
        key = job.ticket.channel_key
        with self._lock:
            if self._closed:
                return  # as if queued behind the stop: never sent
            broke = key in self._broken
            if not broke:
                lane = self._lanes.get(key)
                if lane is None:
                    lane = self._lanes[key] = self._new_lane(key, job.ticket.decode_id)
                lane.jobs.put(job)
        if broke:
            self._refuse(job, TransferError(f"channel {key} broke earlier"))

    def _new_lane(self, key: str, decode_id: str) -> _Lane:  # under the lock
        """A decode worker gives a prefill worker one live channel key at a time (a new one
        once the old broke on either side), so lanes to it under another key are done with:
        they close, or one whose channel broke on the decode side would idle for good."""
        base = base_key(key)
        for old in [x for x in self._lanes.values() if x.decode_id == decode_id]:
            if base_key(old.key) != base:
                del self._lanes[old.key]
                self._remember_broken(old.key)
                old.jobs.put(_Stop(f"channel {base} replaced it"))
        return _Lane(self, key, decode_id)

    def _retire(self, lane: _Lane) -> bool:
        """Takes a broken lane out of service if nothing is queued on it (True: it may exit);
        later jobs for its key fail at once."""
        with self._lock:
            if not lane.jobs.empty():
                return False
            del self._lanes[lane.key]
            self._remember_broken(lane.key)
            return True

    def _remember_broken(self, key: str) -> None:  # under the lock
        self._broken[key] = None
        if len(self._broken) > REMEMBERED:
            self._broken.popitem(last=False)

    def _refuse(self, job: Job, err: TransferError) -> None:
        """A job on a broken channel: its requests fail, unless they failed already. A step
        frame speaks for several requests: each fails on its own next job instead."""
        if isinstance(job, _SendFrame) and isinstance(job.frame, StepFrame):
            return
        for ticket, _ in job.parts:
            self._fail(ticket.request_id, err)

    def _record(self, ticket: Ticket) -> SendRecord:
        """The leg's record, new at its first send; a failed request's is a throwaway (kept,
        it would never be popped)."""
        with self._lock:
            if ticket.request_id in self._failed:
                return SendRecord(channel_key=ticket.channel_key)
            return self._records.setdefault(
                _leg(ticket), SendRecord(channel_key=ticket.channel_key)
            )

    def _has_failed(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._failed

    def _complete(self, ticket: Ticket, last: DoneFrame | AbortFrame) -> None:
        request_id = ticket.request_id
        with self._lock:
            record = self._records.pop(_leg(ticket), None)
            if record is None or request_id in self._failed:
                return
        record.finished = time.monotonic()
        error = TransferError(last.reason) if isinstance(last, AbortFrame) else None
        self.on_finished(request_id, record, error)

    def _fail(self, request_id: str, err: TransferError) -> None:
        """Reports the request failed, once: its legs on every channel are dropped."""
        with self._lock:
            if request_id in self._failed:
                return
            legs = [leg for leg in self._records if leg[0] == request_id]
            record = SendRecord()
            for leg in legs:
                record = self._records.pop(leg)
            self._failed[request_id] = None
            if len(self._failed) > REMEMBERED:
                self._failed.popitem(last=False)
        self.on_finished(request_id, record, err)


class _Lane:
    """One channel's thread: opens the channel, posts its jobs in order with up to WINDOW sends
    in flight, and waits for each (oldest first) within the sender's deadline."""

    def __init__(self, sender: KVSender, key: str, decode_id: str) -> None:
        self.sender = sender
        self.key = key
        self.decode_id = decode_id
        self.jobs: queue.SimpleQueue[Job | _Stop] = queue.SimpleQueue()
        self.channel: Channel | None = None
        self.broken: TransferError | None = None
        self._inflight: deque[tuple[Pending, _SendFrame | _SendLayer, float]] = deque()
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{key}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        stop = None
        while stop is None:
            if self.broken is not None and self.jobs.empty() and self.sender._retire(self):
                break
            match job := self.jobs.get():
                case _Stop():
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
                self.channel.send(tensor, min(self.sender.timeout, GOODBYE_WAIT_S))

    def _handle(self, job: Job) -> None:
        sender = self.sender
        if self.broken is not None:
            sender._refuse(job, self.broken)
            return
        match job:
            case _SendFrame(ticket, DoneFrame() | AbortFrame() as last):
                if sender._has_failed(ticket.request_id):
                    return  # its failure was reported already
                if isinstance(last, DoneFrame) and ticket.verify:
                    # Every payload of the request was posted before its done frame.
                    job = _SendFrame(ticket, last._replace(digest=sender._record(ticket).digest))
                if self._start(job):
                    self._drain(0)
                    sender._complete(ticket, last)
            case _:
                self._start(job)

    def _start(self, job: Job) -> bool:
        """Opens the channel and posts what the job sends; False if that failed (reported)."""
        try:
            if self.channel is None:
                ticket = job.ticket
                self.channel = connect_within(
                    self.sender.transport, ticket.rendezvous, self.key, self.sender.timeout
                )
            if not isinstance(job, _OpenChannel):
                self._post(job)
        except TransferError as err:
            self._break(job, err)
            return False
        return True

    def _post(self, job: _SendFrame | _SendLayer) -> None:
        """Posts the frame or payload without waiting, keeping at most WINDOW in flight."""
        records = [self.sender._record(ticket) for ticket, _ in job.parts]
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
            self._inflight.append((self.channel.send_async(tensor), job, start))
        self._drain(WINDOW)

    def _drain(self, keep: int) -> None:
        while len(self._inflight) > keep:
            pending, job, start = self._inflight.popleft()
            if self.broken is not None:
                # The channel broke on an earlier send (a peer killed mid-transfer): waiting here
                # would time out again, once per send in flight.
                self.sender._refuse(job, self.broken)
                continue
            try:
                pending.wait(self.sender.timeout)
            except TransferError as err:
                self._break(job, err)
                continue
            if isinstance(job, _SendLayer):
                self._sent(job, start)

    def _sent(self, job: _SendLayer, start: float) -> None:
        end = time.monotonic()
        token_bytes = job.payload[:, :1].numel() * job.payload.element_size()
        for ticket, tokens in job.parts:
            record = self.sender._record(ticket)
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
        self.sender._refuse(job, err)


def _leg(ticket: Ticket) -> tuple[str, str]:
    return ticket.request_id, ticket.channel_key
