"""EngineClient: what the HTTP app needs from a backend.

Two backends implement it: `engine.async_engine.AsyncEngine` (one colocated engine in this
process) and the disaggregated `coordinator.Coordinator` (prefill and decode pools on Ray). The
HTTP layer never knows which one it talks to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.outputs import RequestOutput
from engine.tokenizer import Tokenizer
from protocol.sampling import SamplingParams
from protocol.stats import WorkerStats


class EngineClient(Protocol):
    model_name: str  # the id served at /v1/models
    tokenizer: Tokenizer
    max_model_len: int  # prompt + output tokens one request may hold

    def check_request(self, prompt_ids: list[int]) -> None:
        """Raises engine.engine.RequestError for a prompt no worker can serve."""

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's output each time it has new tokens; the last one is finished.
        Leaving the iteration early (or being cancelled) aborts the request and frees its KV.
        Raises RequestError (bad request) or EngineDeadError (no worker can serve it)."""

    def stats(self) -> list[WorkerStats]:
        """A snapshot per worker, for /metrics. Cheap; never blocks on a worker."""

    async def ready(self) -> None:
        """Returns once every worker is up; raises if one failed to start."""

    async def shutdown(self) -> None: ...
