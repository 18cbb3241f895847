"""Fencing: bytes of an attempt the decode side has given up on (expired, aborted, retried) never
land in KV blocks, even when they arrive after the retry's own KV, into the very same blocks.

An old attempt ("r#1", from prefill worker p0) sends its first layer, then is held back; the
decode side forgets it and reserves the same slots for the retry ("r#2", from p1), whose whole
transfer lands; only then does the old attempt send the rest. And the same when the retry went
to another decode worker and the first one gave the blocks to a new request. Real senders and
receivers over every transport, in one process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import NamedTuple

import pytest
import torch

from kvtransfer.receiver import Arrived, KVReceiver, ReceiveEvent, TransferFailed
from kvtransfer.sender import KVSender
from kvtransfer.transport import Rendezvous, TransferError
from kvtransfer.wire import StepFrame, send_frame
from protocol.kv import KVLayout, Ticket
from tests.support.transports import TRANSPORTS, close_transport, transport_named

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=4, dtype="float32")
NUM_TOKENS = 8
SLOTS = list(range(4, 4 + NUM_TOKENS))  # blocks 1 and 2 of 4-token blocks
TIMEOUT = 10.0


class Events:
    def __init__(self) -> None:
        self.items: list[ReceiveEvent] = []
        self.changed = threading.Condition()

    def add(self, event: ReceiveEvent) -> None:
        with self.changed:
            self.items.append(event)
            self.changed.notify_all()

    def wait_for(self, request_id: str) -> ReceiveEvent:
        deadline = time.monotonic() + TIMEOUT
        with self.changed:
            while True:
                found = [e for e in self.items if e.request_id == request_id]
                if found:
                    return found[0]
                assert self.changed.wait(deadline - time.monotonic()), f"no event for {request_id}"


def payload(value: float) -> torch.Tensor:
    return torch.full((2, NUM_TOKENS, LAYOUT.kv_heads, LAYOUT.head_dim), value)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_an_abandoned_attempt_never_writes_into_its_retrys_blocks(name: str) -> None:
    transports = [transport_named(name) for _ in range(3)]  # decode, p0, p1
    shape = (4, 4, LAYOUT.kv_heads, LAYOUT.head_dim)  # 4 blocks of 4 tokens
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYOUT.num_layers)]
    events = Events()
    rendezvous = Rendezvous("127.0.0.1")
    receiver = KVReceiver(transports[0], rendezvous, caches, "d0", events.add, TIMEOUT)
    finished: list[tuple[str, object]] = []
    senders = [
        KVSender(t, TIMEOUT, lambda r, record, err: finished.append((r, err)))
        for t in transports[1:]
    ]

    def ticket(request_id: str, prefill_id: str) -> Ticket:
        key = receiver.channel_key(prefill_id)
        return Ticket(request_id, "d0", rendezvous.endpoint, key, 0, NUM_TOKENS, LAYOUT, TIMEOUT)

    try:
        old, retry = ticket("r#1", "p0"), ticket("r#2", "p1")
        receiver.expect("r#1", old.channel_key, SLOTS, 0)
        old_sender, retry_sender = senders
        old_sender.open(old)  # both channels up before anything is sent
        retry_sender.open(retry)
        old_sender.send_step([(old, 0, NUM_TOKENS)], LAYOUT.num_layers)
        old_sender.send_layer([(old, NUM_TOKENS)], 0, payload(1.0))
        _wait_until(lambda: receiver.bytes_received == payload(1.0).numel() * 4)
        # The decode side gives up on r#1 (its lease expired) and reserves the same slots for
        # the retry, prefilled by another worker.
        receiver.forget("r#1")
        receiver.expect("r#2", retry.channel_key, SLOTS, 0)
        retry_sender.send_step([(retry, 0, NUM_TOKENS)], LAYOUT.num_layers)
        for layer in range(LAYOUT.num_layers):
            retry_sender.send_layer([(retry, NUM_TOKENS)], layer, payload(2.0 + layer))
        retry_sender.send_done(retry, 7, None)
        arrived = events.wait_for("r#2")
        assert isinstance(arrived, Arrived) and arrived.token_id == 7
        # Now the old attempt's remaining layer and done frame arrive.
        stale_before = receiver.stale_frames
        old_sender.send_layer([(old, NUM_TOKENS)], 1, payload(1.0))
        old_sender.send_done(old, 5, None)
        _wait_until(lambda: receiver.stale_frames == stale_before + 2)  # a payload, a frame
        for layer, (key_cache, value_cache) in enumerate(caches):
            for cache in (key_cache, value_cache):
                rows = cache.reshape(-1, LAYOUT.kv_heads, LAYOUT.head_dim)[SLOTS]
                assert torch.equal(rows, torch.full_like(rows, 2.0 + layer))
        assert [e.request_id for e in events.items] == ["r#2"]  # nothing about r#1
    finally:
        for sender in senders:
            sender.close()
        for transport in transports:
            close_transport(transport)


def _wait_until(condition) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Pair(NamedTuple):
    transports: list  # decode side's, prefill side's
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # the decode side's, per layer
    events: Events
    rendezvous: Rendezvous
    receiver: KVReceiver
    sender: KVSender


def _pair(name: str, num_blocks: int) -> Pair:
    """A decode worker "d0" (receiver, caches of `num_blocks` 4-token blocks) and one prefill
    worker's sender, each over its own transport `name`."""
    transports = [transport_named(name) for _ in range(2)]
    shape = (num_blocks, 4, LAYOUT.kv_heads, LAYOUT.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYOUT.num_layers)]
    events = Events()
    rendezvous = Rendezvous("127.0.0.1")
    receiver = KVReceiver(transports[0], rendezvous, caches, "d0", events.add, TIMEOUT)
    sender = KVSender(transports[1], TIMEOUT, lambda *report: None)
    return Pair(transports, caches, events, rendezvous, receiver, sender)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_an_attempt_given_up_by_one_decode_worker_never_writes_there_again(name: str) -> None:
    """The retry went to another decode worker; the first one reused the old attempt's blocks
    for a new request before the old attempt's last layer arrived."""
    transports = [transport_named(name) for _ in range(3)]  # d0, d1, p0
    shape = (4, 4, LAYOUT.kv_heads, LAYOUT.head_dim)
    caches = {d: [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYOUT.num_layers)]
              for d in ("d0", "d1")}  # fmt: skip
    events = {d: Events() for d in caches}
    rendezvous = {d: Rendezvous("127.0.0.1") for d in caches}
    receivers = {
        d: KVReceiver(t, rendezvous[d], caches[d], d, events[d].add, TIMEOUT)
        for d, t in zip(caches, transports[:2], strict=True)
    }
    sender = KVSender(transports[2], TIMEOUT, lambda *_: None)

    def ticket(request_id: str, decode_id: str) -> Ticket:
        key = receivers[decode_id].channel_key("p0")
        endpoint = rendezvous[decode_id].endpoint
        return Ticket(request_id, decode_id, endpoint, key, 0, NUM_TOKENS, LAYOUT, TIMEOUT)

    try:
        old, retry = ticket("r#1", "d0"), ticket("r#2", "d1")
        sender.open(old)  # (a channel's receiver starts with its first reservation)
        receivers["d0"].expect("r#1", old.channel_key, SLOTS, 0)
        sender.send_step([(old, 0, NUM_TOKENS)], LAYOUT.num_layers)
        sender.send_layer([(old, NUM_TOKENS)], 0, payload(1.0))
        _wait_until(lambda: receivers["d0"].bytes_received > 0)
        # d0 gives r#1 up and hands its blocks to a new request whose KV has not come yet.
        receivers["d0"].forget("r#1")
        receivers["d0"].expect("s#1", old.channel_key, SLOTS, 0)
        receivers["d1"].expect("r#2", retry.channel_key, SLOTS, 0)
        # (the old step's last layer is due first on the sender's one thread)
        sender.send_layer([(old, NUM_TOKENS)], 1, payload(1.0))
        sender.send_done(old, 5, None)
        sender.send_step([(retry, 0, NUM_TOKENS)], LAYOUT.num_layers)
        for layer in range(LAYOUT.num_layers):
            sender.send_layer([(retry, NUM_TOKENS)], layer, payload(2.0 + layer))
        sender.send_done(retry, 7, None)
        assert isinstance(events["d1"].wait_for("r#2"), Arrived)
        _wait_until(lambda: receivers["d0"].stale_frames == 2)  # r#1's last layer and done
        layer_1 = caches["d0"][1]  # the layer that arrived after r#1 was given up
        for cache in layer_1:
            rows = cache.reshape(-1, LAYOUT.kv_heads, LAYOUT.head_dim)[SLOTS]
            assert torch.equal(rows, torch.zeros_like(rows))  # s#1's blocks: untouched
        assert events["d0"].items == []  # nothing about r#1, nothing yet about s#1
    finally:
        sender.close()
        for transport in transports:
            close_transport(transport)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_forgotten_requests_part_of_a_shared_payload_is_dropped_and_the_rest_land(
    name: str,
) -> None:
    """One payload a layer carries a step's three requests back to back; the decode side forgot
    the middle one before they came. Each other part lands in its own request's slots (their
    digests fold from their own parts, so both arrive), the forgotten one's never does."""
    transports, caches, events, rendezvous, receiver, sender = _pair(name, num_blocks=8)
    key = receiver.channel_key("p0")
    sizes = {"a": 3, "b": 5, "c": 2}
    slots = {"a": [0, 1, 2], "b": [4, 5, 6, 7, 8], "c": [12, 13]}
    tickets = {
        r: Ticket(r, "d0", rendezvous.endpoint, key, 0, n, LAYOUT, TIMEOUT)
        for r, n in sizes.items()
    }
    try:
        for request_id, ticket in tickets.items():
            receiver.expect(request_id, ticket.channel_key, slots[request_id], 0)
        receiver.forget("b")  # aborted before its KV came
        sender.send_step([(t, 0, t.num_tokens) for t in tickets.values()], LAYOUT.num_layers)
        value = {"a": 1.0, "b": 2.0, "c": 3.0}
        for layer in range(LAYOUT.num_layers):
            parts = [
                torch.full((2, n, LAYOUT.kv_heads, LAYOUT.head_dim), value[r] + 10 * layer)
                for r, n in sizes.items()
            ]
            sender.send_layer(
                [(t, t.num_tokens) for t in tickets.values()], layer, torch.cat(parts, dim=1)
            )
        for token, ticket in enumerate(tickets.values()):
            sender.send_done(ticket, token, None)
        token_bytes = 2 * LAYOUT.kv_heads * LAYOUT.head_dim * 4
        for request_id in ("a", "c"):
            arrived = events.wait_for(request_id)
            assert isinstance(arrived, Arrived)
            assert arrived.bytes_received == LAYOUT.num_layers * sizes[request_id] * token_bytes
        _wait_until(lambda: receiver.stale_frames == LAYOUT.num_layers + 1)  # b's parts, done
        for layer, (key_cache, value_cache) in enumerate(caches):
            for cache in (key_cache, value_cache):
                rows = cache.reshape(-1, LAYOUT.kv_heads, LAYOUT.head_dim)
                for request_id in ("a", "c"):
                    got = rows[slots[request_id]]
                    assert torch.equal(got, torch.full_like(got, value[request_id] + 10 * layer))
                assert not rows[slots["b"]].any()
        assert sorted(e.request_id for e in events.items) == ["a", "c"]
    finally:
        sender.close()
        for transport in transports:
            close_transport(transport)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_channel_closed_on_purpose_ends_quietly_and_fails_what_it_still_owed(
    name: str, caplog
) -> None:
    """The prefill side forgets its decode worker (which left the pool): its lane says goodbye
    and closes. The receiver thread ends without a warning, a request still expected on the
    channel fails (nothing more can come for it), and the next reservation gets a new key."""
    transports, _, events, rendezvous, receiver, sender = _pair(name, num_blocks=4)
    key = receiver.channel_key("p0")
    owed = Ticket("r#1", "d0", rendezvous.endpoint, key, 0, NUM_TOKENS, LAYOUT, TIMEOUT)
    try:
        with caplog.at_level("INFO", logger="kvtransfer.receiver"):
            receiver.expect("r#1", key, SLOTS, 0)
            sender.open(owed)
            _wait_until(lambda: receiver.open_channels == 1)
            sender.forget_peer("d0")
            failed = events.wait_for("r#1")
            _wait_until(lambda: receiver.open_channels == 0)
        assert "closed: decode worker d0 left its pool" in failed.reason
        assert receiver.open_channels == 0 and sender.open_lanes == 0
        records = [r for r in caplog.records if r.name == "kvtransfer.receiver"]
        assert [r.levelname for r in records] == ["INFO"], [r.getMessage() for r in records]
        assert receiver.channel_key("p0") != key  # a new channel for the next reservation
    finally:
        sender.close()
        for transport in transports:
            close_transport(transport)


