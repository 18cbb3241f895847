"""Dead peers for the transport tests: the peer is a spawned process, killed with SIGKILL (no
goodbye on any socket), and the side left must turn that into a TransferError within
DEAD_PEER_LIMIT, whether it was waiting with no deadline (a receiver) or sends on (a sender).

`make` builds the transport in either process (picklable: a module-level function, or a
functools.partial of one); `nbytes` is the size of the one message that goes through first."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvtransfer.transport import Rendezvous, TransferError, Transport

DEAD_PEER_LIMIT = 10.0
OPEN_TIMEOUT = 60.0


def _message(nbytes: int, device: str) -> torch.Tensor:
    return torch.full((nbytes,), 7, dtype=torch.uint8, device=device)


def _sending_peer(make, device: str, nbytes: int, endpoint, ready) -> None:
    tx = make().connect(endpoint, "dead#0", OPEN_TIMEOUT)
    tx.send(_message(nbytes, device), 30)
    ready.set()
    time.sleep(600)  # until killed


def _receiving_peer(make, device: str, nbytes: int, endpoints, ready) -> None:
    rendezvous = Rendezvous("127.0.0.1")
    endpoints.put(rendezvous.endpoint)
    rx = make().accept(rendezvous.store, "dead#0", OPEN_TIMEOUT)
    rx.recv(torch.empty(nbytes, dtype=torch.uint8, device=device), 30)
    ready.set()
    time.sleep(600)


def killed_sender_fails_a_waiting_receiver(
    make: Callable[[], Transport], device: str, nbytes: int
) -> None:
    spawn = mp.get_context("spawn")
    rendezvous, ready = Rendezvous("127.0.0.1"), spawn.Event()
    peer = spawn.Process(
        target=_sending_peer, args=(make, device, nbytes, rendezvous.endpoint, ready)
    )
    peer.start()
    transport = make()
    try:
        rx = transport.accept(rendezvous.store, "dead#0", OPEN_TIMEOUT)
        first = torch.empty(nbytes, dtype=torch.uint8, device=device)
        rx.recv(first, 30)
        assert torch.equal(first, _message(nbytes, device))
        assert ready.wait(30)
        outcome: dict[str, Exception] = {}

        def wait_for_more() -> None:
            pending = rx.recv_async(torch.empty(nbytes, dtype=torch.uint8, device=device))
            try:
                pending.wait(None)
            except Exception as err:
                outcome["error"] = err
                outcome["pending"] = pending  # type: ignore[assignment]

        waiting = threading.Thread(target=wait_for_more, daemon=True)
        waiting.start()
        time.sleep(0.2)  # the receiver is blocked with no deadline when the peer dies
        peer.kill()
        killed = time.monotonic()
        waiting.join(DEAD_PEER_LIMIT)
        assert not waiting.is_alive(), "the receiver hangs on a dead peer"
        assert isinstance(outcome.get("error"), TransferError)
        assert time.monotonic() - killed < DEAD_PEER_LIMIT
        rx.close()
        if type(rx).__name__ == "ProcessGroupChannel" and device == "cpu":
            # gloo: the receive is over, nothing of it is held (it held the whole gloo context)
            assert outcome["pending"].finished  # type: ignore[attr-defined]
    finally:
        peer.kill()
        peer.join(10)
        _close(transport)


def killed_receiver_fails_the_sender(
    make: Callable[[], Transport], device: str, nbytes: int
) -> None:
    spawn = mp.get_context("spawn")
    endpoints, ready = spawn.Queue(), spawn.Event()
    peer = spawn.Process(target=_receiving_peer, args=(make, device, nbytes, endpoints, ready))
    peer.start()
    transport = make()
    try:
        tx = transport.connect(endpoints.get(timeout=OPEN_TIMEOUT), "dead#0", OPEN_TIMEOUT)
        tx.send(_message(nbytes, device), 30)
        assert ready.wait(30)
        peer.kill()
        peer.join(10)
        killed = time.monotonic()
        big = torch.zeros(16 << 20, dtype=torch.uint8, device=device)
        with pytest.raises(TransferError):
            for _ in range(100):  # whatever a socket buffer absorbs, a send fails soon
                tx.send(big, 30)
        assert time.monotonic() - killed < DEAD_PEER_LIMIT
        tx.close()
    finally:
        peer.kill()
        peer.join(10)
        _close(transport)


def _close(transport: Transport) -> None:
    """ucx transports own a UCX worker and a thread; the others own nothing."""
    if hasattr(transport, "close"):
        transport.close()
