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
from protocol.stats import PoolWorker, WorkerStats


class EngineClient(Protocol):
    model_name: str  # the id served at /v1/models
    tokenizer: Tokenizer
    max_model_len: int  # prompt + output tokens one request may hold

    def check_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raises RequestError (or SamplingError) for a request no worker can serve."""

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's output each time it has new tokens; the last one is finished.
        Leaving the iteration early (or being cancelled) aborts the request and frees its KV.
        Raises RequestError (bad request) or EngineDeadError (no worker can serve it)."""

    def stats(self) -> list[WorkerStats]:
        """A snapshot per worker, for /metrics. Cheap; never blocks on a worker."""

    async def ready(self) -> None:
        """Returns once every worker is up; raises if one failed to start. Called once, when
        the server starts; it also starts the backend's background loops."""

    def pools(self) -> list[PoolWorker]:
        """Every worker with its pool and state (for /admin/pools and /metrics)."""

    def recent_steps(self, worker_id: str | None, limit: int | None) -> dict:
        """Each worker's latest engine step records (protocol/telemetry.py) as
        {worker: {"steps_total", "steps_missed", "steps": [record dicts]}}."""

    def scale(self, sizes: dict[str, int]) -> None:
        """Sets pool sizes, e.g. {"decode": 2}; raises PoolError where pools are fixed."""

    def drain(self, worker_id: str) -> None:
        """No new requests for the worker; it leaves once its requests are done (KeyError:
        no such worker; PoolError where pools are fixed)."""

    async def switch_role(self, worker_id: str, role: str) -> float:
        """Moves a worker between the prefill and decode pools without reloading its model;
        the seconds until it is routable again (KeyError, PoolError as for drain)."""

    def readiness(self) -> str | None:
        """None while the backend can serve (every pool has a live worker), else why not.
        Reads state only: never waits on a worker, starts nothing."""

    async def shutdown(self) -> None: ...
