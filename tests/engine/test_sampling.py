"""Sampling: seeds, top_k=1, stop strings and token limits, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampler import CDF_BLOCK, SampleRow, filtered_probs, inverse_cdf, sample
from kernels import ops
from kernels.argmax import argmax_ref
from protocol.errors import RequestError
from protocol.sampling import MAX_STOP_STRINGS, SamplingError, SamplingParams


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


def test_a_resumed_seeded_request_continues_its_stream(llm, prompts) -> None:
    """A request moved to another engine after 5 tokens (output_ids) draws on from where its
    generator was: the same 12 tokens as the request left alone."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
    whole = llm.generate_ids([prompts[1]], params)[0].token_ids
    engine = llm.engine
    engine.add_request("resumed", prompts[1], params, output_ids=whole[:5])
    seq = engine.sequences["resumed"]
    while engine.has_unfinished:
        engine.step()
    assert seq.output_token_ids == whole


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


def test_logit_bias_forces_or_bans_tokens_and_leaves_batch_neighbours_alone(llm, prompts) -> None:
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate_ids([prompts[0]], plain)[0].token_ids
    forced = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={7: 100})
    banned = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logit_bias={first[0]: -100}
    )
    hot = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                         logit_bias={7: 100})  # fmt: skip
    out = llm.generate_ids([prompts[0]] * 4, [plain, forced, banned, hot])
    assert out[0].token_ids == first  # its batch neighbours' biases are theirs alone
    assert out[1].token_ids == [7] * 6
    assert first[0] not in out[2].token_ids
    assert out[3].token_ids == [7] * 6  # +100 leaves the rest no probability worth a draw


def test_logit_bias_token_ids_are_checked_against_the_vocabulary(llm, prompts) -> None:
    with pytest.raises(SamplingError, match="logit_bias token ids must be in"):
        llm.generate_ids([prompts[0]], SamplingParams(logit_bias={10**6: 1.0}))


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
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": dict.fromkeys(range(2000), 1.0)}, "logit_bias"),
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


def nucleus_by_sorting(probs: torch.Tensor, top_p: float) -> list[int]:
    """The top_p rule on a fully sorted row: a token stays while the mass before it <= top_p."""
    values, order = probs.sort(descending=True)
    inside = values.cumsum(0) - values <= top_p if top_p < 1 else True  # 1: no filter
    kept = order[inside & (values > 0)]  # (0: underflowed)
    return sorted(kept.tolist())


