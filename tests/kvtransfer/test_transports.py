"""Every KV transport keeps the Channel contract: ordered and byte-exact, deadlines that raise,
a dead peer that becomes an error (never a hang); and disaggregated workers over each of them
give colocated output and move exactly the uncached KV.

ucx runs twice: over shared memory (`ucx-shm`) and over TCP (`ucx-tcp`)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtransfer.transport import Rendezvous, TransferError
from kvtransfer.wire import DoneFrame, StepFrame, recv_frame, send_frame
from tests.support.transports import TRANSPORTS, close_transport, transport_named

OPEN_TIMEOUT = 20.0
DEAD_PEER_LIMIT = 10.0  # seconds within which a dead peer must become an error


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


# Dead peers: the peer is a separate process, killed with SIGKILL (no goodbye on any socket).


def _sending_peer(name: str, endpoint, ready) -> None:
    tx = transport_named(name).connect(endpoint, "dead#0", OPEN_TIMEOUT)
    tx.send(torch.arange(8, dtype=torch.int64), 10)
    ready.set()
    time.sleep(600)  # until killed


def _receiving_peer(name: str, endpoints, ready) -> None:
    rendezvous = Rendezvous("127.0.0.1")
    endpoints.put(rendezvous.endpoint)
    rx = transport_named(name).accept(rendezvous.store, "dead#0", OPEN_TIMEOUT)
    rx.recv(torch.empty(8, dtype=torch.int64), 10)
    ready.set()
    time.sleep(600)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_killed_sender_fails_a_waiting_receiver(name: str) -> None:
    spawn = mp.get_context("spawn")
    rendezvous = Rendezvous("127.0.0.1")
    ready = spawn.Event()
    peer = spawn.Process(target=_sending_peer, args=(name, rendezvous.endpoint, ready))
    peer.start()
    transport = transport_named(name)
    try:
        rx = transport.accept(rendezvous.store, "dead#0", 60)
        first = torch.empty(8, dtype=torch.int64)
        rx.recv(first, 30)
        assert first.tolist() == list(range(8))
        assert ready.wait(30)
        outcome = {}
        waiting = in_thread(lambda: _capture(outcome, rx.recv, torch.empty(8), None))
        time.sleep(0.2)  # the receiver is blocked with no deadline when the peer dies
        peer.kill()
        killed = time.monotonic()
        waiting.join(DEAD_PEER_LIMIT)
        assert not waiting.is_alive(), "the receiver hangs on a dead peer"
        assert isinstance(outcome.get("error"), TransferError)
        assert time.monotonic() - killed < DEAD_PEER_LIMIT
        rx.close()
    finally:
        peer.kill()
        peer.join(10)
        close_transport(transport)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_killed_receiver_fails_the_sender(name: str) -> None:
    spawn = mp.get_context("spawn")
    endpoints, ready = spawn.Queue(), spawn.Event()
    peer = spawn.Process(target=_receiving_peer, args=(name, endpoints, ready))
    peer.start()
    transport = transport_named(name)
    try:
        tx = transport.connect(endpoints.get(timeout=60), "dead#0", 60)
        tx.send(torch.arange(8, dtype=torch.int64), 30)
        assert ready.wait(30)
        peer.kill()
        peer.join(10)
        killed = time.monotonic()
        big = torch.zeros(16 << 20, dtype=torch.uint8)
        with pytest.raises(TransferError):
            for _ in range(100):  # whatever a socket buffer absorbs, a send fails soon
                tx.send(big, 30)
        assert time.monotonic() - killed < DEAD_PEER_LIMIT
        tx.close()
    finally:
        peer.kill()
        peer.join(10)
        close_transport(transport)


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


def _capture(outcome: dict, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as err:
        outcome["error"] = err


def test_gloo_listens_on_the_address_its_peer_reaches_it_at() -> None:
    """Between hosts a gloo group must listen on an address the peer can reach: the one this
    machine routes to the peer from (sender), the rendezvous' own (receiver). Left to itself it
    takes the hostname's address, a loopback one on many hosts."""
    from kvtransfer.torch_dist import _address_towards

    routable = _address_towards("10.255.255.254")
    if not routable or routable.startswith("127.") or ":" in routable:
        pytest.skip("this machine has no routable IPv4 address")
    rendezvous = Rendezvous(routable)
    transports = [transport_named("gloo") for _ in range(2)]
    opened: list = []
    accepting = threading.Thread(
        target=lambda: opened.append(transports[0].accept(rendezvous.client(), "ip#0", 30))
    )
    accepting.start()
    tx = transports[1].connect(rendezvous.endpoint, "ip#0", 30)
    accepting.join(30)
    rx = opened[0]
    try:
        got = torch.empty(4)
        pending = rx.recv_async(got)
        tx.send(torch.arange(4.0), 10)
        pending.wait(10)
        assert got.tolist() == [0.0, 1.0, 2.0, 3.0]
        # gloo's own pair (both ends in this process): a connection between routable
        # addresses that is not one of the store's.
        store = rendezvous.endpoint.port
        pairs = [
            (local, remote)
            for local, remote in _established_tcp()
            if store not in (local[1], remote[1])
        ]
        assert (routable, routable) in {(a[0], b[0]) for a, b in pairs}, pairs
    finally:
        tx.close()
        rx.close()


def _established_tcp() -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """This network namespace's established TCP connections, IPv4 (or IPv4-mapped)."""
    import ipaddress
    from pathlib import Path

    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "01":  # ESTABLISHED
                continue
            ends = []
            for end in fields[1:3]:
                address, port = end.split(":")
                raw = bytes.fromhex(address)
                # The kernel prints each 32-bit word in host (little-endian) order.
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(words)
                if ip.version == 6 and ip.ipv4_mapped is not None:
                    ip = ip.ipv4_mapped
                ends.append((str(ip), int(port, 16)))
            found.append((ends[0], ends[1]))
    return found
