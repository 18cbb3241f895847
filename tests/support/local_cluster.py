"""A real Coordinator over real WorkerActors in this process: no Ray, but the production code
everywhere else (engines, KV transports, update streams over local TCP, retries, supervision).

A LocalHandle stands for a Ray actor handle: `handle.method.remote(*args)` returns the actor
method's coroutine, which the coordinator awaits under its deadline, as it awaits an ObjectRef.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from coordinator.coordinator import Coordinator, CoordinatorConfig
from coordinator.supervisor import SupervisorConfig
from engine.config import EngineConfig, ModelConfig
from kvtransfer.transport import Transport
from tests.support.fake_workers import FakeTokenizer
from worker.actor import WorkerActor


class LocalHandle:
    def __init__(self, actor: WorkerActor) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.actor, name)
        return _Remote(method)


class _Remote:
    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any) -> Any:
        return self.method(*args)


@contextlib.asynccontextmanager
async def local_cluster(
    config: EngineConfig,
    prefill_transport: Transport,
    decode_transport: Transport,
    transfer_timeout: float,
    coordinator_config: CoordinatorConfig | None = None,
) -> AsyncIterator[tuple[Coordinator, WorkerActor, WorkerActor]]:
    """One prefill and one decode worker (one torch thread each) behind a started Coordinator.
    Token ids decode to letters (tests compare ids, not text)."""
    model = ModelConfig.from_pretrained(config.model)
    prefill = WorkerActor("prefill-0", config, prefill_transport, transfer_timeout, 1, "prefill",
                          host="127.0.0.1")  # fmt: skip
    decode = WorkerActor("decode-0", config, decode_transport, transfer_timeout, 1, "decode",
                         host="127.0.0.1")  # fmt: skip
    coordinator = Coordinator(
        model_name="local",
        tokenizer=FakeTokenizer(),  # type: ignore[arg-type]
        max_model_len=config.max_model_len or model.max_model_len,
        vocab_size=model.vocab_size,
        eos_ids=frozenset(model.eos_token_ids),
        prefill={"prefill-0": LocalHandle(prefill)},
        decode={"decode-0": LocalHandle(decode)},
        config=coordinator_config
        or CoordinatorConfig(
            block_size=config.block_size,
            supervision=SupervisorConfig(probe_interval=0.25, probe_timeout=2.0),
        ),
    )
    await coordinator.ready()
    try:
        yield coordinator, prefill, decode
    finally:
        await coordinator.shutdown()
        prefill.worker.shutdown()
        decode.worker.shutdown()
