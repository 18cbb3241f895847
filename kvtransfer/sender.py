"""KVSender: the prefill side of KV transfer. One thread sends queued frames in order.

The compute thread packs layer l of a request into its own buffer and queues it; this thread
sends it while the compute thread runs layer l+1 (on CUDA it first waits for the event recorded
after the pack, so nothing is sent before it is written). Channels open lazily per ticket key.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvtransfer.ticket import Ticket
from kvtransfer.transport import Channel, TransferError, Transport
from kvtransfer.wire import AbortFrame, DoneFrame, Frame, LayerFrame, send_frame

log = logging.getLogger(__name__)
REMEMBERED_FAILURES = 10_000


@dataclass
class SendRecord:
    """What one request's transfer did, for metrics and for the pipelining check."""

    bytes_sent: int = 0
    started: float | None = None  # monotonic time of its first send
    finished: float | None = None
    layer_sends: list[tuple[int, float, float]] = field(default_factory=list)  # layer, start, end

    @property
    def seconds(self) -> float:
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started


class _Job(NamedTuple):
    ticket: Ticket
    frame: Frame | None  # None: only open the channel
    payload: torch.Tensor | None
    ready: object | None  # torch.cuda.Event recorded after the payload was packed


SendCallback = Callable[[str, SendRecord, TransferError | None], None]


class KVSender:
    def __init__(self, transport: Transport, timeout: float, on_finished: SendCallback) -> None:
        """`on_finished(request_id, record, error)` runs on the sender thread once a request's
        done frame is sent (error None) or its transfer failed."""
        self.transport = transport
        self.timeout = timeout
        self.on_finished = on_finished
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._channels: dict[str, Channel] = {}
        self._dead_keys: set[str] = set()
        self._records: dict[str, SendRecord] = {}
        self._failed: OrderedDict[str, None] = OrderedDict()  # recent failures, bounded
        self._thread = threading.Thread(target=self._run, name="tandem-kv-sender", daemon=True)
        self._thread.start()

    def open(self, ticket: Ticket) -> None:
        """Starts opening the ticket's channel now, so the first layer does not wait for it."""
        self._jobs.put(_Job(ticket, None, None, None))

    def send_layer(
        self, ticket: Ticket, layer: int, start: int, payload: torch.Tensor, ready=None
    ) -> None:
        # payload: [2, num_tokens, kv_heads, head_dim]
        frame = LayerFrame(ticket.request_id, layer, start, payload.shape[1])
        self._jobs.put(_Job(ticket, frame, payload, ready))

    def send_done(self, ticket: Ticket, token_id: int, logprobs) -> None:
        top = [list(pair) for pair in logprobs.top] if logprobs is not None else None
        logprob = logprobs.logprob if logprobs is not None else None
        self._jobs.put(
            _Job(ticket, DoneFrame(ticket.request_id, token_id, logprob, top), None, None)
        )

    def send_abort(self, ticket: Ticket, reason: str) -> None:
        self._jobs.put(_Job(ticket, AbortFrame(ticket.request_id, reason), None, None))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            request_id = job.ticket.request_id
            if job.frame is not None and request_id in self._failed:
                continue  # its transfer already failed; later frames would only fail again
            try:
                self._send(job)
            except TransferError as err:
                log.warning(
                    "KV transfer of %s to %s failed: %s", request_id, job.ticket.decode_id, err
                )
                self._drop_channel(job.ticket.channel_key)
                if job.frame is not None:
                    self._fail(request_id, err)

    def _send(self, job: _Job) -> None:
        channel = self._channel(job.ticket)
        if job.frame is None:
            return
        record = self._records.setdefault(job.ticket.request_id, SendRecord())
        start = time.monotonic()
        record.started = record.started or start
        if job.ready is not None:
            job.ready.synchronize()
        send_frame(channel, job.frame, self.timeout)
        if job.payload is not None:
            channel.send(job.payload, self.timeout)
            record.bytes_sent += job.payload.numel() * job.payload.element_size()
            record.layer_sends.append((job.frame.layer, start, time.monotonic()))
        if isinstance(job.frame, DoneFrame | AbortFrame):
            record.finished = time.monotonic()
            del self._records[job.ticket.request_id]
            error = None if isinstance(job.frame, DoneFrame) else TransferError(job.frame.reason)
            self.on_finished(job.ticket.request_id, record, error)

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
        record = self._records.pop(request_id, SendRecord())
        self._failed[request_id] = None
        if len(self._failed) > REMEMBERED_FAILURES:
            self._failed.popitem(last=False)
        self.on_finished(request_id, record, err)
