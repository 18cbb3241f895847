"""Every KV transport keeps the Channel contract: ordered and byte-exact, deadlines that raise,
a dead peer that becomes an error (never a hang); and disaggregated workers over each of them
give colocated output and move exactly the uncached KV.

ucx runs twice: over shared memory (`ucx-shm`) and over TCP (`ucx-tcp`)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtransfer.transport import Rendezvous, TransferError
from kvtransfer.wire import DoneFrame, StepFrame, recv_frame, send_frame
from tests.support.dead_peers import (
    killed_receiver_fails_the_sender,
    killed_sender_fails_a_waiting_receiver,
)
from tests.support.transports import TRANSPORTS, close_transport, transport_named

OPEN_TIMEOUT = 20.0


@pytest.fixture(params=TRANSPORTS)
def channels(request) -> Iterator[tuple]:
    """(sending, receiving) channel; each side has its own transport, as two workers would."""
    sending, receiving = transport_named(request.param), transport_named(request.param)
    rendezvous, accepted = Rendezvous("127.0.0.1"), {}
    accept = in_thread(
        lambda: accepted.setdefault("rx", receiving.accept(rendezvous.store, "p0->d0#0", 20))
    )
    tx = sending.connect(rendezvous.endpoint, "p0->d0#0", OPEN_TIMEOUT)
    accept.join(OPEN_TIMEOUT)
    yield tx, accepted["rx"]
    for channel in (tx, accepted["rx"]):
        channel.close()
    for transport in (sending, receiving):
        close_transport(transport)


def in_thread(fn, *args) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def test_frames_and_payloads_arrive_in_order_and_byte_exact(channels) -> None:
    tx, rx = channels
    step = StepFrame([["r0", 0, 96], ["r1", 40, 8]], num_layers=2)  # msgpack gives lists back
    done = DoneFrame("r0", 17, -0.25, [[i, -float(i)] for i in range(40)])  # an extended frame
    payloads = [
        torch.randn(2, 96, 3, 64),
        torch.randn(2, 8, 3, 64).to(torch.bfloat16),
        torch.arange(1000, dtype=torch.int64),
        torch.randint(0, 255, (3 << 20,), dtype=torch.uint8),  # rendezvous-sized
    ]

    def send_all() -> None:
        send_frame(tx, step, 10)
        for payload in payloads:
            tx.send(payload, 10)
        send_frame(tx, done, 10)

    sender = in_thread(send_all)
    assert recv_frame(rx, 10) == step
    for payload in payloads:
        got = torch.empty_like(payload)
        rx.recv(got, 10)
        assert torch.equal(got, payload)
    assert recv_frame(rx, 10) == done
    sender.join(10)


def test_posted_receives_fill_in_posting_order(channels) -> None:
    tx, rx = channels
    sent = [torch.full((1 << (i % 12),), i, dtype=torch.int32) for i in range(24)]
    targets = [torch.empty_like(t) for t in sent]
    posted = [rx.recv_async(t) for t in targets]
    pending = [tx.send_async(t) for t in sent]
    for op in [*pending, *posted]:  # one thread: the receiving side progresses on its own
        op.wait(10)
    for got, want in zip(targets, sent, strict=True):
        assert torch.equal(got, want)


def test_receive_deadline_raises(channels) -> None:
    _, rx = channels
    start = time.monotonic()
    with pytest.raises(TransferError):
        rx.recv(torch.empty(16), timeout=0.3)
    assert time.monotonic() - start < 5


def test_send_deadline_raises_when_nobody_receives(channels) -> None:
    tx, _ = channels
    start = time.monotonic()
    with pytest.raises(TransferError):
        tx.send(torch.zeros(64 << 20, dtype=torch.uint8), timeout=0.5)
    assert time.monotonic() - start < 5


# Dead peers: the peer is a separate process, killed with SIGKILL (tests/support/dead_peers.py).


@pytest.mark.parametrize("name", TRANSPORTS)
def test_killed_sender_fails_a_waiting_receiver(name: str) -> None:
    killed_sender_fails_a_waiting_receiver(functools.partial(transport_named, name), "cpu", 64)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_killed_receiver_fails_the_sender(name: str) -> None:
    killed_receiver_fails_the_sender(functools.partial(transport_named, name), "cpu", 64)


def test_a_closed_channel_refuses_new_work_with_a_transfer_error(channels) -> None:
    tx, rx = channels
    tx.close()
    with pytest.raises(TransferError):  # (gloo and UCX raised AttributeError)
        tx.send_async(torch.zeros(4, dtype=torch.uint8))


@pytest.mark.parametrize("name", TRANSPORTS)
def test_connect_to_a_gone_worker_fails_at_once(name: str) -> None:
    """Its rendezvous store is closed (the worker was killed): the connect fails well inside its
    deadline (TCPStore alone retried the refusal for over twice the deadline)."""
    rendezvous = Rendezvous("127.0.0.1")
    endpoint = rendezvous.endpoint
    del rendezvous  # the store's server closes with it
    transport = transport_named(name)
    try:
        start = time.monotonic()
        with pytest.raises(TransferError, match="cannot reach the rendezvous"):
            transport.connect(endpoint, "gone#0", 5.0)
        assert time.monotonic() - start < 1.0
    finally:
        close_transport(transport)
