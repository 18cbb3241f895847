"""Log probabilities in the two OpenAI shapes: completions (parallel lists, text offsets) and
chat (one entry per token with its UTF-8 bytes)."""

from __future__ import annotations

import itertools

from coordinator.api.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprobs,
    PromptTokenLogprob,
    TokenLogprob,
    TopLogprob,
)
from engine.outputs import RequestOutput
from engine.tokenizer import Tokenizer
from protocol.sampling import PromptLogprob, TokenLogprobs


class TokenTexts:
    """Each token id as the text logprobs show for it; cached, as the vocabulary is fixed.
    A byte-level token holding part of a character shows as U+FFFD, as in other servers."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def new_logprobs(output: RequestOutput) -> tuple[list[int], list[TokenLogprobs]]:
    """The tokens new in `output` with their logprobs. The output's logprobs list keeps
    growing after it was made, so it is sliced by token count, never read to its end."""
    end = len(output.token_ids)
    start = end - len(output.delta_token_ids)
    return output.delta_token_ids, list((output.logprobs or [])[start:end])


def all_logprobs(output: RequestOutput) -> tuple[list[int], list[TokenLogprobs]]:
    end = len(output.token_ids)
    return list(output.token_ids), list((output.logprobs or [])[:end])


def completion_logprobs(
    texts: TokenTexts, token_ids: list[int], entries: list[TokenLogprobs], offset: int
) -> CompletionLogprobs:
    """`offset`: characters of completion text before the first of these tokens."""
    tokens = [texts(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[_top_by_text(texts, e, tokens[i]) for i, e in enumerate(entries)],
        text_offset=offsets,
    )


def echoed_logprobs(
    texts: TokenTexts,
    prompt_ids: list[int],
    entries: list[PromptLogprob | None],
    top_n: int,
    completion: CompletionLogprobs,
) -> CompletionLogprobs:
    """An echoed completion's logprobs: the prompt's tokens first (the very first has none, as
    nothing comes before it), then the completion's (`completion`, whose offsets count from
    the completion's start: they go on from the prompt tokens' texts, as vLLM's do, so the
    offsets rise even where those texts are not the echoed text: a BOS token's, say)."""
    tokens = [texts(t) for t in prompt_ids]
    prompt_chars = sum(len(t) for t in tokens)
    return CompletionLogprobs(
        tokens=tokens + completion.tokens,
        token_logprobs=[None if e is None else e.logprob for e in entries]
        + completion.token_logprobs,
        top_logprobs=[
            None if e is None else _top_by_text(texts, e, tokens[i], top_n)
            for i, e in enumerate(entries)
        ]
        + completion.top_logprobs,
        text_offset=list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
        + [prompt_chars + offset for offset in completion.text_offset],
    )


def prompt_logprobs(
    texts: TokenTexts, output: RequestOutput, top_n: int | None
) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` (None where not asked for): per prompt token, a dict by token
    id of the token itself and the `top_n` likeliest there, each with its logprob, rank and
    text."""
    if top_n is None or output.prompt_logprobs is None:
        return None
    out: PromptLogprobs = []
    for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs, strict=True):
        if entry is None:
            out.append(None)
            continue
        here = {str(token_id): _prompt_entry(texts, token_id, entry.logprob, entry.rank)}
        for rank, (other, logprob) in enumerate(entry.top[:top_n], 1):
            here.setdefault(str(other), _prompt_entry(texts, other, logprob, rank))
        out.append(here)
    return out


def _prompt_entry(texts: TokenTexts, token: int, logprob: float, rank: int) -> PromptTokenLogprob:
    return PromptTokenLogprob(logprob=logprob, rank=rank, decoded_token=texts(token))


def _top_by_text(
    texts: TokenTexts,
    entry: TokenLogprobs | PromptLogprob,
    sampled: str,
    top_n: int | None = None,
) -> dict[str, float]:
    """The alternatives (the first `top_n`, or all) and, as the completions API promises (up
    to logprobs + 1 entries), the sampled token even where it is not among them."""
    # Keyed by text, so two tokens with one text (partial UTF-8 bytes both show as U+FFFD)
    # share an entry: the first, most likely one keeps it.
    top: dict[str, float] = {}
    for token_id, logprob in entry.top[:top_n]:
        top.setdefault(texts(token_id), logprob)
    top.setdefault(sampled, entry.logprob)
    return top


def chat_logprobs(
    texts: TokenTexts, token_ids: list[int], entries: list[TokenLogprobs]
) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = texts(token_id)
        top = [_top(texts(t), lp) for t, lp in entry.top]
        content.append(
            TokenLogprob(
                token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
