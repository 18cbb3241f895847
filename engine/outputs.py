"""What frontends hand to users: a request's tokens and text so far."""

from __future__ import annotations

import asyncio
import copy
import operator
from collections.abc import AsyncIterator, Iterator, Sequence
from itertools import islice
from typing import NamedTuple, overload

from protocol.sampling import PromptLogprob, TokenLogprobs


class TokensSoFar(Sequence[int]):
    """The first `count` items of a list that only grows: a request's output tokens as of one
    output, without a copy. Each output copying every token so far cost O(length) per token
    (docs/performance.md); this is O(1), and equal to the list it stands for."""

    __slots__ = ("_items", "_count")

    def __init__(self, items: list[int], count: int) -> None:
        self._items, self._count = items, count

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self._items[: self._count][index]
        if not -self._count <= index < self._count:
            raise IndexError("token index out of range")
        return self._items[index % self._count]

    def __iter__(self) -> Iterator[int]:
        return islice(self._items, self._count)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokensSoFar | list | tuple):
            return len(other) == self._count and all(map(operator.eq, self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


class TextSoFar:
    """A request's text as of one output: the first `length` characters of its first `count`
    pieces, joined when first read. Pieces are only ever appended."""

    __slots__ = ("_pieces", "_count", "_length")

    def __init__(self, pieces: list[str], count: int, length: int) -> None:
        self._pieces, self._count, self._length = pieces, count, length

    def __str__(self) -> str:
        return "".join(self._pieces[: self._count])[: self._length]


class RequestOutput:
    """A request's state as a user sees it: tokens, text, and the part new since last time.

    `token_ids` and `text` are everything so far. The frontend's outputs hold them as views
    (`TokensSoFar`, `TextSoFar`) of what the request keeps, so that an output costs the same at
    token 10 and at token 10,000; `text` is joined on first read."""

    __slots__ = (
        "request_id", "prompt_token_ids", "token_ids", "_text", "delta_token_ids", "delta_text",
        "logprobs", "finish_reason", "stop_reason", "num_cached_tokens", "queue_seconds",
        "prompt_logprobs",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        token_ids: Sequence[int] = (),
        text: str | TextSoFar = "",
        delta_token_ids: list[int] | None = None,
        delta_text: str = "",
        logprobs: list[TokenLogprobs] | None = None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,  # stop token id or stop string that ended it
        num_cached_tokens: int = 0,
        queue_seconds: float | None = None,  # arrival until the request first got KV blocks
        # SamplingParams.prompt_logprobs: one per prompt token (None for the first), from the
        # output with the first token on
        prompt_logprobs: list[PromptLogprob | None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = token_ids
        self._text = text
        self.delta_token_ids = [] if delta_token_ids is None else delta_token_ids
        self.delta_text = delta_text
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.num_cached_tokens = num_cached_tokens
        self.queue_seconds = queue_seconds
        self.prompt_logprobs = prompt_logprobs

    @property
    def text(self) -> str:
        if isinstance(self._text, TextSoFar):
            self._text = str(self._text)
        return self._text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def replace(self, **changes: object) -> RequestOutput:
        """A copy with these fields changed (dataclasses.replace, for this slotted class)."""
        copied = copy.copy(self)
        for name, value in changes.items():
            setattr(copied, "_text" if name == "text" else name, value)
        return copied

    def __repr__(self) -> str:
        return (
            f"RequestOutput({self.request_id!r}, tokens={len(self.token_ids)}, "
            f"delta={self.delta_token_ids!r}, finish_reason={self.finish_reason!r})"
        )


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
    return later.replace(
        delta_token_ids=earlier.delta_token_ids + later.delta_token_ids,
        delta_text=earlier.delta_text + later.delta_text,
    )
