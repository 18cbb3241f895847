"""A follower rank's part in its worker's role: the KV heads this rank holds, sent to the decode
ranks that hold them (prefill) or received from the prefill ranks that send them (decode).

Rank 0 (prefill/worker.py, decode/worker.py) drives it through the rank group's connection
(engine/tensor_parallel.py):

    call ["prefill", transport, timeout]               start sending: a KVSender of this rank's
    call ["decode", transport, rendezvous, id, timeout] start receiving, on rank 0's rendezvous
    call ["expect", ticket, slots]                     a reservation: expect this rank's legs
    call ["forget", [request ids]]                     stop writing those requests' KV
    call ["forget_peer", decode id]                    that decode worker left: close its lanes
    call ["abort", ticket, reason]                     prefill: the request ended mid-prefill:
                                                       abort frames on this rank's legs
    call ["legs_in_flight"]                            prefill: this rank's legs not ended yet
    call ["idle"]                                      the role ended
    step extra = [[ticket, start, slots, last], ...]   prefill: send this rank's legs of the
                                                       step's chunks, layer by layer
    event ["arrived", id, bytes, seconds, routes] / ["failed", id, reason, corrupt] /
          ["broken", pair key]                         decode: this rank's transfers
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine.tensor_parallel import FollowerSpec, spawn_followers
from kvtransfer.lane import SendRecord
from kvtransfer.legs import StepChunk, announce, pack_layer, ready_event
from kvtransfer.receiver import Arrived, KVReceiver, Leg, ReceiveEvent
from kvtransfer.sender import KVSender
from kvtransfer.transport import Rendezvous, TransferError, make_transport
from protocol.kv import Endpoint, Ticket

log = logging.getLogger(__name__)


class RankRoles:
    """engine.tensor_parallel.FollowerHooks for a prefill or decode worker's follower rank."""

    def __init__(self, runner: Any, spec: FollowerSpec, emit: Callable[[object], None]) -> None:
        self.runner = runner
        self.rank = spec.rank
        self.emit = emit
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        # prefill: requests whose legs this rank has started and not yet ended (done frames go
        # with their last chunk; an abort comes from rank 0)
        self._sending: set[str] = set()

    def call(self, request: list) -> object:
        kind, *args = request
        if kind == "prefill":
            self._idle()
            transport, timeout = args
            self.sender = KVSender(self._transport(transport), timeout, self._sent)
        elif kind == "decode":
            self._idle()
            transport, rendezvous, decode_id, timeout = args
            self.receiver = KVReceiver(
                self._transport(transport),
                Rendezvous(rendezvous[0], joining=Endpoint(*rendezvous)),
                self.runner.kv_caches,
                decode_id,
                self._received,
                timeout,
                on_broken=lambda base: self.emit(["broken", base]),
            )
        elif kind == "expect":
            self._expect(Ticket.from_wire(args[0]), args[1])
        elif kind == "forget":
            for request_id in args[0]:
                self._receiving().forget(request_id)
        elif kind == "forget_peer":
            if self.sender is not None:
                self.sender.forget_peer(args[0])
        elif kind == "abort":
            self._abort(Ticket.from_wire(args[0]), args[1])
        elif kind == "legs_in_flight":
            return 0 if self.sender is None else self.sender.legs_in_flight
        elif kind == "idle":
            self._idle()
        else:
            raise ValueError(f"unknown rank call {kind!r}")
        return None

    def step(self, extra: object, forward: Callable) -> None:
        if self.sender is None:
            forward(None)
            return
        entries = [(Ticket.from_wire(t), start, slots, last) for t, start, slots, last in extra]
        # (an entry without slots sends nothing, only ends its legs below)
        chunks = [StepChunk(ticket, start, slots) for ticket, start, slots, _ in entries if slots]
        shard, sender = self.runner.shard, self.sender
        legs = announce(
            sender,
            chunks,
            self.rank,
            shard.kv_head_start,
            len(self.runner.kv_caches),
            self.runner.device,
        )

        def send_layer(layer: int) -> None:
            key_cache, value_cache = self.runner.kv_caches[layer]
            for channel_step, payload in pack_layer(legs, key_cache, value_cache):
                sender.send_layer(channel_step.parts, layer, payload, ready_event(payload))

        forward(send_layer if legs else None)
        for ticket, _, _, last in entries:
            if last:  # its prefill ended: rank 0 sends the token, this rank its legs' digests
                self._sending.discard(ticket.request_id)
                for leg, _ in ticket.legs(self.rank):
                    sender.send_done(leg, -1, None)
            else:
                self._sending.add(ticket.request_id)

    def _abort(self, ticket: Ticket, reason: str) -> None:
        """Rank 0 ended the request between two of its chunks: this rank's legs end too (their
        send records would otherwise stay until the role ends)."""
        if self.sender is None or ticket.request_id not in self._sending:
            return
        self._sending.discard(ticket.request_id)
        for leg, _ in ticket.legs(self.rank):
            self.sender.send_abort(leg, reason)

    def _expect(self, ticket: Ticket, slots: list[int]) -> None:
        start = self.runner.shard.kv_head_start
        legs = [
            Leg(key, range(route.head_start - start, route.head_stop - start), route)
            for key, route in ticket.legs_into(self.rank)
        ]
        self._receiving().expect(
            ticket.request_id,
            ticket.channel_key,
            slots,
            ticket.num_cached_tokens,
            ticket.verify,
            legs,
        )

    def _receiving(self) -> KVReceiver:
        if self.receiver is None:
            raise RuntimeError("this rank is not receiving KV (no decode role)")
        return self.receiver

    def _idle(self) -> None:
        self._sending.clear()
        if self.sender is not None:
            self.sender.close(timeout=0.1)
            self.sender = None
        if self.receiver is not None:
            self.receiver.forget_all()  # late bytes are read and dropped
            self.receiver = None

    def _transport(self, name: str):
        return make_transport(name, self.runner.device)

    def _sent(self, request_id: str, record: SendRecord, error: TransferError | None) -> None:
        if error is not None:  # the decode side fails the transfer (broken channel, lease)
            log.warning("rank %d: KV of %s not sent: %s", self.rank, request_id, error)

    def _received(self, event: ReceiveEvent) -> None:
        if isinstance(event, Arrived):
            body = ["arrived", event.request_id, event.bytes_received, event.seconds]
            self.emit([*body, event.route_bytes])
        else:
            self.emit(["failed", event.request_id, event.reason, event.corrupt])


def spawn_with_roles(spec: FollowerSpec) -> object:
    """A Launcher for local follower processes that take part in KV transfer."""
    return spawn_followers(spec._replace(hooks=RankRoles))
