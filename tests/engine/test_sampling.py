"""Sampling: seeds, top_k=1, stop strings and token limits, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampler import SampleRow, filtered_probs, sample
from kernels import ops
from kernels.argmax import argmax_ref
from protocol.sampling import SamplingError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    texts = ["The quick brown fox", "Prefill processes", "0123", "Über naïve café", "decode"]
    return [llm.tokenizer.encode(t) for t in texts]


def test_seed_gives_same_text_alone_and_in_batch(llm, prompts) -> None:
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate_ids([prompts[0]], seeded)[0]
    others = [SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)] * 4
    batch = llm.generate_ids(prompts, [seeded, *others])
    again = llm.generate_ids([prompts[0]], seeded)[0]
    assert batch[0].token_ids == alone.token_ids == again.token_ids
    assert batch[0].text == alone.text


def test_different_seeds_differ(llm, prompts) -> None:
    outs = [
        llm.generate_ids([prompts[0]], SamplingParams(max_tokens=20, seed=s, ignore_eos=True))[0]
        for s in (1, 2)
    ]
    assert outs[0].token_ids != outs[1].token_ids


def test_top_k_1_equals_greedy(llm, prompts) -> None:
    greedy = llm.generate_ids(prompts, SamplingParams(max_tokens=16, temperature=0))
    top1 = llm.generate_ids(prompts, SamplingParams(max_tokens=16, temperature=1.5, top_k=1))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_max_tokens_is_respected(llm, prompts) -> None:
    outs = llm.generate_ids(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in outs)


def test_min_tokens_blocks_eos(llm, prompts) -> None:
    eos = llm.tokenizer.hf.eos_token_id
    # Make EOS the model's favourite, then ask for at least 6 tokens.
    logits = torch.zeros(1, llm.engine.model_config.vocab_size)
    logits[0, eos] = 10.0
    params = SamplingParams(max_tokens=8, min_tokens=6, temperature=0)
    row = SampleRow(params, [1], [2] * 3, (eos,), None)
    assert sample(logits, [row]).token_ids[0] != eos
    outs = llm.generate_ids(prompts, SamplingParams(max_tokens=12, min_tokens=6, temperature=0))
    assert all(len(o.token_ids) >= 6 for o in outs)
    assert all(eos not in o.token_ids[:6] for o in outs)


def test_stop_string_is_trimmed(llm, prompts) -> None:
    full = llm.generate_ids([prompts[0]], SamplingParams(max_tokens=24, temperature=0))[0]
    stop = full.text[5:8]
    assert stop.strip(), "the greedy text needs a few characters to stop on"
    out = llm.generate_ids([prompts[0]], SamplingParams(max_tokens=24, temperature=0, stop=stop))
    assert out[0].finish_reason == "stop" and out[0].stop_reason == stop
    assert out[0].text == full.text[: full.text.index(stop)]
    assert llm.engine.blocks.num_free_blocks == llm.engine.num_blocks


def test_stop_token_ids_stop_and_are_reported(llm, prompts) -> None:
    full = llm.generate_ids([prompts[1]], SamplingParams(max_tokens=16, temperature=0))[0]
    token = full.token_ids[3]
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(token,))
    out = llm.generate_ids([prompts[1]], params)[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == token


def test_top_p_and_min_p_keep_only_the_head() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    rows = [SampleRow(SamplingParams(top_p=0.7), [], [], (), None)]
    assert filtered_probs(logits, rows)[0].nonzero().flatten().tolist() == [0, 1]
    rows = [SampleRow(SamplingParams(min_p=0.5), [], [], (), None)]
    assert filtered_probs(logits, rows)[0].nonzero().flatten().tolist() == [0, 1]
    rows = [SampleRow(SamplingParams(top_k=3), [], [], (), None)]
    assert filtered_probs(logits, rows)[0].nonzero().flatten().tolist() == [0, 1, 2]


def test_penalties_change_logits_as_specified() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(
        temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    from engine.sampler import apply_penalties

    row = SampleRow(params, prompt_ids=[0], output_ids=[1, 1], blocked_ids=(), generator=None)
    apply_penalties(logits[0], row)
    # token 0: prompt only -> 2/2; token 1: output twice -> -2*2 - 0.25*2 - 0.5
    assert logits[0].tolist() == pytest.approx([1.0, -5.0, 1.0, 0.5])


def test_logprobs_are_returned(llm, prompts) -> None:
    out = llm.generate_ids([prompts[0]], SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    assert len(out[0].logprobs) == 4
    for token, lp in zip(out[0].token_ids, out[0].logprobs, strict=True):
        assert lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1])
        assert len(lp.top) == 3 and lp.logprob <= 0


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"stop": ("",)}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_params_name_the_parameter(options: dict, name: str) -> None:
    with pytest.raises(SamplingError, match=name):
        SamplingParams(**options)


def test_argmax_is_argmax_with_ties_infinities_and_nan() -> None:
    generator = torch.Generator().manual_seed(0)
    for trial in range(60):
        logits = torch.randint(-3, 4, (7, 128 * 3), generator=generator).float()  # many ties
        logits[0] = float("-inf")
        logits[1, (trial * 53) % 384] = float("inf")
        if trial % 2:
            logits[2 + trial % 5, (trial * 37) % 384] = float("nan")
        for argmax in (argmax_ref, ops.argmax):
            assert torch.equal(argmax(logits), logits.argmax(dim=-1)), trial
            assert torch.equal(argmax(logits.bfloat16()), logits.argmax(dim=-1)), trial
    odd_vocab = torch.randn(3, 1000, generator=generator)  # not a multiple of the span
    assert torch.equal(argmax_ref(odd_vocab), odd_vocab.argmax(dim=-1))
