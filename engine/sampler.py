"""Sampler: next-token choice for each sequence of a step, from its logits (float32 math).

Seeded requests draw from their own generator, one uniform number per token (`uniform`), so a
seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.structured import apply_allowed
from kernels import ops
from protocol.sampling import PromptLogprob, SamplingParams, TokenLogprobs


class SampleRow(NamedTuple):
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    blocked_ids: tuple[int, ...]  # tokens forbidden this step (EOS while under min_tokens)
    generator: torch.Generator | None
    allowed: torch.Tensor | None = None  # a response format's bitmask (engine/structured.py)


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
    """logits: [S, vocab] in any float dtype, one row per entry of `rows`."""
    if all(
        row.params.greedy
        and not row.params.adjusts_logits
        and not row.blocked_ids
        and row.allowed is None
        for row in rows
    ):
        # Plain greedy rows (the common batch) need no float32 copy of the logits.
        token_ids = ops.argmax(logits).tolist()
        return SamplerOutput(token_ids, _logprobs(logits, rows, token_ids))
    logits = logits.float()
    raw = logits
    if any(row.params.adjusts_logits for row in rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.params.adjusts_logits:
                apply_penalties(logits[i], row)
    if any(row.blocked_ids for row in rows):
        logits = logits.clone() if logits is raw else logits
        for i, row in enumerate(rows):
            logits[i, list(row.blocked_ids)] = float("-inf")
    if any(row.allowed is not None for row in rows):
        logits = logits.clone() if logits is raw else logits
        for i, row in enumerate(rows):
            if row.allowed is not None:
                apply_allowed(logits[i], row.allowed)
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if len(random_rows) == len(rows):
        tokens = _sample_random(logits, rows)
    else:
        tokens = ops.argmax(logits)
        if random_rows:
            picked = _sample_random(logits[random_rows], [rows[i] for i in random_rows])
            tokens[random_rows] = picked
    token_ids = tokens.tolist()
    return SamplerOutput(token_ids, _logprobs(raw, rows, token_ids))


# Bound of a penalized logit: any temperature above GREEDY_TEMPERATURE keeps it finite.
PENALIZED_LIMIT = 1e30


def apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:
    """In place on one row [vocab]: repetition over prompt + output, presence and frequency
    over the output only, then the logit bias."""
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(list(row.prompt_ids) + list(row.output_ids), dtype=torch.int64)
        values = logits[seen]
        penalized = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
        # A tiny or huge penalty would push a logit to infinity, and softmax to NaN.
        logits[seen] = penalized.clamp_(-PENALIZED_LIMIT, PENALIZED_LIMIT)
    if row.output_ids and (p.presence_penalty or p.frequency_penalty):
        output = torch.tensor(list(row.output_ids), dtype=torch.int64)
        counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias, strict=True)
        logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)


def _sample_random(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    temperatures = [row.params.temperature for row in rows]
    if any(t != 1.0 for t in temperatures):
        logits = logits / torch.tensor(temperatures, device=logits.device).unsqueeze(1)
    probs = filtered_probs(logits, rows)
    u = torch.cat([uniform(row.generator) for row in rows]).to(logits.device)
    return inverse_cdf(probs, u)


CDF_BLOCK = 256  # tokens per block of inverse_cdf's two-level search


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row, the first token whose cumulative probability passes u (in [0, 1)) times
    the row's total: a draw from `probs` with one random number. Two levels: the block of
    CDF_BLOCK tokens first, by the running float64 sum of the blocks' masses, then the token
    inside it, by a float64 running sum over that block alone (a float32 running sum over a
    whole vocabulary would shift the tail tokens' odds; a float64 one over every token costs
    more than the rest of the sampler). probs: [R, vocab] float32; u: [R] float64."""
    rows, vocab = probs.shape
    blocks = torch.nn.functional.pad(probs, (0, -vocab % CDF_BLOCK)).view(rows, -1, CDF_BLOCK)
    ends = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [R, num_blocks]
    target = (u * ends[:, -1]).unsqueeze(1)
    block = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[1] - 1)
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp_(min=0)), 0.0)
    chosen = blocks[torch.arange(rows, device=probs.device), block.squeeze(1)]  # [R, CDF_BLOCK]
    offset = torch.searchsorted(
        chosen.double().cumsum(dim=-1), target - before, right=True
    ).squeeze(1)
    # Summed in another order, the block's tokens may end a hair short of the target: then
    # the block's last token that has any probability.
    last = CDF_BLOCK - 1 - (chosen > 0).flip(1).int().argmax(dim=1)
    picked = block.squeeze(1) * CDF_BLOCK + torch.where(offset < CDF_BLOCK, offset, last)
    return picked.clamp_(max=vocab - 1)  # (a row with no mass at all, NaN logits: never padding)


