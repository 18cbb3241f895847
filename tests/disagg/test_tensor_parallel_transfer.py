"""KV moves between prefill and decode workers of different tensor-parallel layouts (followers as
local processes, no Ray): every pair of layouts gives the TP 1 colocated output, each route
moves exactly its heads' share of the KV, and a rank that dies fails its transfers instead of
hanging them."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.tensor_parallel import RemoteError
from kvtransfer.transport import make_transport
from prefill.worker import PrefillReport, PrefillWorker
from protocol.kv import kv_routes
from protocol.messages import RequestFailed, WorkRequest
from protocol.sampling import SamplingParams
from tests.support.prompts import mixed_prompts
from worker.rank_roles import spawn_with_roles

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
TIMEOUT = 60.0


def start(checkpoint, prefill_tp: int, decode_tp: int, **decode_options):
    """A prefill and a decode worker, each with its own follower ranks."""

    def engine(size: int, **options) -> LLMEngine:
        fields = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 96, **options}
        config = EngineConfig(checkpoint, tensor_parallel_size=size, rank_timeout=30, **fields)
        return LLMEngine(config, spawn_with_roles)

    transport = make_transport("gloo", torch.device("cpu"))
    prefill_engine = engine(prefill_tp, max_num_batched_tokens=24)  # prompts take 2-3 steps
    prefill = PrefillWorker(f"p-tp{prefill_tp}", prefill_engine, transport, 20)
    decode = DecodeWorker(f"d-tp{decode_tp}", engine(decode_tp, **decode_options), transport, 20)
    return prefill, decode


def stop(*workers) -> None:
    for worker in workers:
        worker.shutdown()
        worker.engine.close()


def run(prefill, decode, requests, prefill_tp):
    """Tokens per request id, failure reasons, tickets, and prefill reports."""
    tokens: dict[str, list[int]] = {}
    failed: dict[str, str] = {}
    reports: dict[str, object] = {}
    tickets = []
    for request in requests:
        ticket = decode.reserve(request, prefill.worker_id, None, prefill_tp).result(TIMEOUT)
        tickets.append(ticket)
        prefill.submit(request, ticket, reports.__setitem__)
    done: set[str] = set()
    deadline = time.monotonic() + TIMEOUT
    while len(done) < len(requests):
        assert time.monotonic() < deadline, "requests did not finish in time"
        for update in decode.take_updates(timeout=0.2):
            if isinstance(update, RequestFailed):
                failed[update.request_id] = update.reason
                done.add(update.request_id)
                continue
            tokens.setdefault(update.request_id, []).extend(update.token_ids)
            if update.finish_reason is not None:
                done.add(update.request_id)
    return tokens, failed, tickets, reports


@pytest.fixture(scope="module")
def expected(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    prompts = mixed_prompts(llm.engine.model_config.vocab_size, count=4, seed=5)
    return prompts, [out.token_ids for out in llm.generate_ids(prompts, GREEDY)]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"),
    [(1, 2), (2, 1), (2, 2), (4, 2), (1, 4)],
    ids=["P1-D2", "P2-D1", "P2-D2", "P4-D2-replicated", "P1-D4-replicated"],
)
def test_any_layout_pair_gives_the_tp1_output(tiny_llama, expected, prefill_tp, decode_tp):
    prompts, outputs = expected
    prefill, decode = start(tiny_llama, prefill_tp, decode_tp)
    try:
        requests = [WorkRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        tokens, failed, tickets, reports = run(prefill, decode, requests, prefill_tp)
        assert not failed
        assert [tokens[r.request_id] for r in requests] == outputs
        assert all(isinstance(report, PrefillReport) for report in reports.values())
        # Each route moved its heads' share of each request's uncached KV, nothing more.
        layout = decode.layout
        per_head = layout.num_layers * 2 * layout.head_dim * 4  # float32, per token
        moved = sum(t.num_tokens - t.num_cached_tokens for t in tickets)
        routes = kv_routes(layout.kv_heads, prefill_tp, decode_tp)
        assert decode.route_bytes == {
            f"{r.src}>{r.dst}": moved * per_head * r.num_heads for r in routes
        }
        # The replicas of a head send it once: prefill ranks beyond the first owner send none.
        senders = {r.src for r in routes}
        if prefill_tp > layout.kv_heads:
            assert senders == set(range(0, prefill_tp, prefill_tp // layout.kv_heads))
        assert decode.engine.blocks.num_free_blocks > 0
    finally:
        stop(prefill, decode)


def test_different_block_sizes_re_block_on_the_decode_side(tiny_llama, expected):
    prompts, outputs = expected
    prefill, decode = start(tiny_llama, 2, 1, block_size=8, num_kv_blocks=48)
    try:
        requests = [WorkRequest(f"b{i}", p, GREEDY) for i, p in enumerate(prompts)]
        tokens, failed, _, _ = run(prefill, decode, requests, 2)
        assert not failed
        assert [tokens[r.request_id] for r in requests] == outputs
    finally:
        stop(prefill, decode)


def test_a_prompt_the_decode_worker_holds_whole_still_ends_every_ranks_legs(tiny_llama):
    """A block-aligned prompt seen before: the decode worker's prefix cache holds all of it,
    so no rank sends KV. The follower prefill rank sent its leg's done frame only for a chunk
    it was told to send, and was told nothing: the decode side waited out the lease and the
    request failed ("KV did not arrive")."""
    prompt = list(range(10, 26))  # 16 tokens: 4 full blocks of 4
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    [want] = [out.token_ids for out in llm.generate_ids([prompt], GREEDY)]
    prefill, decode = start(tiny_llama, 2, 1)
    try:
        for name in ("first", "again"):
            started = time.monotonic()
            tokens, failed, [ticket], _ = run(
                prefill, decode, [WorkRequest(name, prompt, GREEDY)], 2
            )
            assert not failed and tokens[name] == want
            assert time.monotonic() - started < 10.0  # not a lease (20 s) waited out
        assert ticket.num_cached_tokens == ticket.num_tokens == 16  # the second: all cached
    finally:
        stop(prefill, decode)


def test_a_decode_rank_killed_mid_transfer_fails_its_requests_and_frees_blocks(tiny_llama):
    prefill, decode = start(tiny_llama, 2, 2)
    try:
        free = decode.engine.blocks.num_free_blocks
        (rank,) = [
            p
            for p in multiprocessing.active_children()
            if p.name == "tandem-rank-1" and p.pid != _prefill_rank_pid(prefill)
        ]
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(10)
        request = WorkRequest("doomed", list(range(3, 60)), GREEDY)
        started = time.monotonic()
        with pytest.raises(RemoteError):  # the reservation cannot reach the dead rank
            decode.reserve(request, prefill.worker_id, None, 2).result(TIMEOUT)
        assert time.monotonic() - started < 10  # a lost rank answers no call: no deadline waited
        assert decode.engine.blocks.num_free_blocks == free
    finally:
        stop(prefill, decode)


def _prefill_rank_pid(prefill) -> int:
    return prefill.engine.runner.ranks._launched[0].pid


def test_a_prefill_aborted_between_chunks_ends_every_ranks_legs(tiny_llama):
    """Rank 0 sends its legs' abort frames; the follower ranks must end theirs too, or their
    send records stay until the role ends (one per aborted request and leg)."""
    prefill, decode = start(tiny_llama, 2, 1)  # budget 24: this prompt takes 4 steps
    try:
        request = WorkRequest("cut", list(range(3, 90)), GREEDY)
        ticket = decode.reserve(request, prefill.worker_id, None, 2).result(TIMEOUT)
        announced = threading.Event()
        original = prefill._announce_step

        def announce_then_signal(plan):
            followers = original(plan)
            if followers:
                announced.set()  # the first chunk's legs are on their way, on every rank
            return followers

        prefill._announce_step = announce_then_signal
        reports: dict[str, object] = {}
        prefill.submit(request, ticket, reports.__setitem__)
        assert announced.wait(TIMEOUT)
        prefill.abort("cut")

        def in_flight() -> list[object]:
            ranks = prefill.engine.runner.ranks
            return prefill.thread.submit(ranks.call, ["legs_in_flight"]).result(TIMEOUT)

        deadline = time.monotonic() + 10
        while in_flight() != [0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "cut" in reports and isinstance(reports["cut"], Exception)
        assert in_flight() == [0]
    finally:
        stop(prefill, decode)
