"""PrefillActor: the Ray shell around PrefillWorker. Placement is decided by coordinator.builder."""

from __future__ import annotations

import asyncio

import ray
import torch

from engine.config import EngineConfig
from kvtransfer.transport import make_transport
from prefill.worker import PrefillReport, PrefillWorker
from protocol.kv import Ticket
from protocol.messages import PrefillResult, WorkRequest
from protocol.stats import EngineHealth, WorkerStats


class PrefillActor:
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        transport: str,
        transfer_timeout: float,
        num_threads: int,
    ) -> None:
        torch.set_num_threads(num_threads)
        channel_transport = make_transport(transport, torch.device(config.device))
        self.worker = PrefillWorker(worker_id, config, channel_transport, transfer_timeout)

    async def node_id(self) -> str:
        """The Ray node this worker landed on."""
        return ray.get_runtime_context().get_node_id()

    async def health(self) -> EngineHealth:
        """Answers at once from any state: whether the engine thread lives and steps."""
        return self.worker.thread.health()

    async def ping(self) -> int:
        """Answers once the model is loaded: the context length this worker serves."""
        return self.worker.engine.max_model_len

    async def prefill(self, request: WorkRequest, ticket: Ticket) -> PrefillResult:
        """Returns once the request's KV and first token are with its decode worker."""
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future = loop.create_future()

        def settle(_: str, report: PrefillReport | Exception) -> None:
            result = report if isinstance(report, Exception) else report.result
            loop.call_soon_threadsafe(_set, outcome, result)

        self.worker.submit(request, ticket, settle)
        try:
            return await outcome
        except asyncio.CancelledError:
            self.worker.abort(request.request_id)
            raise

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.worker.stats())


def _set(future: asyncio.Future, result: PrefillResult | Exception) -> None:
    if future.done():
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
