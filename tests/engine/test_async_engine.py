"""AsyncEngine: concurrent streams, early exit aborts and frees, stop strings mid-stream."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.tokenizer import Tokenizer
from protocol.errors import RequestError
from protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama) -> AsyncEngine:
    core = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", block_size=4))
    return AsyncEngine(core, Tokenizer(tiny_llama))


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list:
    return [out async for out in engine.generate(prompt, params)]


def test_streams_match_offline_generation(engine, tiny_llama) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    expected = LLM(tiny_llama, dtype="float32").generate_ids(prompts, GREEDY)

    async def main():
        try:
            return await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts))
        finally:
            engine.shutdown()

    streams = asyncio.run(main())
    for stream, want in zip(streams, expected, strict=True):
        # outputs that queued while this reader waited may come joined (engine.outputs)
        assert [t for out in stream for t in out.delta_token_ids] == want.token_ids
        assert all(out.delta_token_ids for out in stream)
        assert [out.token_ids for out in stream] == [
            want.token_ids[: sum(len(o.delta_token_ids) for o in stream[: i + 1])]
            for i in range(len(stream))
        ]
        assert "".join(out.delta_text for out in stream) == want.text
        assert stream[-1].finished and not any(out.finished for out in stream[:-1])


def test_leaving_early_aborts_and_frees_blocks(engine) -> None:
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        try:
            async for out in engine.generate([5, 6, 7, 8, 9], long):
                if len(out.token_ids) == 3:
                    break
            for _ in range(100):  # the abort reaches the engine thread within a few polls
                if engine.engine.blocks.num_free_blocks == engine.engine.num_blocks:
                    return True
                await asyncio.sleep(0.01)
            return False
        finally:
            engine.shutdown()

    assert asyncio.run(main())
    assert engine.engine.scheduler.num_unfinished == 0


def test_stop_string_ends_the_stream_trimmed(engine, tiny_llama) -> None:
    full = LLM(tiny_llama, dtype="float32").generate_ids([[5, 6, 7]], GREEDY)[0].text
    stop = full[4:6]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=stop)

    async def main():
        try:
            return await collect(engine, [5, 6, 7], params)
        finally:
            engine.shutdown()

    stream = asyncio.run(main())
    assert "".join(out.delta_text for out in stream) == full[: full.index(stop)]
    assert stream[-1].finish_reason == "stop" and stream[-1].stop_reason == stop


def test_bad_request_raises_before_streaming(engine) -> None:
    async def main():
        try:
            return await collect(engine, [], GREEDY)
        finally:
            engine.shutdown()

    with pytest.raises(RequestError, match="empty"):
        asyncio.run(main())
