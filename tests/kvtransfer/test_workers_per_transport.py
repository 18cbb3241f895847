"""Prefill and decode workers (one process, no Ray) over every KV transport: greedy output equals
colocated, the bytes moved are exactly the uncached KV, and a link that breaks mid-transfer fails
the request and frees its blocks on both sides."""

from __future__ import annotations

import time

import pytest
import torch

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from kvtransfer.transport import TransferError
from prefill.worker import PrefillReport, PrefillWorker
from protocol.messages import RequestFailed, WorkerUpdate, WorkRequest
from protocol.sampling import SamplingParams
from tests.support.prompts import mixed_prompts
from tests.support.transports import TRANSPORTS, close_transport, transport_named

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TIMEOUT = 60.0


def engine_config(checkpoint, **options) -> EngineConfig:
    options = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 128, **options}
    return EngineConfig(checkpoint, **options)


@pytest.fixture(scope="module", params=TRANSPORTS)
def workers(request, tiny_llama):
    """Each worker has its own transport, as it would in its own process."""
    name = request.param
    transports = [transport_named(name), transport_named(name)]
    prefill_config = engine_config(tiny_llama, max_num_batched_tokens=32)
    prefill = PrefillWorker(f"p-{name}", LLMEngine(prefill_config), transports[0], 20)
    decode = DecodeWorker(f"d-{name}", LLMEngine(engine_config(tiny_llama)), transports[1], 20)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()
    for transport in transports:
        close_transport(transport)


class Outcomes:
    def __init__(self) -> None:
        self.prefill: dict[str, PrefillReport | Exception] = {}
        self.tokens: dict[str, list[int]] = {}
        self.errors: dict[str, str] = {}
        self.finished: set[str] = set()

    def on_prefill(self, request_id: str, outcome: PrefillReport | Exception) -> None:
        self.prefill[request_id] = outcome

    def apply(self, update: WorkerUpdate) -> None:
        if isinstance(update, RequestFailed):
            self.errors[update.request_id] = update.reason
            self.finished.add(update.request_id)
            return
        tokens = self.tokens.setdefault(update.request_id, [])
        assert update.first_index == len(tokens)
        tokens.extend(update.token_ids)
        if update.finish_reason is not None:
            self.finished.add(update.request_id)


def run(prefill: PrefillWorker, decode: DecodeWorker, requests: list[WorkRequest]) -> Outcomes:
    outcomes = Outcomes()
    for request in requests:
        ticket = decode.reserve(request, prefill.worker_id).result(TIMEOUT)
        prefill.submit(request, ticket, outcomes.on_prefill)
    deadline = time.monotonic() + TIMEOUT
    while len(outcomes.finished) < len(requests) or len(outcomes.prefill) < len(requests):
        assert time.monotonic() < deadline, "requests did not finish in time"
        for update in decode.take_updates(timeout=0.2):
            outcomes.apply(update)
    return outcomes


def test_disaggregated_greedy_equals_colocated(tiny_llama, workers) -> None:
    prefill, decode = workers
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    prompts = mixed_prompts(llm.engine.model_config.vocab_size, count=6, seed=3)
    expected = [out.token_ids for out in llm.generate_ids(prompts, GREEDY)]
    requests = [WorkRequest(f"greedy-{i}", p, GREEDY) for i, p in enumerate(prompts)]
    outcomes = run(prefill, decode, requests)
    assert not outcomes.errors
    assert [outcomes.tokens[r.request_id] for r in requests] == expected
    assert decode.stats().result(TIMEOUT).num_free_blocks == decode.engine.blocks.num_blocks
    assert prefill.engine.blocks.num_free_blocks == prefill.engine.blocks.num_blocks


def test_bytes_moved_are_the_uncached_kv(workers) -> None:
    prefill, decode = workers
    layout = prefill.layout  # float32 K and V for every layer
    per_token = layout.num_layers * 2 * layout.kv_heads * layout.head_dim * 4
    vocab = prefill.engine.model_config.vocab_size
    shared = [(11 * i) % (vocab - 3) + 3 for i in range(24)]  # 6 full blocks of 4
    for request_id, tail, moved in [("bytes-a", [5, 6, 7], 27), ("bytes-b", [9, 10, 11], 3)]:
        sent, received = prefill.bytes_sent, decode.receiver.bytes_received
        outcomes = run(prefill, decode, [WorkRequest(request_id, [*shared, *tail], GREEDY)])
        assert not outcomes.errors
        assert outcomes.prefill[request_id].result.bytes_sent == moved * per_token
        assert prefill.bytes_sent - sent == moved * per_token
        assert decode.receiver.bytes_received - received == moved * per_token


