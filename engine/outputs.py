"""What frontends hand to users: a request's tokens and text so far."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from protocol.sampling import PromptLogprob, TokenLogprobs


@dataclass
class RequestOutput:
    """A request's state as a user sees it: tokens, text, and the part new since last time."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # stop token id or stop string that ended it
    num_cached_tokens: int = 0
    queue_seconds: float | None = None  # arrival until the request first got KV blocks
    # SamplingParams.prompt_logprobs: one per prompt token (None for the first), from the
    # output with the first token on
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StreamFailed(NamedTuple):
    """The last item of a request's output stream when it ended in an error instead."""

    error: Exception


async def read_stream(
    stream: asyncio.Queue[RequestOutput | StreamFailed],
) -> AsyncIterator[RequestOutput]:
    """Yields a request's outputs up to the finished one; raises the error of a StreamFailed.

    Outputs that queued up while the reader was busy are yielded as one (their deltas joined):
    a reader that falls behind the engine, at thousands of tokens a second, then pays once per
    wake-up rather than once per token. A reader that keeps up sees every output alone."""
    while True:
        item = await stream.get()
        while not isinstance(item, StreamFailed) and not item.finished and not stream.empty():
            later = stream.get_nowait()
            if isinstance(later, StreamFailed):  # what came before the failure, then the error
                yield item
                item = later
                break
            item = joined(item, later)
        if isinstance(item, StreamFailed):
            raise item.error
        yield item
        if item.finished:
            return


def joined(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`later`, carrying `earlier`'s new tokens and text as well (every other field of an
    output is the request's state so far, which `later` holds)."""
    return replace(
        later,
        delta_token_ids=earlier.delta_token_ids + later.delta_token_ids,
        delta_text=earlier.delta_text + later.delta_text,
    )
