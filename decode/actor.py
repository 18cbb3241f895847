"""DecodeActor: the Ray shell around DecodeWorker. Placement is decided by coordinator.builder."""

from __future__ import annotations

import asyncio

import ray
import torch

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from kvtransfer.transport import make_transport
from protocol.kv import Ticket
from protocol.messages import WorkerUpdate, WorkRequest
from protocol.stats import EngineHealth, WorkerStats


class DecodeActor:
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        transport: str,
        transfer_timeout: float,
        num_threads: int,
        host: str | None,
    ) -> None:
        torch.set_num_threads(num_threads)
        host = host or ray.util.get_node_ip_address()
        channel_transport = make_transport(transport, torch.device(config.device))
        self.worker = DecodeWorker(worker_id, config, channel_transport, transfer_timeout, host)

    async def node_id(self) -> str:
        """The Ray node this worker landed on."""
        return ray.get_runtime_context().get_node_id()

    async def health(self) -> EngineHealth:
        """Answers at once from any state: whether the engine thread lives and steps."""
        return self.worker.thread.health()

    async def ping(self) -> int:
        """Answers once the model is loaded: the context length this worker serves."""
        return self.worker.engine.max_model_len

    async def reserve(self, request: WorkRequest, prefill_id: str) -> Ticket | None:
        return await asyncio.wrap_future(self.worker.reserve(request, prefill_id))

    async def add_local(self, request: WorkRequest) -> None:
        await asyncio.wrap_future(self.worker.add_local(request))

    async def abort(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self.worker.abort(request_id))

    async def updates(self, timeout: float) -> list[WorkerUpdate]:
        """Long poll: every token update since the last call, for all requests at once."""
        return await asyncio.to_thread(self.worker.take_updates, timeout)

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.worker.stats())
