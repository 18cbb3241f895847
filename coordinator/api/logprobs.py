"""Log probabilities in the two OpenAI shapes: completions (parallel lists, text offsets) and
chat (one entry per token with its UTF-8 bytes)."""

from __future__ import annotations

from coordinator.api.responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from engine.outputs import RequestOutput
from engine.tokenizer import Tokenizer
from protocol.sampling import TokenLogprobs


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
    return output.token_ids, list((output.logprobs or [])[:end])


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


def _top_by_text(texts: TokenTexts, entry: TokenLogprobs, sampled: str) -> dict[str, float]:
    """The alternatives and, as the completions API promises (up to logprobs + 1 entries), the
    sampled token even where it is not among them."""
    # Keyed by text, so two tokens with one text (partial UTF-8 bytes both show as U+FFFD)
    # share an entry: the first, most likely one keeps it.
    top: dict[str, float] = {}
    for token_id, logprob in entry.top:
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