def uniform(generator: torch.Generator | None) -> torch.Tensor:
    """The one draw a sampled token takes from its request's generator: [1] float64 in [0, 1)."""
    return torch.rand(1, dtype=torch.float64, generator=generator)


def filtered_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Softmax over the tokens that survive top_k, top_p and min_p, each judged on the
    unfiltered distribution; the most likely token always survives. logits: [R, vocab]."""
    probs = logits.softmax(dim=-1)
    vocab = probs.shape[1]
    top_k = [min(row.params.top_k or vocab, vocab) for row in rows]
    top_p = [row.params.top_p for row in rows]
    min_p = [row.params.min_p for row in rows]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
        return probs  # nothing to filter (the default request): no ranking, no mask
    keep = torch.ones_like(probs, dtype=torch.bool)
    if any(k < vocab for k in top_k):
        keep &= _top_k_mask(probs, top_k)
    if any(p < 1.0 for p in top_p):
        keep &= _top_p_mask(probs, top_p)
    if any(min_p):
        peak = probs.max(dim=-1, keepdim=True).values
        keep &= probs >= torch.tensor(min_p, device=probs.device).unsqueeze(1) * peak
    keep.scatter_(1, ops.argmax(probs).unsqueeze(1), True)
    kept = probs.masked_fill_(~keep, 0.0)
    return kept.div_(kept.sum(dim=-1, keepdim=True))


def _top_k_mask(probs: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """The k most likely tokens of each row (ties at the edge broken by topk's order); a row
    with k = vocab keeps every token."""
    vocab = probs.shape[1]
    limited = [i for i, k in enumerate(top_k) if k < vocab]
    ks = torch.tensor([top_k[i] for i in limited], device=probs.device).unsqueeze(1)
    order = _rows(probs, limited).topk(int(ks.max()), dim=-1).indices
    keep = torch.ones_like(probs, dtype=torch.bool)
    keep[limited] = torch.zeros_like(keep[limited]).scatter_(
        1, order, torch.arange(order.shape[1], device=probs.device) < ks
    )
    return keep


TOP_P_HEADS = (256, 4096)  # tokens ranked first; a nucleus wider than both sorts its row


def _top_p_mask(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """The smallest head of each row, most likely first, whose mass reaches top_p (a token
    stays while the mass ranked before it is at most top_p). Ranks the first 256 tokens, then
    4,096, then the whole row, stopping as soon as the nucleus ends inside what is ranked."""
    vocab = probs.shape[1]
    keep = torch.ones_like(probs, dtype=torch.bool)
    todo = [i for i, p in enumerate(top_p) if p < 1.0]
    for head in (*(h for h in TOP_P_HEADS if h < vocab), vocab):
        if not todo:
            break
        values, order = _rows(probs, todo).topk(head, dim=-1)
        limits = torch.tensor([top_p[i] for i in todo], device=probs.device).unsqueeze(1)
        inside = values.cumsum(dim=-1) - values <= limits
        ends_inside = ~inside[:, -1] if head < vocab else torch.ones_like(inside[:, 0])
        done = [i for i, flag in zip(todo, ends_inside.tolist(), strict=True) if flag]
        if done:
            keep[done] = torch.zeros_like(keep[done]).scatter_(
                1, order[ends_inside], inside[ends_inside]
            )
        todo = [i for i, flag in zip(todo, ends_inside.tolist(), strict=True) if not flag]
    return keep


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x's rows `rows`, without a copy when that is all of them."""
    return x if len(rows) == x.shape[0] else x[rows]


PROMPT_ROWS = 256  # prompt positions scored at once: [rows, vocab] float32 is the peak


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top_n: int) -> list[PromptLogprob]:
    """Row i of `logits` [positions, vocab] scores prompt token `targets[i]`: its logprob
    (from the raw logits, as the sampled tokens' are), rank and the `top_n` likeliest."""
    out: list[PromptLogprob] = []
    for start in range(0, len(targets), PROMPT_ROWS):
        chunk = logits[start : start + PROMPT_ROWS].float().log_softmax(dim=-1)
        wanted = torch.tensor(targets[start : start + PROMPT_ROWS], device=chunk.device)
        chosen = chunk.gather(1, wanted[:, None])  # [rows, 1]
        ranks = (chunk > chosen).sum(dim=1) + 1
        if top_n:
            values, ids = chunk.topk(top_n, dim=1)
            tops = [
                list(zip(i, v, strict=True))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            ]
        else:
            tops = [[] for _ in range(len(chosen))]
        out.extend(
            PromptLogprob(lp, rank, top)
            for lp, rank, top in zip(chosen[:, 0].tolist(), ranks.tolist(), tops, strict=True)
        )
    return out


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
