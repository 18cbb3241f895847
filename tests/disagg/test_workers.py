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
from kvtransfer.transport import make_transport
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
