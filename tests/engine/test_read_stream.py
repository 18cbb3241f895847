"""read_stream: outputs that queued up while the reader was busy come out as one, with every
token and character of text; a reader that keeps up sees each output alone."""

from __future__ import annotations

import asyncio

import pytest

from engine.outputs import RequestOutput, StreamFailed, read_stream


def output(tokens: list[int], new: int, finished: bool = False) -> RequestOutput:
    text = "".join(f"<{t}>" for t in tokens)
    return RequestOutput(
        "r",
        [1, 2],
        token_ids=tokens,
        text=text,
        delta_token_ids=tokens[len(tokens) - new :],
        delta_text="".join(f"<{t}>" for t in tokens[len(tokens) - new :]),
        finish_reason="length" if finished else None,
    )


async def drain(stream: asyncio.Queue) -> list[RequestOutput]:
    return [out async for out in read_stream(stream)]


async def first(stream: asyncio.Queue) -> RequestOutput:
    async for out in read_stream(stream):
        return out
    raise AssertionError("no output")


def test_outputs_queued_while_the_reader_was_busy_come_out_joined() -> None:
    stream: asyncio.Queue = asyncio.Queue()
    for item in (output([5], 1), output([5, 6], 1), output([5, 6, 7, 8], 2)):
        stream.put_nowait(item)
    got = asyncio.run(first(stream))
    assert got.delta_token_ids == [5, 6, 7, 8] and got.delta_text == "<5><6><7><8>"
    assert got.token_ids == [5, 6, 7, 8] and got.text == "<5><6><7><8>" and not got.finished


def test_the_finished_output_ends_the_join_and_the_stream() -> None:
    stream: asyncio.Queue = asyncio.Queue()
    stream.put_nowait(output([5], 1))
    stream.put_nowait(output([5, 6], 1, finished=True))
    stream.put_nowait(output([5, 6, 7], 1))  # never read: the stream ended before it
    got = asyncio.run(drain(stream))
    assert [o.delta_token_ids for o in got] == [[5, 6]]
    assert got[0].finished and got[0].delta_text == got[0].text == "<5><6>"


def test_a_reader_that_keeps_up_sees_every_output() -> None:
    async def run() -> list[RequestOutput]:
        stream: asyncio.Queue = asyncio.Queue()

        async def produce() -> None:
            tokens: list[int] = []
            for t in range(4):
                tokens = [*tokens, t]
                stream.put_nowait(output(tokens, 1, finished=t == 3))
                await asyncio.sleep(0.01)

        producer = asyncio.create_task(produce())
        got = await drain(stream)
        await producer
        return got

    assert [o.delta_token_ids for o in asyncio.run(run())] == [[0], [1], [2], [3]]


def test_a_failure_behind_queued_outputs_comes_after_them() -> None:
    stream: asyncio.Queue = asyncio.Queue()
    stream.put_nowait(output([5], 1))
    stream.put_nowait(output([5, 6], 1))
    stream.put_nowait(StreamFailed(RuntimeError("worker lost")))
    seen: list[RequestOutput] = []

    async def run() -> None:
        async for out in read_stream(stream):
            seen.append(out)

    with pytest.raises(RuntimeError, match="worker lost"):
        asyncio.run(run())
    assert [o.delta_token_ids for o in seen] == [[5, 6]]
