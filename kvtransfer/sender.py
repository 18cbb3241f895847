"""KVSender: the prefill side of KV transfer. Each channel has a lane (kvtransfer/lane.py): a
thread of its own that opens the channel and sends its queued frames in order.

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

The sender keeps the books its lanes report to, under one lock: each request leg's SendRecord,
the requests that failed (each reported once, whichever lane saw it), and the keys retired.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from kvtransfer.lane import Job, Lane, OpenChannel, SendFrame, SendLayer, SendRecord, Stop
from kvtransfer.recent import RecentKeys
from kvtransfer.transport import TransferError, Transport
from kvtransfer.wire import AbortFrame, DoneFrame, StepFrame
from protocol.kv import Ticket, base_key, key_generation

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
        self._lanes: dict[str, Lane] = {}  # channel key -> its lane
        self._closed = False
        self._broken = RecentKeys()  # keys whose lane has exited
        self._records: dict[tuple[str, str], SendRecord] = {}  # (request id, channel key)
        self._failed = RecentKeys()  # requests that failed

    def open(self, ticket: Ticket) -> None:
        """Starts opening the ticket's channel now, so the first layer does not wait for it."""
        self._put(OpenChannel(ticket))

    def send_step(self, chunks: list[tuple[Ticket, int, int]], num_layers: int) -> None:
        """Announces a step's chunks (ticket, start, num_tokens), all on one channel; their
        payloads follow layer by layer through send_layer, in this order."""
        entries = [(ticket.request_id, start, n) for ticket, start, n in chunks]
        self._put(SendFrame(chunks[0][0], StepFrame(entries, num_layers)))

    def send_layer(
        self, parts: list[tuple[Ticket, int]], layer: int, payload: torch.Tensor, ready=None
    ) -> None:
        """One layer of the step's chunks `parts` (ticket, tokens), in the order announced,
        back to back in `payload` (kvtransfer/legs.py)."""
        self._put(SendLayer(parts, layer, payload, ready))

    def send_done(self, ticket: Ticket, token_id: int, logprobs) -> None:
        top = [list(pair) for pair in logprobs.top] if logprobs is not None else None
        logprob = logprobs.logprob if logprobs is not None else None
        self._put(SendFrame(ticket, DoneFrame(ticket.request_id, token_id, logprob, top)))

    def send_abort(self, ticket: Ticket, reason: str) -> None:
        self._put(SendFrame(ticket, AbortFrame(ticket.request_id, reason)))

    @property
    def legs_in_flight(self) -> int:
        """Legs that have sent something and not their done or abort frame yet."""
        with self._lock:
            return len(self._records)

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
                self._take_out(lane, Stop(f"decode worker {decode_id} left its pool"))

    def close(self, timeout: float = 5.0) -> None:
        """Stops every lane after its queued jobs; waits up to `timeout` s in all (the sends go
        on in the background after that: they read only their own packed buffers)."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.jobs.put(Stop("the prefill worker stopped sending"))
        deadline = time.monotonic() + timeout
        for lane in lanes:
            lane.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # -- the books, for the lanes (kvtransfer/lane.py's Ledger) and any thread ------------

    def _put(self, job: Job) -> None:
        key = job.ticket.channel_key
        with self._lock:
            if self._closed:
                return  # as if queued behind the stop: never sent
            lane = self._lanes.get(key)
            if lane is None and key not in self._broken:
                lane = self._new_lane(key, job.ticket.decode_id)
            if lane is not None:
                lane.jobs.put(job)
        if lane is None:
            self.refuse(job, TransferError(f"channel {key} broke or was replaced earlier"))

    def _new_lane(self, key: str, decode_id: str) -> Lane | None:  # under the lock
        """A decode worker's receiver gives a prefill worker one live channel key at a time (a
        new one once the old broke on either side), so lanes to it under an older key of that
        receiver are done with: they close, or one whose channel broke on the decode side would
        idle for good. Tickets need not reach us in the order the keys were given, though: a
        key older than a lane's is one the receiver gave up already, and gets no lane (None:
        its jobs fail, and the retry is given the live key)."""
        base, mine = base_key(key), key_generation(key)
        others = [x for x in self._lanes.values()
                  if x.decode_id == decode_id and base_key(x.key) != base]  # fmt: skip
        older = []
        for other in others:
            theirs = key_generation(other.key)
            if mine is None or theirs is None:
                older.append(other)  # no order to go by: the newest to come is taken as live
            elif theirs[0] == mine[0]:
                if theirs[1] > mine[1]:
                    self._broken.add(key)
                    return None
                older.append(other)
        for old in older:
            self._take_out(old, Stop(f"channel {base} replaced it"))
        lane = self._lanes[key] = Lane(self, key, decode_id)
        return lane

    def retire(self, lane: Lane) -> bool:
        """Takes a broken lane out of service if nothing is queued on it (True: it may exit);
        later jobs for its key fail at once."""
        with self._lock:
            if not lane.jobs.empty():
                return False
            self._take_out(lane)
            return True

    def _take_out(self, lane: Lane, stop: Stop | None = None) -> None:  # under the lock
        """Later jobs for the lane's key fail at once; `stop` tells the lane to finish up."""
        del self._lanes[lane.key]
        if stop is not None:
            lane.jobs.put(stop)
        self._broken.add(lane.key)

    def refuse(self, job: Job, err: TransferError) -> None:
        """A job on a broken channel: its requests fail, unless they failed already. A step
        frame speaks for several requests: each fails on its own next job instead."""
        if isinstance(job, SendFrame) and isinstance(job.frame, StepFrame):
            return
        for ticket, _ in job.parts:
            self._fail(ticket.request_id, err)

    def record(self, ticket: Ticket) -> SendRecord:
        """The leg's record, new at its first send; a failed request's is a throwaway (kept,
        it would never be popped)."""
        with self._lock:
            if ticket.request_id in self._failed:
                return SendRecord(channel_key=ticket.channel_key)
            return self._records.setdefault(
                _leg(ticket), SendRecord(channel_key=ticket.channel_key)
            )

    def has_failed(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._failed

    def complete(self, ticket: Ticket, last: DoneFrame | AbortFrame) -> None:
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
            self._failed.add(request_id)
        self.on_finished(request_id, record, err)


def _leg(ticket: Ticket) -> tuple[str, str]:
    return ticket.request_id, ticket.channel_key
