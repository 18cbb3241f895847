"""Disaggregated pools on Ray: greedy output equals colocated and transformers at 1P1D, 2P1D,
1P2D; the bytes moved are exactly the KV that decode did not hold."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import ray
import torch

from coordinator.router import prefix_hashes
from engine.config import ModelConfig
from engine.llm import LLM
from protocol.core_ledger import PREFIX, CoreLedger, ledger_dir
from protocol.errors import RequestError
from protocol.sampling import SamplingParams
from tests.support.hf_reference import hf_greedy
from tests.support.loop import collect
from tests.support.prompts import mixed_prompts

# min_tokens masks EOS exactly as transformers' min_new_tokens does.
GREEDY = SamplingParams(max_tokens=10, min_tokens=10, temperature=0)


@pytest.fixture(scope="module")
def prompts(tiny_llama) -> list[list[int]]:
    vocab = LLM(tiny_llama, dtype="float32").engine.model_config.vocab_size
    return mixed_prompts(vocab, count=8, seed=11)


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts) -> list[list[int]]:
    """Colocated tandem's greedy tokens, checked here against transformers' for the same
    prompts, so every pool compared with them is compared with both."""
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    colocated = [out.token_ids for out in llm.generate_ids(prompts, GREEDY)]
    assert colocated == [hf_greedy(tiny_llama, p, GREEDY.max_tokens) for p in prompts]
    return colocated


def run_all(loop, client, prompts, params=GREEDY, tag="r") -> list[list[int]]:
    async def go():
        return await asyncio.gather(
            *(collect(client, p, params, f"{tag}{i}") for i, p in enumerate(prompts))
        )

    return [final.token_ids for final, _ in loop.run(go())]


def assert_moved_the_uncached_kv(client, checkpoint, prompts, threshold: int, transport: str):
    """Both workers count exactly the KV of the prompts the decode worker did not prefill itself
    (those under `threshold` tokens), over `transport`."""
    decode = ray.get(client.decode["decode-0"].stats.remote(), timeout=10)
    prefill = ray.get(client.prefill["prefill-0"].stats.remote(), timeout=10)
    assert decode.kv_transport == prefill.kv_transport == transport
    long_tokens = sum(len(p) for p in prompts if len(p) >= threshold)
    cfg = ModelConfig.from_pretrained(checkpoint)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V
    assert prefill.kv_transfer_bytes == decode.kv_transfer_bytes == long_tokens * per_token
    return decode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_pools_on_one_gpu_equal_transformers(
    tiny_llama, build_pool, loop, prompts, expected, mode
) -> None:
    """Workers on CUDA sharing one GPU (half each), as `--gpus-per-worker 0.5` deploys them:
    1P1D moves every layer's KV from GPU to GPU over CUDA IPC (`auto`), exactly the KV of the
    prompts the decode worker did not prefill itself."""
    build_pool.stop_all()  # the one GPU holds one such pool at a time
    threshold = 20
    client = build_pool(
        tiny_llama, engine_options={"device": "cuda"}, mode=mode, num_prefill=1, num_decode=1,
        gpus_per_worker=0.5, local_prefill_threshold=threshold,
    )  # fmt: skip
    assert run_all(loop, client, prompts) == expected
    if mode == "disaggregated":
        assert_moved_the_uncached_kv(client, tiny_llama, prompts, threshold, "ipc/nccl")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_pools_on_two_gpus_equal_transformers(tiny_llama, build_pool, loop, prompts, expected):
    """A worker per GPU: `auto` moves the KV over NCCL between them (the pick itself:
    tests/kvtransfer/test_two_gpus.py)."""
    build_pool.stop_all()
    threshold = 20
    client = build_pool(
        tiny_llama, engine_options={"device": "cuda"}, num_prefill=1, num_decode=1,
        gpus_per_worker=1, local_prefill_threshold=threshold,
    )  # fmt: skip
    assert run_all(loop, client, prompts, tag="g") == expected
    assert_moved_the_uncached_kv(client, tiny_llama, prompts, threshold, "ipc/nccl")


@pytest.mark.parametrize("num_prefill,num_decode", [(1, 1), (2, 1), (1, 2)])
def test_disaggregated_equals_colocated(
    tiny_llama, build_pool, loop, prompts, expected, num_prefill, num_decode
) -> None:
    client = build_pool(tiny_llama, num_prefill=num_prefill, num_decode=num_decode)
    assert run_all(loop, client, prompts) == expected


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: nothing to share")
def test_workers_sharing_the_cores_pace_them_with_the_same_output(
    tiny_llama, build_pool, loop, prompts, expected
) -> None:
    """The default CPU split (prefill cores / workers, decode every core) with the core ledger
    (kernels/core_share.py): workers marked busy while they compute, tokens unchanged, and
    every mark gone once the workers idle."""
    before = set(ledger_dir().glob(f"{PREFIX}{os.getpid()}-*"))
    client = build_pool(tiny_llama, threads_per_worker=None)
    (path,) = set(ledger_dir().glob(f"{PREFIX}{os.getpid()}-*")) - before
    ledger, seen, done = CoreLedger(path), set(), threading.Event()

    def watch() -> None:
        while not done.wait(0.001):
            seen.add(ledger.busy())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert run_all(loop, client, prompts) == expected
    finally:
        done.set()
        watcher.join(10)
    assert max(seen) >= 1
    for _ in range(100):  # a worker unmarks on its first turn without work
        if ledger.busy() == 0:
            break
        time.sleep(0.05)
    assert ledger.busy() == 0


def test_colocated_mode_prefills_everything_on_its_workers(
    tiny_llama, build_pool, loop, prompts, expected
) -> None:
    client = build_pool(tiny_llama, mode="colocated", num_prefill=1, num_decode=1)
    assert not client.prefill and set(client.decode) == {"colocated-0", "colocated-1"}
    assert run_all(loop, client, prompts) == expected
    stats = [ray.get(h.stats.remote(), timeout=10) for h in client.decode.values()]
    assert sum(s.requests_prefilled_locally for s in stats) == len(prompts)
    assert all(s.kv_transfer_bytes == 0 for s in stats)


def test_kv_over_shared_memory_equals_colocated_and_moves_the_uncached_kv(
    tiny_llama, build_pool, loop, prompts, expected
) -> None:
    """1P1D over the ipc transport between two worker processes: the payloads go through the
    prefill worker's shared-memory ring and are unpacked from it in place."""
    threshold = 20
    client = build_pool(tiny_llama, kv_transport="ipc", local_prefill_threshold=threshold)
    assert run_all(loop, client, prompts, tag="i") == expected
    assert_moved_the_uncached_kv(client, tiny_llama, prompts, threshold, "ipc")


