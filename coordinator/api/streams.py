"""Async stream plumbing: closing streams promptly, and merging several into one.

An async generator left half-read is only finalized when it is garbage collected; a backend
stream aborts its request (and frees its KV blocks) in its `finally`, so every stream we stop
reading is closed explicitly instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

T = TypeVar("T")


@asynccontextmanager
async def closing(stream: AsyncIterator[T]) -> AsyncIterator[AsyncIterator[T]]:
    """Closes `stream` on the way out, if it can be closed (async generators can)."""
    try:
        yield stream
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def fan_in(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of all `streams` as (stream index, item), in arrival order. The first failure
    propagates; leaving early or failing cancels and closes every stream."""
    if len(streams) == 1:  # no task and no queue hop on the common path
        async with closing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    arrivals: asyncio.Queue[tuple[int, T | None, BaseException | None]] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, s, arrivals)) for i, s in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item, error = await arrivals.get()
            if error is not None:
                raise error
            if item is None:
                num_open -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(
    index: int,
    stream: AsyncIterator[T],
    arrivals: asyncio.Queue[tuple[int, T | None, BaseException | None]],
) -> None:
    try:
        async with closing(stream):
            async for item in stream:
                arrivals.put_nowait((index, item, None))
        arrivals.put_nowait((index, None, None))  # this stream is done
    except Exception as err:  # handed to the reader, which raises it
        arrivals.put_nowait((index, None, err))
