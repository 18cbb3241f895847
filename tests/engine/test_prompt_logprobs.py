"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the tokens
before it, as transformers computes it, whatever the chunking, batching or prefix cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from protocol.errors import RequestError
from protocol.limits import ModelLimits
from protocol.messages import TokenUpdate
from protocol.sampling import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # 19 tokens
SCORED = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)


def hf_prompt_logprobs(folder, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution of prompt token i + 1."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1)


def engine(folder, **options) -> LLMEngine:
    config = dict(dtype="float32", block_size=4, num_kv_blocks=256) | options
    return LLMEngine(EngineConfig(folder, **config))


def first_update(llm_engine: LLMEngine, request_id: str) -> TokenUpdate:
    for _ in range(100):
        for update in llm_engine.step():
            if update.request_id == request_id:
                return update
    raise AssertionError("no token")


def test_prompt_logprobs_are_transformers_own(tiny_llama) -> None:
    reference = hf_prompt_logprobs(tiny_llama, PROMPT)
    llm = LLM(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256)
    out = llm.generate_ids([PROMPT], SCORED)[0]
    scores = out.prompt_logprobs
    assert len(scores) == len(PROMPT) and scores[0] is None
    for i, entry in enumerate(scores[1:]):
        row, token = reference[i], PROMPT[i + 1]
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry.rank == int((row > row[token]).sum()) + 1
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    plain = llm.generate_ids([PROMPT], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids


@pytest.mark.parametrize("budget", [4, 7, 64])
def test_chunked_prefill_scores_every_position_once(tiny_llama, budget) -> None:
    reference = engine(tiny_llama)
    reference.add_request("r", PROMPT, SCORED)
    expected = first_update(reference, "r").prompt_logprobs
    chunked = engine(tiny_llama, max_num_batched_tokens=budget)
    chunked.add_request("r", PROMPT, SCORED)
    got = first_update(chunked, "r").prompt_logprobs
    assert len(got) == len(expected) == len(PROMPT)
    for a, b in zip(got[1:], expected[1:], strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.rank == b.rank


def test_a_cached_prompt_is_computed_again_to_be_scored(tiny_llama) -> None:
    llm_engine = engine(tiny_llama)
    llm_engine.add_request("warm", PROMPT, SamplingParams(max_tokens=1, temperature=0))
    first_update(llm_engine, "warm")
    llm_engine.add_request("cached", PROMPT, SamplingParams(max_tokens=1, temperature=0))
    assert first_update(llm_engine, "cached").num_cached_tokens == 16  # 4 full blocks of 4
    llm_engine.add_request("scored", PROMPT, SCORED)
    update = first_update(llm_engine, "scored")
    assert update.num_cached_tokens == 0 and len(update.prompt_logprobs) == len(PROMPT)
    fresh = engine(tiny_llama)
    fresh.add_request("scored", PROMPT, SCORED)
    expected = first_update(fresh, "scored").prompt_logprobs
    assert [e.rank for e in update.prompt_logprobs[1:]] == [e.rank for e in expected[1:]]


def test_scoring_beside_other_requests_changes_no_token(tiny_llama) -> None:
    llm = LLM(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    alone = [o.token_ids for o in llm.generate_ids([PROMPT[:7], PROMPT[3:]], greedy)]
    scored = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0)
    outs = llm.generate_ids([PROMPT[:7], PROMPT[3:]], [scored, greedy])
    assert [o.token_ids for o in outs] == alone
    assert len(outs[0].prompt_logprobs) == 7 and outs[1].prompt_logprobs is None
    assert all(e.top == [] for e in outs[0].prompt_logprobs[1:])  # prompt_logprobs=0: none


def test_a_resumed_request_scores_nothing(tiny_llama) -> None:
    """A request resumed with output (a retry elsewhere) had its prompt's logprobs sent with its
    first token: it takes its prefix cache hits and scores nothing."""
    llm_engine = engine(tiny_llama)
    llm_engine.add_request("r", PROMPT, SCORED, output_ids=[30])
    update = first_update(llm_engine, "r")
    assert update.first_index == 1 and update.prompt_logprobs is None


def test_a_one_token_prompt_has_one_entry_and_is_scored_at_once(tiny_llama) -> None:
    llm_engine = engine(tiny_llama)
    llm_engine.add_request("one", [7], SCORED)
    update = first_update(llm_engine, "one")
    assert update.prompt_logprobs == [None]  # nothing comes before its only token
    assert not llm_engine.sequences["one"].scores_prompt  # (so it may take cache hits)


def test_prompt_logprobs_past_what_an_update_frame_carries_are_refused() -> None:
    limits = ModelLimits(max_model_len=100_000, vocab_size=50_000)
    limits.check_scores([1] * 40_000, SamplingParams(prompt_logprobs=20))  # 840,000 entries
    with pytest.raises(RequestError, match="at most 1000000"):
        limits.check_scores([1] * 50_000, SamplingParams(prompt_logprobs=20))
