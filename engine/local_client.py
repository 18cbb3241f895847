"""LocalEngineClient: one colocated engine in this process, behind the HTTP app's EngineClient
protocol (`coordinator.api.client`).

It wraps an `LLMEngine` stepping in `AsyncEngine`'s thread. The engine thread starts on the
event loop that first calls `ready()` or `generate()`, and that loop must serve every later
call (the engine delivers outputs to it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from engine.tokenizer import Tokenizer
from protocol.errors import PoolError
from protocol.sampling import SamplingParams
from protocol.stats import PoolWorker, WorkerStats

WORKER_NAME = "colocated-0"
STUCK_AFTER_S = 60.0  # an engine with work that has not stepped for this long is stuck
FIXED_POOL = "this server runs one engine in its own process: its pool is fixed"


class LocalEngineClient:
    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self._async = AsyncEngine(engine, tokenizer)
        self._started = False

    @classmethod
    def from_config(cls, config: EngineConfig, model_name: str | None = None) -> LocalEngineClient:
        """Loads the model; `model_name` defaults to the model folder's name."""
        engine = LLMEngine(config)
        tokenizer = Tokenizer(engine.model_config.path)
        return cls(engine, tokenizer, model_name or Path(config.model).name)

    def check_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        self.engine.check_request(prompt_ids, params)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        self._started = True  # AsyncEngine starts its thread on the first generate
        return self._async.generate(prompt_ids, params, request_id)

    def stats(self) -> list[WorkerStats]:
        # Read from the event loop while the engine thread steps: the counts may be a step
        # stale (each is one read under the GIL), which is fine for metrics.
        snapshot = self.engine.snapshot()
        return [WorkerStats.of(WORKER_NAME, "colocated", snapshot, **self._async.step_fields())]

    def recent_steps(self, worker_id: str | None, limit: int | None) -> dict:
        """The engine's latest step records, under its worker name."""
        if worker_id not in (None, WORKER_NAME):
            return {}
        return {WORKER_NAME: self._async.recent_steps(None, limit)["engine"]}

    def pools(self) -> list[PoolWorker]:
        if not self._started:
            state = "starting"
        else:
            state = "serving" if self.readiness() is None else "dead"
        return [PoolWorker(WORKER_NAME, "colocated", state, 0)]

    def scale(self, sizes: dict[str, int]) -> None:
        raise PoolError(FIXED_POOL)

    def drain(self, worker_id: str) -> None:
        raise PoolError(FIXED_POOL)

    async def switch_role(self, worker_id: str, role: str) -> float:
        raise PoolError(FIXED_POOL)

    def readiness(self) -> str | None:
        if not self._started:
            return "the engine has not started"
        health = self._async.health()
        return None if health is None else health.problem(stuck_after=STUCK_AFTER_S)

    async def ready(self) -> None:
        if not self._started:
            self._started = True
            self._async.start()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._async.shutdown)