def test_short_prompts_prefill_on_the_decode_worker(
    tiny_llama, build_pool, loop, prompts, expected
) -> None:
    threshold = 20
    client = build_pool(tiny_llama, local_prefill_threshold=threshold)
    assert run_all(loop, client, prompts, tag="t") == expected
    decode = assert_moved_the_uncached_kv(client, tiny_llama, prompts, threshold, "gloo")
    short = [p for p in prompts if len(p) < threshold]
    assert decode.requests_prefilled_locally == len(short) > 0


def test_the_router_matches_prompts_against_what_worker_processes_report(
    tiny_llama, build_pool, loop, prompts, expected
) -> None:
    """Workers are other processes: the block hashes their caches report must be the ones the
    router computes for a prompt (before Python 3.12, hash(None) differs per process, and
    hashes chained from it never matched: engine/block_manager.py ROOT_HASH)."""
    client = build_pool(tiny_llama, num_prefill=1, num_decode=1)
    assert run_all(loop, client, prompts[:1], tag="h") == expected[:1]
    digests = set(prefix_hashes(prompts[0], 4))
    assert digests  # at least one full block
    loads = (client.router.prefill["prefill-0"], client.router.decode["decode-0"])
    for _ in range(100):  # reports come with the 1 s stats poll: 10 s at most
        if all(digests <= load.cached for load in loads):
            break
        time.sleep(0.1)
    assert digests <= loads[0].cached  # it computed them
    assert digests <= loads[1].cached  # their KV arrived there


