"""The ipc transport between two processes, on CPU (a shared-memory file) and on one GPU (CUDA
IPC; the `gpu` runs): byte-exact in order through a ring smaller than the messages, read in
place or copied out, a killed peer is a clear error on either side, and a thousand transfers
leave no GPU memory behind on either side."""

from __future__ import annotations

import functools
import hashlib
import multiprocessing as mp

import pytest
import torch

from kvtransfer.ipc import IpcTransport
from kvtransfer.transport import Rendezvous
from tests.support.dead_peers import (
    killed_receiver_fails_the_sender,
    killed_sender_fails_a_waiting_receiver,
)

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


def exchange(device: str, repeat: int) -> tuple[tuple, tuple]:
    """`repeat` rounds of SIZES from this process to a spawned receiver: (digests, memory) of
    each side (`_send_rounds`, `_receiver`)."""
    spawn = mp.get_context("spawn")
    endpoints, results = spawn.Queue(), spawn.Queue()
    peer = spawn.Process(target=_receiver, args=(device, endpoints, results, len(SIZES), repeat))
    peer.start()
    try:
        tx = transport(device).connect(endpoints.get(timeout=60), "ipc#0", 60)
        sent = _send_rounds(tx, repeat, len(SIZES), device)
        received = results.get(timeout=120)
        tx.close()
    finally:
        peer.join(30)
        peer.kill()
    return sent, received


@pytest.mark.parametrize("device", DEVICES)
def test_messages_cross_processes_byte_exact_in_order(device: str) -> None:
    (sent, _), (received, _) = exchange(device, 1)
    assert received == sent


@pytest.mark.parametrize("device", [p for p in DEVICES if p.id == "cuda"])
def test_a_thousand_transfers_leave_no_gpu_memory_behind(device: str) -> None:
    """1,000 layer-sized payloads (a ragged several-piece one per round, 250 rounds of 4)."""
    (_, sender_memory), (_, receiver_memory) = exchange(device, 250)
    assert sender_memory[-1] == sender_memory[0]
    assert receiver_memory[-1] == receiver_memory[0]


def small_ring(device: str) -> IpcTransport:
    """`transport`, picklable for a spawned peer."""
    return transport(device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_killed_sender_fails_the_waiting_receiver(device: str) -> None:
    """Messages through the ring (test_transports.py sends small ones, on the socket)."""
    make = functools.partial(small_ring, device)
    killed_sender_fails_a_waiting_receiver(make, device, 3 << 20)


@pytest.mark.parametrize("device", DEVICES)
def test_a_killed_receiver_fails_the_sender(device: str) -> None:
    killed_receiver_fails_the_sender(functools.partial(small_ring, device), device, 3 << 20)
