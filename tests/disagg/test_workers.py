"""A decode worker's reservation is a lease. (Greedy parity, bytes moved and broken links run
per transport in tests/kvtransfer/test_workers_per_transport.py.)"""

from __future__ import annotations

import time

import torch

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine import LLMEngine
from kvtransfer.transport import make_transport
from protocol.messages import WorkRequest
from protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_unclaimed_reservation_expires_and_frees_its_blocks(tiny_llama) -> None:
    config = EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64)
    transport = make_transport("gloo", torch.device("cpu"))
    decode = DecodeWorker("d-lease", LLMEngine(config), transport, transfer_timeout=0.5)
    try:
        request = WorkRequest("orphan", list(range(3, 40)), GREEDY)
        ticket = decode.reserve(request, "p-never").result(60)
        assert ticket is not None
        assert decode.engine.blocks.num_free_blocks == 64 - 10
        updates = []
        deadline = time.monotonic() + 10
        while not updates:
            assert time.monotonic() < deadline, "the lease never expired"
            updates = decode.take_updates(timeout=0.5)
        # The lease expires, or (as quickly) the channel no prefill worker opened gives up.
        assert updates[0].request_id == "orphan"
        assert "did not arrive" in updates[0].reason or "broke" in updates[0].reason
        assert decode.engine.blocks.num_free_blocks == 64
    finally:
        decode.shutdown()