def test_seeded_sampling_is_the_same_disaggregated(tiny_llama, build_pool, loop, prompts) -> None:
    """A seeded request takes one draw per token from its own generator wherever the token is
    sampled: the prefill worker's first token spends draw 0, the decode worker goes on from
    draw 1 (it once drew 0 again for the second token)."""
    seeded = SamplingParams(max_tokens=10, min_tokens=10, temperature=1.0, seed=7)
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    colocated = [out.token_ids for out in llm.generate_ids(prompts, seeded)]
    client = build_pool(tiny_llama, num_prefill=1, num_decode=1)
    assert run_all(loop, client, prompts, seeded, tag="s") == colocated


def test_prompt_logprobs_are_the_same_disaggregated(tiny_llama, build_pool, loop) -> None:
    """The worker that computes a prompt's KV scores it: the prefill worker (its answer brings
    them to the coordinator with the first token) or, prefilling locally, the decode worker."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    colocated = llm.generate_ids(prompts, params)

    def ranked(outputs) -> list:  # each prompt token's rank and alternatives
        return [[e and (e.rank, [t for t, _ in e.top]) for e in o.prompt_logprobs] for o in outputs]

    for threshold in (0, 10_000):  # remote prefill, then every prompt prefilled locally
        client = build_pool(
            tiny_llama, num_prefill=1, num_decode=1, local_prefill_threshold=threshold
        )

        async def go(tag: str, client=client):
            return await asyncio.gather(
                *(collect(client, p, params, f"{tag}-{i}") for i, p in enumerate(prompts))
            )

        for again in range(2):  # the second time, both workers hold the prompts' blocks
            outputs = [final for final, _ in loop.run(go(f"p{threshold}-{again}"))]
            assert [o.token_ids for o in outputs] == [o.token_ids for o in colocated]
            assert ranked(outputs) == ranked(colocated)
            for got, want in zip(outputs, colocated, strict=True):
                assert [e and e.logprob for e in got.prompt_logprobs] == pytest.approx(
                    [e and e.logprob for e in want.prompt_logprobs], abs=1e-5
                )
        build_pool.stop_all()


def test_structured_output_is_the_same_disaggregated(tiny_llama, build_pool, loop) -> None:
    """The prefill worker samples the first token inside the response format; the decode
    worker's matcher reads it and goes on inside it: the output equals colocated's."""
    pytest.importorskip("xgrammar")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    params = SamplingParams(max_tokens=30, temperature=0, structure=("regex", "(abc|xyz)d{3,5}"))
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    colocated = [out.token_ids for out in llm.generate_ids(prompts, params)]
    client = build_pool(tiny_llama, num_prefill=1, num_decode=1, local_prefill_threshold=0)
    assert run_all(loop, client, prompts, params, tag="g") == colocated
    texts = [llm.tokenizer.decode(ids) for ids in colocated]
    assert all(t[:3] in ("abc", "xyz") and 3 <= t.count("d") <= 5 for t in texts), texts
    # A schema the prefill worker's compiler refuses fails its request as the client's error
    # (a 400 over HTTP), alone: the pool serves on.
    bad = SamplingParams(max_tokens=3, structure=("json_schema", '{"type": 7}'))
    with pytest.raises(RequestError, match="the json schema cannot be used: "):
        run_all(loop, client, prompts[:1], bad, tag="bad")
    assert run_all(loop, client, prompts, params, tag="g2") == colocated