@pytest.mark.parametrize("spread", [0.5, 3.0, 40.0])
def test_top_p_ranks_a_head_first_and_keeps_the_sorted_nucleus(spread: float) -> None:
    """Peaked rows end their nucleus inside the first 256 ranked tokens, flat ones past 4,096
    (the whole row is sorted then): the kept tokens are the sorted rule's either way."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 10_000, generator=generator) * spread
    top_p = [0.5, 0.9, 0.95, 1.0]
    rows = [SampleRow(SamplingParams(top_p=p), [], [], (), None) for p in top_p]
    probs = filtered_probs(logits, rows)
    for i, p in enumerate(top_p):
        expected = nucleus_by_sorting(logits[i].softmax(-1), p)
        assert probs[i].nonzero().flatten().tolist() == expected, (spread, p)
        assert probs[i].sum().item() == pytest.approx(1.0, abs=1e-5)


def test_top_k_and_min_p_and_top_p_each_judge_the_unfiltered_row() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05]] * 3))
    rows = [
        SampleRow(SamplingParams(top_k=4, top_p=0.5), [], [], (), None),  # top_p keeps 2
        SampleRow(SamplingParams(top_k=2, min_p=0.1), [], [], (), None),  # top_k keeps 2
        SampleRow(SamplingParams(), [], [], (), None),  # no filter on this row
    ]
    kept = [row.nonzero().flatten().tolist() for row in filtered_probs(logits, rows)]
    assert kept == [[0, 1], [0, 1], [0, 1, 2, 3, 4]]


def test_inverse_cdf_draws_each_token_at_its_probability() -> None:
    """4,000 evenly spaced u through a row of 3 blocks (the last one padded): token i is drawn
    for the u that fall in its stretch of the CDF, so counts match probabilities to within one
    draw; zero-probability tokens are never drawn, even at the ends of [0, 1)."""
    vocab = 2 * CDF_BLOCK + 37
    generator = torch.Generator().manual_seed(9)
    probs = torch.rand(vocab, generator=generator) ** 4
    probs[torch.randperm(vocab, generator=generator)[: vocab // 3]] = 0.0
    probs[-5:] = 0.0  # the last tokens cannot be drawn even by u just under 1
    probs /= probs.sum()
    draws = 4000
    u = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    picked = inverse_cdf(probs.expand(draws, vocab).contiguous(), u)
    counts = torch.bincount(picked, minlength=vocab).double()
    assert (counts[probs == 0] == 0).all()
    assert (counts - probs.double() * draws).abs().max() <= 1.0 + 1e-6
    ends = inverse_cdf(probs.expand(2, vocab).contiguous(), torch.tensor([0.0, 1 - 1e-16]))
    nonzero = probs.nonzero().flatten()
    assert ends.tolist() == [nonzero[0].item(), nonzero[-1].item()]


def test_default_sampling_draws_from_the_softmax() -> None:
    """Temperature 1 with no filter (an OpenAI request that sets nothing): seeded draws over
    many rows land on each token about as often as its probability says."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).contiguous()
    rows = [
        SampleRow(SamplingParams(), [], [], (), torch.Generator().manual_seed(i))
        for i in range(4000)
    ]
    counts = torch.bincount(torch.tensor(sample(logits, rows).token_ids), minlength=4)
    assert (counts / 4000 - probs).abs().max() < 0.03  # ~4 standard deviations


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_on_cuda_logits_stays_inside_the_filters() -> None:
    """Logits on the GPU (the engine samples them where the model left them): seeded draws,
    top_k and top_p rows, every token inside its row's filter, the greedy row its argmax."""
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 5000, generator=generator) * 4).cuda()
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=20, seed=2),
        SamplingParams(temperature=0),
    ]
    rows = [SampleRow(p, [], [], (), torch.Generator().manual_seed(7)) for p in params]
    picks = [sample(logits, rows).token_ids for _ in range(50)]
    nucleus = set(nucleus_by_sorting((logits[0].cpu() / 0.8).softmax(-1), 0.9))
    top20 = set(logits[1].cpu().topk(20).indices.tolist())
    assert all(p[0] in nucleus and p[1] in top20 for p in picks)
    assert {p[2] for p in picks} == {int(logits[2].argmax())}


def test_extreme_temperature_and_penalty_stay_finite() -> None:
    """A temperature too small to divide by is greedy; a penalty too small or large to apply
    exactly still leaves finite logits (both once gave NaN probabilities, and so the last
    token of the vocabulary every time)."""
    logits = torch.zeros(1, 1000)
    logits[0, 710], logits[0, 3], logits[0, 4] = 30.0, 20.0, 10.0
    tiny = SamplingParams(temperature=1e-38, seed=1)
    assert tiny.greedy
    row = SampleRow(tiny, [], [], (), torch.Generator().manual_seed(1))
    assert sample(logits.clone(), [row]).token_ids == [710]
    for penalty in (1e-300, 1e300):
        params = SamplingParams(temperature=0.7, repetition_penalty=penalty)
        row = SampleRow(params, [3, 4], [], (), torch.Generator().manual_seed(2))
        (token,) = sample(logits.clone(), [row]).token_ids
        # 1e-300 lifts the seen tokens 3 and 4 past everything (to the same bound); 1e300
        # sinks them to about 0, below 710
        assert token in ((3, 4) if penalty < 1 else (710,))


def test_at_most_so_many_stop_strings() -> None:
    SamplingParams(stop=tuple(f"s{i}" for i in range(MAX_STOP_STRINGS)))
    with pytest.raises(SamplingError, match="stop"):
        SamplingParams(stop=tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1)))


def test_a_refused_prompt_leaves_nothing_queued(llm, prompts) -> None:
    params = SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises(RequestError, match="empty"):
        llm.generate_ids([prompts[0], []], params)  # the second is refused
    assert not llm.engine.sequences and not llm.engine.has_unfinished
    free = llm.engine.blocks.num_free_blocks
    [out] = llm.generate_ids([prompts[0]], params)  # the next call has only its own request
    assert len(out.token_ids) == 3 and llm.engine.blocks.num_free_blocks == free
