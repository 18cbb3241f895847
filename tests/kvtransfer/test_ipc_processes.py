"""The ipc transport between two processes, on CPU (a shared-memory file) and on one GPU (CUDA
IPC; the `gpu` runs): byte-exact in order through a ring smaller than the messages, read in
place or copied out, a killed peer is a clear error on either side, and a thousand transfers
leave no GPU memory behind on either side."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
import time

import pytest
import torch

from kvtransfer.ipc import IpcTransport
from kvtransfer.transport import Rendezvous, TransferError

CUDA_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA_ONLY)]
SLOTS, SLOT_BYTES = 2, 1 << 20  # small, so most messages go through it in several pieces
DEAD_PEER_LIMIT = 10.0
# Bytes per message: inline (<= 64 KiB), just past it, several pieces with a ragged last one.
SIZES = [100, (64 << 10) + 1, (3 << 20) + 7, 2 * 96 * 8 * 128 * 2]


def transport(device: str) -> IpcTransport:
    return IpcTransport(torch.device(device), slots=SLOTS, slot_bytes=SLOT_BYTES)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def payload(nbytes: int, seed: int, device: str) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=generator)


def _receiver(device: str, endpoints, results, count: int, repeat: int) -> None:
    """Accepts one channel, receives `repeat` rounds of SIZES (and a host frame after each):
    those that fit a slot read in place (lent), the others copied out; reports each message's
    digest, and its GPU memory after the first and last round."""
    rendezvous = Rendezvous("127.0.0.1")
    endpoints.put(rendezvous.endpoint)
    rx = transport(device).accept(rendezvous.store, "ipc#0", 60)
    digests, memory = [], []
    for round_ in range(repeat):
        for nbytes in SIZES[:count]:
            lent = rx.recv_lent_async((nbytes,), torch.uint8)
            if lent is not None:
                lent.wait(30)
                got = lent.tensor.clone()
                lent.release()
            else:
                got = torch.empty(nbytes, dtype=torch.uint8, device=device)
                rx.recv(got, 30)
            if round_ == 0:
                digests.append(digest(got))
        frame = torch.empty(64, dtype=torch.uint8)  # the frames are host tensors
        rx.recv(frame, 30)
        if round_ == 0:
            digests.append(digest(frame))
        if round_ in (0, repeat - 1):
            memory.append(gpu_memory(device))
    rx.close()
    results.put((digests, memory))


def gpu_memory(device: str) -> int:
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _send_rounds(tx, repeat: int, count: int, device: str) -> tuple[list[str], list[int]]:
    sent = [payload(n, seed, device) for seed, n in enumerate(SIZES[:count])]
    frame = torch.arange(64, dtype=torch.uint8)
    memory = []
    for round_ in range(repeat):
        pending = [tx.send_async(t) for t in sent]
        pending.append(tx.send_async(frame))
        for op in pending:
            op.wait(30)
        if round_ in (0, repeat - 1):
            memory.append(gpu_memory(device))
    return [*(digest(t) for t in sent), digest(frame)], memory


@pytest.mark.parametrize("device", DEVICES)
def test_messages_cross_processes_byte_exact_in_order(device: str) -> None:
    spawn = mp.get_context("spawn")
    endpoints, results = spawn.Queue(), spawn.Queue()
    peer = spawn.Process(target=_receiver, args=(device, endpoints, results, len(SIZES), 1))
    peer.start()
    try:
        tx = transport(device).connect(endpoints.get(timeout=60), "ipc#0", 60)
        sent, _ = _send_rounds(tx, 1, len(SIZES), device)
        received, _ = results.get(timeout=60)
        assert received == sent
        tx.close()
    finally:
        peer.join(30)
        peer.kill()


@pytest.mark.parametrize("device", [p for p in DEVICES if p.id == "cuda"])
def test_a_thousand_transfers_leave_no_gpu_memory_behind(device: str) -> None:
    """1,000 layer-sized payloads (a ragged several-piece one per round, 250 rounds of 4)."""
    spawn = mp.get_context("spawn")
    endpoints, results = spawn.Queue(), spawn.Queue()
    peer = spawn.Process(target=_receiver, args=(device, endpoints, results, len(SIZES), 250))
    peer.start()
    try:
        tx = transport(device).connect(endpoints.get(timeout=60), "ipc#0", 60)
        _, sender_memory = _send_rounds(tx, 250, len(SIZES), device)
        _, receiver_memory = results.get(timeout=120)
        tx.close()
    finally:
        peer.join(30)
        peer.kill()
    assert sender_memory[-1] == sender_memory[0]
    assert receiver_memory[-1] == receiver_memory[0]


def _sending_peer(device: str, endpoint, ready) -> None:
    tx = transport(device).connect(endpoint, "dead#0", 60)
    tx.send(payload(3 << 20, 0, device), 30)
    ready.set()
    time.sleep(600)  # until killed


def _receiving_peer(device: str, endpoints, ready) -> None:
    rendezvous = Rendezvous("127.0.0.1")
    endpoints.put(rendezvous.endpoint)
    rx = transport(device).accept(rendezvous.store, "dead#0", 60)
    rx.recv(torch.empty(3 << 20, dtype=torch.uint8, device=device), 30)
    ready.set()
    time.sleep(600)


@pytest.mark.parametrize("device", DEVICES)
def test_a_killed_sender_fails_the_waiting_receiver(device: str) -> None:
    spawn = mp.get_context("spawn")
    rendezvous, ready = Rendezvous("127.0.0.1"), spawn.Event()
    peer = spawn.Process(target=_sending_peer, args=(device, rendezvous.endpoint, ready))
    peer.start()
    try:
        rx = transport(device).accept(rendezvous.store, "dead#0", 60)
        first = torch.empty(3 << 20, dtype=torch.uint8, device=device)
        rx.recv(first, 30)
        assert digest(first) == digest(payload(3 << 20, 0, device))
        assert ready.wait(30)
        outcome = {}

        def wait_for_more() -> None:
            try:
                rx.recv(torch.empty(3 << 20, dtype=torch.uint8, device=device), None)
            except TransferError as err:
                outcome["error"] = err

        waiting = threading.Thread(target=wait_for_more, daemon=True)
        waiting.start()
        time.sleep(0.2)  # blocked with no deadline when the peer dies
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


@pytest.mark.parametrize("device", DEVICES)
def test_a_killed_receiver_fails_the_sender(device: str) -> None:
    spawn = mp.get_context("spawn")
    endpoints, ready = spawn.Queue(), spawn.Event()
    peer = spawn.Process(target=_receiving_peer, args=(device, endpoints, ready))
    peer.start()
    try:
        tx = transport(device).connect(endpoints.get(timeout=60), "dead#0", 60)
        tx.send(payload(3 << 20, 0, device), 30)
        assert ready.wait(30)
        peer.kill()
        peer.join(10)
        killed = time.monotonic()
        big = payload(16 << 20, 1, device)
        with pytest.raises(TransferError):
            for _ in range(100):
                tx.send(big, 30)
        assert time.monotonic() - killed < DEAD_PEER_LIMIT
        tx.close()
    finally:
        peer.kill()
        peer.join(10)
