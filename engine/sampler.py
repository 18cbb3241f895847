"""Sampler: next-token choice for each sequence of a step, from its logits (float32 math).

Seeded requests draw their noise from their own generator, one draw of `vocab` values per token,
so a seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels import ops
from protocol.sampling import SamplingParams, TokenLogprobs


class SampleRow(NamedTuple):
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    blocked_ids: tuple[int, ...]  # tokens forbidden this step (EOS while under min_tokens)
    generator: torch.Generator | None


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
    """logits: [S, vocab] in any float dtype, one row per entry of `rows`."""
    if all(
        row.params.greedy and not row.params.has_penalties and not row.blocked_ids for row in rows
    ):
        # Plain greedy rows (the common batch) need no float32 copy of the logits.
        token_ids = ops.argmax(logits).tolist()
        return SamplerOutput(token_ids, _logprobs(logits, rows, token_ids))
    logits = logits.float()
    raw = logits
    if any(row.params.has_penalties for row in rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.params.has_penalties:
                apply_penalties(logits[i], row)
    if any(row.blocked_ids for row in rows):
        logits = logits.clone() if logits is raw else logits
        for i, row in enumerate(rows):
            logits[i, list(row.blocked_ids)] = float("-inf")
    tokens = ops.argmax(logits)
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if random_rows:
        picked = _sample_random(logits[random_rows], [rows[i] for i in random_rows])
        tokens[random_rows] = picked
    token_ids = tokens.tolist()
    return SamplerOutput(token_ids, _logprobs(raw, rows, token_ids))


def apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:
    """In place on one row [vocab]: repetition over prompt + output, presence and frequency
    over the output only."""
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(list(row.prompt_ids) + list(row.output_ids), dtype=torch.int64)
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if row.output_ids and (p.presence_penalty or p.frequency_penalty):
        output = torch.tensor(list(row.output_ids), dtype=torch.int64)
        counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _sample_random(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    temperature = torch.tensor([row.params.temperature for row in rows]).unsqueeze(1)
    probs = filtered_probs(logits / temperature, rows)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i.
    noise = torch.stack([_exponential(probs.shape[1], row.generator) for row in rows])
    return (probs / noise).argmax(dim=-1)


def _exponential(size: int, generator: torch.Generator | None) -> torch.Tensor:
    return torch.empty(size).exponential_(generator=generator)


def filtered_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Softmax over the tokens that survive top_k, top_p and min_p. logits: [R, vocab]."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(vocab).unsqueeze(0)
    top_k = torch.tensor([min(row.params.top_k or vocab, vocab) for row in rows])
    top_p = torch.tensor([row.params.top_p for row in rows])
    min_p = torch.tensor([row.params.min_p for row in rows])
    drop = rank >= top_k.unsqueeze(1)
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p.unsqueeze(1)
    drop |= sorted_probs < (min_p * sorted_probs[:, 0]).unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def _logprobs(
    logits: torch.Tensor, rows: list[SampleRow], token_ids: list[int]
) -> list[TokenLogprobs | None]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    logprobs = logits[wanted].float().log_softmax(dim=-1)
    for j, i in enumerate(wanted):
        top_n = rows[i].params.logprobs
        values, ids = logprobs[j].topk(top_n) if top_n else (torch.empty(0), torch.empty(0))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
        result[i] = TokenLogprobs(logprobs[j, token_ids[i]].item(), top)
    return result
