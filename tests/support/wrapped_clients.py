"""EngineClients that wrap the real colocated engine to make a failure or a slow backend happen
on cue."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from coordinator.api.streams import closing
from engine.local_client import LocalEngineClient
from engine.outputs import RequestOutput
from protocol.errors import EngineDeadError
from protocol.sampling import SamplingParams
from protocol.stats import PoolWorker, WorkerStats


class WrappedClient:
    def __init__(self, inner: LocalEngineClient) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.tokenizer = inner.tokenizer
        self.max_model_len = inner.max_model_len
        self.shut_down = threading.Event()

    def check_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        self.inner.check_request(prompt_ids, params)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        return self.inner.generate(prompt_ids, params, request_id)

    def stats(self) -> list[WorkerStats]:
        return self.inner.stats()

    async def ready(self) -> None:
        await self.inner.ready()

    def pools(self) -> list[PoolWorker]:
        return self.inner.pools()

    def scale(self, sizes: dict[str, int]) -> None:
        self.inner.scale(sizes)

    def drain(self, worker_id: str) -> None:
        self.inner.drain(worker_id)

    async def switch_role(self, worker_id: str, role: str) -> float:
        return await self.inner.switch_role(worker_id, role)

    def readiness(self) -> str | None:
        return self.inner.readiness()

    async def shutdown(self) -> None:
        await self.inner.shutdown()
        self.shut_down.set()


class GatedClient(WrappedClient):
    """Holds every output back until `gate` is set (readiness probes pass)."""

    def __init__(self, inner: LocalEngineClient) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        async with closing(self.inner.generate(prompt_ids, params, request_id)) as stream:
            async for output in stream:
                while not (self.gate.is_set() or request_id.startswith("ready-")):
                    await asyncio.sleep(0.01)
                yield output


class SlowClient(WrappedClient):
    """Hands each output on `delay_s` after the one before: a stream that lasts."""

    def __init__(self, inner: LocalEngineClient, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        async with closing(self.inner.generate(prompt_ids, params, request_id)) as stream:
            async for output in stream:
                if not request_id.startswith("ready-"):
                    await asyncio.sleep(self.delay_s)
                yield output


class FailingClient(WrappedClient):
    """Every request fails as if its engine died, once `fail_after` tokens are out (and
    before it finishes): outputs that queued while the reader waited come joined
    (engine.outputs.read_stream), so counting outputs would let a request finish."""

    def __init__(self, inner: LocalEngineClient, fail_after: int) -> None:
        super().__init__(inner)
        self.fail_after = fail_after

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        async with closing(self.inner.generate(prompt_ids, params, request_id)) as stream:
            sent = 0
            async for output in stream:
                yield output.replace(finish_reason=None, stop_reason=None)
                sent += len(output.delta_token_ids)
                if sent >= self.fail_after or output.finished:
                    raise EngineDeadError("decode worker lost")
