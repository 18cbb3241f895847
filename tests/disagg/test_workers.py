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


def test_a_reservation_is_held_as_long_as_the_coordinator_waits_for_its_prefill(
    tiny_llama,
) -> None:
    """The coordinator waits for a long prompt's prefill (its queue included) longer than the
    transfer timeout: the lease it asks for holds the seat that long, not the timeout's."""
    config = EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64)
    transport = make_transport("gloo", torch.device("cpu"))
    decode = DecodeWorker("d-long", LLMEngine(config), transport, transfer_timeout=0.5)
    try:
        request = WorkRequest("long", list(range(3, 40)), GREEDY)
        ticket = decode.reserve(request, "p-slow", lease_s=3.0).result(60)
        assert ticket is not None and ticket.timeout == 3.0
        assert decode.take_updates(timeout=1.5) == []  # past the transfer timeout: still held
        assert decode.engine.blocks.num_free_blocks == 64 - 10
        updates = decode.take_updates(timeout=2.5) or decode.take_updates(timeout=2.0)
        assert [(u.request_id, u.reason) for u in updates] == [
            ("long", "KV did not arrive within 3.0s")
        ]
        assert decode.engine.blocks.num_free_blocks == 64
    finally:
        decode.shutdown()


def test_a_paced_decode_worker_repaces_between_the_layers_of_a_step(tiny_llama) -> None:
    """Pacing (kernels/core_share.py) reaches a decode worker within a layer of a prefill worker
    starting beside it: besides once per turn, `pace(True)` runs after every layer of a step."""
    config = EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64)
    transport = make_transport("gloo", torch.device("cpu"))
    calls: list[bool] = []
    decode = DecodeWorker(
        "d-paced", LLMEngine(config), transport, transfer_timeout=5, pace=calls.append
    )
    try:
        decode.add_local(WorkRequest("local", list(range(3, 20)), GREEDY)).result(60)
        updates, deadline = [], time.monotonic() + 60
        while not any(getattr(u, "finish_reason", None) for u in updates):
            assert time.monotonic() < deadline, "the request never finished"
            updates += decode.take_updates(timeout=0.5)
    finally:
        decode.shutdown()
    steps = decode.engine.step_log.since(0)[1]
    layers = decode.engine.model_config.num_layers
    assert len(steps) == GREEDY.max_tokens  # one prefill step, then one decode step a token
    # one call a turn with work, one a layer of each step; False once idle and at the end
    assert calls.count(True) >= len(steps) * (layers + 1)
    assert calls[-1] is False
