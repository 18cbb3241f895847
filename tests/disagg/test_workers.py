"""Prefill and decode workers in one process (no Ray), joined by a gloo channel."""

from __future__ import annotations

import threading
import time

import pytest

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from engine.llm import LLM
from engine.requests import TokenUpdate, WorkRequest
from engine.sampling_params import SamplingParams
from kvtransfer.transport import TransferError, make_transport
from prefill.worker import PrefillResult, PrefillWorker
from tests.engine.test_batch_invariance import mixed_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def workers(tiny_llama):
    def config(**options) -> EngineConfig:
        return EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=128, **options)

    transport = make_transport("gloo", __import__("torch").device("cpu"))
    prefill = PrefillWorker("p0", config(max_num_batched_tokens=32), transport, 20.0)
    decode = DecodeWorker("d0", config(), transport, 20.0)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


class Results:
    def __init__(self) -> None:
        self.prefill: dict[str, PrefillResult | Exception] = {}
        self.tokens: dict[str, dict[int, int]] = {}
        self.finished: set[str] = set()
        self.errors: dict[str, str] = {}
        self.lock = threading.Lock()

    def on_prefill(self, request_id: str, outcome: PrefillResult | Exception) -> None:
        with self.lock:
            self.prefill[request_id] = outcome

    def apply(self, update: TokenUpdate) -> None:
        if update.error is not None:
            self.errors[update.request_id] = update.error
            self.finished.add(update.request_id)
            return
        got = self.tokens.setdefault(update.request_id, {})
        for i, token in enumerate(update.token_ids):
            got[update.first_index + i] = token
        if update.finish_reason is not None:
            self.finished.add(update.request_id)

    def output(self, request_id: str) -> list[int]:
        got = self.tokens[request_id]
        return [got[i] for i in range(len(got))]


def run_remote(prefill, decode, requests: list[WorkRequest]) -> Results:
    results = Results()
    for request in requests:
        ticket = decode.reserve(request, prefill.worker_id).result(TIMEOUT)
        assert ticket is not None
        prefill.submit(request, ticket, results.on_prefill)
    deadline = time.monotonic() + TIMEOUT
    while len(results.finished) < len(requests):
        assert time.monotonic() < deadline, "requests did not finish in time"
        for update in decode.take_updates(timeout=0.5):
            results.apply(update)
    return results