@pytest.mark.parametrize("name", [p for p in TRANSPORTS if p.id != "gloo"])
def test_receives_posted_on_a_broken_channel_are_let_go_once_cancelled(name: str) -> None:
    """A step whose second layer never comes breaks the channel with that receive (and the next
    frame's) still posted. Their buffers are held until the transport is done with them; UCX
    cancels them as the channel closes, so none stays held. (Not gloo: it says nothing of a
    receive whose wait timed out, so those stay held for good.)"""
    transports = [transport_named(name) for _ in range(2)]
    shape = (4, 4, LAYOUT.kv_heads, LAYOUT.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYOUT.num_layers)]
    events = Events()
    rendezvous = Rendezvous("127.0.0.1")
    receiver = KVReceiver(transports[0], rendezvous, caches, "d0", events.add, timeout=1.0)
    channel = None
    try:
        key = receiver.channel_key("p0")
        receiver.expect("r#1", key, SLOTS, 0)
        channel = transports[1].connect(rendezvous.endpoint, key, TIMEOUT)
        send_frame(channel, StepFrame([("r#1", 0, NUM_TOKENS)], LAYOUT.num_layers), TIMEOUT)
        channel.send(payload(1.0), TIMEOUT)  # layer 0; layer 1 never comes
        failed = events.wait_for("r#1")
        assert isinstance(failed, TransferFailed)
        _wait_until(lambda: receiver.open_channels == 0)
        # The peer is still there and sends on (which also progresses its side of the close;
        # ipc's sender may already find the connection closed): nothing of it lands, and
        # nothing stays held.
        with contextlib.suppress(TransferError):
            channel.send(payload(3.0), TIMEOUT)
        _wait_until(lambda: receiver.held_after_break == 0)
        assert receiver.bytes_received == payload(1.0).numel() * 4
    finally:
        if channel is not None:
            channel.close()
        for transport in transports:
            close_transport(transport)


def test_a_reservation_under_a_key_just_given_up_fails_at_once() -> None:
    """The decode worker takes a channel key, then expects a request under it; the channel may
    break in between. The request fails there and then: no receiver starts on the dead key to
    wait out its accept for a prefill worker that will never dial it."""
    transport = transport_named("gloo")
    shape = (4, 4, LAYOUT.kv_heads, LAYOUT.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYOUT.num_layers)]
    events = Events()
    receiver = KVReceiver(transport, Rendezvous("127.0.0.1"), caches, "d0", events.add, TIMEOUT)
    try:
        key = receiver.channel_key("p0")
        receiver.retire(key, "its channel broke")
        receiver.expect("r#1", key, SLOTS, 0)
        failed = events.wait_for("r#1")
        assert isinstance(failed, TransferFailed) and "given up" in failed.reason
        assert receiver.open_channels == 0
        assert receiver.channel_key("p0") != key  # the next reservation gets a new one
    finally:
        close_transport(transport)
