"""Greedy output of a request is the same alone or batched, chunked, preempted or cached."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from protocol.sampling import SamplingParams
from tests.support.prompts import mixed_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_llama) -> list[list[int]]:
    return mixed_prompts(LLM(tiny_llama, dtype="float32").engine.model_config.vocab_size)


@pytest.fixture(scope="module")
def alone(tiny_llama, prompts) -> list[list[int]]:
    llm = LLM(tiny_llama, dtype="float32", enable_prefix_caching=False)
    return [llm.generate_ids([p], GREEDY)[0].token_ids for p in prompts]


def run_batch(folder, prompts: list[list[int]], **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(folder, dtype="float32", block_size=4, **options)
    return llm, [out.token_ids for out in llm.generate_ids(prompts, GREEDY)]


def test_batched_equals_alone(tiny_llama, prompts, alone) -> None:
    llm, together = run_batch(tiny_llama, prompts)
    assert together == alone
    assert llm.engine.blocks.num_free_blocks == llm.engine.num_blocks


def test_chunked_prefill_equals_alone(tiny_llama, prompts, alone) -> None:
    llm, together = run_batch(tiny_llama, prompts, max_num_batched_tokens=7)
    assert together == alone


def test_preemption_equals_alone(tiny_llama, prompts, alone) -> None:
    # 24 blocks of 4 tokens: room for about one long sequence, so most get preempted.
    llm, together = run_batch(tiny_llama, prompts, num_kv_blocks=24)
    assert together == alone
    assert llm.engine.scheduler.num_unfinished == 0
    assert llm.engine.blocks.num_free_blocks == 24


def test_preemption_actually_happens(tiny_llama, prompts) -> None:
    llm = LLM(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=24)
    counts = []
    original = llm.engine.scheduler.schedule

    def spy(*args):
        plan = original(*args)
        counts.append(len(plan.preempted))
        return plan

    llm.engine.scheduler.schedule = spy
    llm.generate_ids(prompts, GREEDY)
    assert sum(counts) > 0


def test_prefix_cache_hit_equals_alone(tiny_llama, prompts, alone) -> None:
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    first = [out.token_ids for out in llm.generate_ids(prompts, GREEDY)]
    queries_before, hits_before = llm.engine.blocks.prefix_queries, llm.engine.blocks.prefix_hits
    second = llm.generate_ids(prompts, GREEDY)
    hits = llm.engine.blocks.prefix_hits - hits_before
    assert first == alone
    assert [out.token_ids for out in second] == alone
    assert hits > 0 and llm.engine.blocks.prefix_queries > queries_before
    assert sum(out.num_cached_tokens for out in second) == hits


def test_copies_arriving_together_match_alone_and_compute_the_prompt_once(
    tiny_llama, prompts, alone
) -> None:
    """Three copies of each prompt at once (as n = 3 sends them), prompts interleaved, on a small
    token budget: each copy's tokens equal the prompt's alone, and each copy after the first
    starts from the first copy's cached blocks instead of computing them again."""
    copies = [p for p in prompts for _ in range(3)]
    llm = LLM(tiny_llama, dtype="float32", block_size=4, max_num_batched_tokens=64)
    outputs = llm.generate_ids(copies, GREEDY)
    assert [out.token_ids for out in outputs] == [a for a in alone for _ in range(3)]
    for i, prompt in enumerate(prompts):
        cached = [out.num_cached_tokens for out in outputs[3 * i : 3 * i + 3]]
        full_blocks = (len(prompt) - 1) // 4 * 4  # the last token is always computed
        assert cached[0] == 0 and cached[1:] == [full_blocks, full_blocks], (i, cached)
    assert llm.engine.blocks.num_free_blocks == llm.engine.num_blocks