def test_disaggregated_greedy_equals_colocated(tiny_llama, workers) -> None:
    prefill, decode = workers
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    prompts = mixed_prompts(llm.engine.model_config.vocab_size, count=6, seed=3)
    expected = [out.token_ids for out in llm.generate_ids(prompts, GREEDY)]
    requests = [WorkRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    results = run_remote(prefill, decode, requests)
    assert not results.errors
    assert [results.output(r.request_id) for r in requests] == expected
    layout = prefill.layout
    for request in requests:
        outcome = results.prefill[request.request_id]
        assert isinstance(outcome, PrefillResult)
        assert outcome.token_id == results.output(request.request_id)[0]
    free = decode.stats().result(TIMEOUT).num_free_blocks
    assert free == decode.engine.blocks.num_blocks
    assert prefill.engine.blocks.num_free_blocks == prefill.engine.blocks.num_blocks
    assert layout.num_layers == 2


def expected_bytes(prefill: PrefillWorker, num_tokens: int) -> int:
    layout = prefill.layout  # float32: 4 bytes per value
    return num_tokens * layout.num_layers * 2 * layout.kv_heads * layout.head_dim * 4


def test_bytes_moved_are_the_uncached_kv(workers) -> None:
    prefill, decode = workers
    vocab = prefill.engine.model_config.vocab_size
    shared = [(7 * i) % (vocab - 3) + 3 for i in range(24)]  # 6 full blocks of 4
    first = WorkRequest("bytes-a", [*shared, 5, 6, 7], GREEDY)
    sent_before = prefill.bytes_sent
    received_before = decode.receiver.bytes_received
    run_remote(prefill, decode, [first])
    assert prefill.bytes_sent - sent_before == expected_bytes(prefill, 27)
    assert decode.receiver.bytes_received - received_before == expected_bytes(prefill, 27)

    # Same 24-token prefix: the decode worker holds those blocks, so only 3 tokens move.
    second = WorkRequest("bytes-b", [*shared, 9, 10, 11], GREEDY)
    sent_before = prefill.bytes_sent
    ticket = decode.reserve(second, prefill.worker_id).result(TIMEOUT)
    assert ticket.num_cached_tokens == 24
    results = Results()
    prefill.submit(second, ticket, results.on_prefill)
    deadline = time.monotonic() + TIMEOUT
    while "bytes-b" not in results.finished:
        assert time.monotonic() < deadline
        for update in decode.take_updates(timeout=0.5):
            results.apply(update)
    assert prefill.bytes_sent - sent_before == expected_bytes(prefill, 3)
    assert ticket.num_bytes == expected_bytes(prefill, 3)


def test_unclaimed_reservation_expires_and_frees_its_blocks(tiny_llama) -> None:
    config = EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64)
    transport = make_transport("gloo", __import__("torch").device("cpu"))
    decode = DecodeWorker("d-lease", config, transport, transfer_timeout=0.5)
    try:
        request = WorkRequest("orphan", list(range(3, 40)), GREEDY)
        ticket = decode.reserve(request, "p-never").result(TIMEOUT)
        assert ticket is not None
        assert decode.engine.blocks.num_free_blocks == 64 - 10
        updates = []
        deadline = time.monotonic() + 10
        while not updates:
            assert time.monotonic() < deadline, "the lease never expired"
            updates = decode.take_updates(timeout=0.5)
        assert updates[0].request_id == "orphan" and "did not arrive" in updates[0].error
        assert decode.engine.blocks.num_free_blocks == 64
    finally:
        decode.shutdown()


class BreaksAfter:
    """A transport whose channels fail after `limit` sends, like a peer that vanished."""

    def __init__(self, inner, limit: int) -> None:
        self.inner, self.limit, self.name = inner, limit, "breaking"

    def connect(self, rendezvous, key, timeout):
        channel, transport = self.inner.connect(rendezvous, key, timeout), self

        class Breaking:
            sends = 0

            def send_async(self, tensor):
                Breaking.sends += 1
                if Breaking.sends > transport.limit:
                    channel.close()
                    raise TransferError("injected: link down")
                return channel.send_async(tensor)

            def send(self, tensor, timeout):
                self.send_async(tensor).wait(timeout)

            def recv_async(self, tensor):
                return channel.recv_async(tensor)

            def close(self):
                channel.close()

        return Breaking()

    def accept(self, store, key, timeout):
        return self.inner.accept(store, key, timeout)


def test_failed_transfer_reports_an_error_and_frees_blocks_on_both_sides(tiny_llama) -> None:
    config = EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64)
    gloo = make_transport("gloo", __import__("torch").device("cpu"))
    prefill = PrefillWorker("p-flaky", config, BreaksAfter(gloo, limit=3), 5.0)
    decode = DecodeWorker("d-flaky", config, gloo, transfer_timeout=5.0)
    try:
        request = WorkRequest("doomed", list(range(3, 40)), GREEDY)
        ticket = decode.reserve(request, prefill.worker_id).result(TIMEOUT)
        results = Results()
        prefill.submit(request, ticket, results.on_prefill)
        deadline = time.monotonic() + 20
        while "doomed" not in results.finished or "doomed" not in results.prefill:
            assert time.monotonic() < deadline, "the failure never reached both workers"
            for update in decode.take_updates(timeout=0.5):
                results.apply(update)
        assert "doomed" in results.errors
        assert isinstance(results.prefill["doomed"], Exception)
        assert decode.engine.blocks.num_free_blocks == 64
        assert prefill.engine.blocks.num_free_blocks == 64
    finally:
        prefill.shutdown()
        decode.shutdown()