class BreaksAfter:
    """Channels that close themselves after `limit` sends: the peer sees its link go down."""

    def __init__(self, inner, limit: int) -> None:
        self.inner, self.limit, self.name = inner, limit, f"{inner.name}-breaking"

    def connect(self, rendezvous, key, timeout):
        return Breaking(self.inner.connect(rendezvous, key, timeout), self.limit)

    def accept(self, store, key, timeout):
        return self.inner.accept(store, key, timeout)


class Breaking:
    def __init__(self, channel, limit: int) -> None:
        self.channel, self.left = channel, limit

    def send_async(self, tensor: torch.Tensor):
        self.left -= 1
        if self.left < 0:
            self.channel.close()
            raise TransferError("injected: link down")
        return self.channel.send_async(tensor)

    def send(self, tensor: torch.Tensor, timeout: float) -> None:
        self.send_async(tensor).wait(timeout)

    def recv_async(self, tensor: torch.Tensor):
        return self.channel.recv_async(tensor)

    def close(self) -> None:
        self.channel.close()


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_link_broken_mid_transfer_fails_the_request_and_frees_both_sides(
    tiny_llama, name: str
) -> None:
    config = engine_config(tiny_llama, num_kv_blocks=64)
    transports = [transport_named(name), transport_named(name)]
    prefill = PrefillWorker("p-flaky", LLMEngine(config), BreaksAfter(transports[0], 3), 5.0)
    decode = DecodeWorker("d-flaky", LLMEngine(config), transports[1], transfer_timeout=5.0)
    try:
        outcomes = run(prefill, decode, [WorkRequest("doomed", list(range(3, 40)), GREEDY)])
        assert "doomed" in outcomes.errors
        assert isinstance(outcomes.prefill["doomed"], Exception)
        assert decode.engine.blocks.num_free_blocks == 64
        assert prefill.engine.blocks.num_free_blocks == 64
    finally:
        prefill.shutdown()
        decode.shutdown()
        for transport in transports:
            close_transport(transport)


def test_an_arrival_the_engine_cannot_admit_fails_alone_and_frees_its_blocks(
    tiny_llama, monkeypatch
) -> None:
    """The KV arrived, but joining the batch raised (a bug, a device error): the request fails
    with a message instead of waiting with no lease, its blocks come back, and the next
    request is served."""
    config = engine_config(tiny_llama, num_kv_blocks=64)
    transports = [transport_named("gloo"), transport_named("gloo")]
    prefill = PrefillWorker("p-admit", LLMEngine(config), transports[0], 5.0)
    decode = DecodeWorker("d-admit", LLMEngine(config), transports[1], transfer_timeout=5.0)
    admit = decode.engine.admit

    def admit_fails_once(request_id: str, *args):
        if request_id == "doomed":
            raise RuntimeError("CUDA error: device-side assert triggered")
        return admit(request_id, *args)

    monkeypatch.setattr(decode.engine, "admit", admit_fails_once)
    try:
        outcomes = run(prefill, decode, [WorkRequest("doomed", list(range(3, 40)), GREEDY)])
        assert "admitting its KV failed" in outcomes.errors["doomed"]
        assert "device-side assert" in outcomes.errors["doomed"]
        assert decode.engine.blocks.num_free_blocks == 64 and not decode.engine.reserved
        outcomes = run(prefill, decode, [WorkRequest("next", list(range(3, 40)), GREEDY)])
        assert len(outcomes.tokens["next"]) == GREEDY.max_tokens and not outcomes.errors
    finally:
        prefill.shutdown()
        decode.shutdown()
        for transport in transports:
            close_transport(transport)


def test_a_reservation_that_fails_after_taking_blocks_gives_them_back(
    tiny_llama, monkeypatch
) -> None:
    """The blocks were taken, then expecting the KV raised (a receiver that cannot start its
    thread, a rank that does not answer): the reserve fails and frees them; before, the blocks
    stayed with a reservation that had no lease, so nothing ever freed them."""
    config = engine_config(tiny_llama, num_kv_blocks=64)
    transport = transport_named("gloo")
    decode = DecodeWorker("d-expect", LLMEngine(config), transport, transfer_timeout=5.0)

    def cannot_expect(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(decode.receiver, "expect", cannot_expect)
    try:
        future = decode.reserve(WorkRequest("r", list(range(3, 40)), GREEDY), "p-0")
        with pytest.raises(RuntimeError, match="can't start new thread"):
            future.result(TIMEOUT)
        assert decode.engine.blocks.num_free_blocks == 64 and not decode.engine.reserved
        assert decode.stats().result(TIMEOUT).num_running == 0
    finally:
        decode.shutdown()
        close_transport(transport)
