"""WorkerActor: the Ray shell around one engine and the role it plays (PrefillWorker or
DecodeWorker). Placement is decided by coordinator.builder.

The engine (weights, KV cache, prefix cache) belongs to the actor, not to the role: `set_role`
stops the current role (its requests fail and are placed again by the coordinator) and starts the
other around the same engine, so a switch costs milliseconds, not a model load.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
import torch

from decode.worker import DecodeWorker
from engine.config import ConfigError, EngineConfig
from engine.engine import LLMEngine
from kernels.core_share import CorePacer
from kernels.threads import use_threads
from kvtransfer.transport import Transport, make_transport
from prefill.worker import PrefillReport, PrefillWorker
from protocol.kv import Endpoint, Ticket
from protocol.messages import PrefillResult, WorkRequest
from protocol.stats import EngineHealth, WorkerStats
from protocol.telemetry import Telemetry, read_telemetry
from worker.ranks import ray_launcher

ROLES = ("prefill", "decode")
log = logging.getLogger(__name__)


class RoleError(RuntimeError):
    """A call meant for the other role (it arrived while the worker switched)."""


def local_model(folder: str | Path, host: str) -> Path:
    """The model folder on this worker's node. The head names it; on another node it must be at
    the same path (or on a shared filesystem), except the default model, which a node lacking it
    fetches into its own cache, as the head did."""
    from engine.fetch import DEFAULT_MODEL_NAME, default_model_dir, fetch_default_model

    folder = Path(folder)
    if folder.is_dir():
        return folder
    if folder.name == DEFAULT_MODEL_NAME and folder.parent.name == "models":
        log.info("fetching the default model on %s (the head's copy is not here)", host)
        return fetch_default_model(log=lambda line: log.info("%s", line))
    raise ConfigError(
        f"model folder {folder} is not on node {host}: every node that runs workers needs the "
        f"model at the same path (or a shared filesystem); default_model_dir here is "
        f"{default_model_dir()}"
    )


class WorkerActor:
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        transport: str | Transport,  # a registered name, or a transport made by the caller
        transfer_timeout: float,
        num_threads: int,
        role: str,
        host: str | None = None,
        verify_kv: bool = True,
        kv_fault: str | None = None,  # tests only: see kvtransfer/faults.py
        placement: tuple[Any, dict[str, float]] | None = None,  # TP: group, bundle resources
        core_share: str | None = None,  # this host's core ledger: kernels/core_share.py
    ) -> None:
        # The engine thread alone runs parallel ops with `num_threads`; this thread loads the
        # model on one, so the process holds one OpenMP team (kernels/threads.py).
        use_threads(1)
        self.num_threads = num_threads
        self.core_share = core_share
        self.worker_id = worker_id
        self.transfer_timeout = transfer_timeout
        self.verify_kv = verify_kv
        self.host = host or ray.util.get_node_ip_address()
        config = replace(config, model=local_model(config.model, self.host))
        launch = None
        if config.tensor_parallel_size > 1:
            if placement is None:
                raise ValueError("a tensor-parallel worker needs its placement group")
            launch = ray_launcher(*placement, num_threads)
        self.engine = LLMEngine(config, launch)
        if self.engine.runner.ranks is not None:
            self.engine.runner.ranks.on_lost = self._rank_lost
        if isinstance(transport, str):
            transport = make_transport(transport, torch.device(config.device))
        if kv_fault is not None:
            from kvtransfer.faults import FaultyTransport

            transport = FaultyTransport.from_spec(transport, kv_fault)
        self.transport = transport
        self.role = role
        self.worker: PrefillWorker | DecodeWorker = self._start(role)
        # The ~360,000 objects loaded by now (torch, Ray, the model's modules) live as long as
        # the worker: out of the cycle collector's sight, a full collection no longer stalls
        # the engine thread rescanning them (~0.3 s in the serving process, coordinator/api/
        # server.py).
        gc.collect()
        gc.freeze()

    def _start(self, role: str) -> PrefillWorker | DecodeWorker:
        pace = None
        if self.core_share is not None and self.engine.runner.ranks is None:
            try:
                pace = CorePacer(self.core_share)  # on the cores of the host it landed on
            except OSError as err:  # no shared memory to map here: keep the fixed split
                log.warning("worker %s steps on a fixed thread count: %s", self.worker_id, err)
        if role == "prefill":
            return PrefillWorker(
                self.worker_id,
                self.engine,
                self.transport,
                self.transfer_timeout,
                num_threads=self.num_threads,
                pace=pace,
            )
        return DecodeWorker(
            self.worker_id,
            self.engine,
            self.transport,
            self.transfer_timeout,
            self.host,
            self.verify_kv,
            num_threads=self.num_threads,
            pace=pace,
        )

    # -- both roles ------------------------------------------------------------------------

    async def node_id(self) -> str:
        """The Ray node this worker landed on."""
        return ray.get_runtime_context().get_node_id()

    def _rank_lost(self, rank: int) -> None:
        """A tensor-parallel worker lives or dies as a whole: a lost rank ends this process
        (even when idle, where no collective would notice), and the coordinator replaces it."""
        log.error("worker %s lost tensor-parallel rank %d: exiting", self.worker_id, rank)
        os._exit(1)

    async def pid(self) -> int:
        return os.getpid()

    async def ping(self) -> int:
        """Answers once the model is loaded: the context length this worker serves."""
        return self.engine.max_model_len

    async def health(self) -> EngineHealth:
        """Answers at once from any state: whether the engine thread lives and steps."""
        return self.worker.thread.health()

    async def set_role(self, role: str) -> float:
        """Stops the current role and starts `role` on the same engine; the seconds it took."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        started = time.perf_counter()
        if role != self.role:
            await asyncio.to_thread(self.worker.shutdown)
            self.worker, self.role = self._start(role), role
        return time.perf_counter() - started

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.worker.stats())

    async def telemetry(self, step_seq: int, prefix_seq: int) -> Telemetry:
        """Step records and prefix-cache events logged from those numbers on (the engine
        outlives role switches, and so do its logs). Never waits on the engine thread."""
        engine = self.engine
        return read_telemetry(
            engine.step_log, engine.prefix_log, engine.cached_prefixes, step_seq, prefix_seq
        )

    # -- prefill ---------------------------------------------------------------------------

    async def prefill(self, request: WorkRequest, ticket: Ticket) -> PrefillResult:
        """Returns once the request's KV and first token are with its decode worker."""
        worker = self._as(PrefillWorker)
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future = loop.create_future()

        def settle(_: str, report: PrefillReport | Exception) -> None:
            result = report if isinstance(report, Exception) else report.result
            loop.call_soon_threadsafe(_set, outcome, result)

        worker.submit(request, ticket, settle)
        try:
            return await outcome
        except asyncio.CancelledError:
            worker.abort(request.request_id)
            raise

    async def forget_peer(self, decode_id: str) -> None:
        """A decode worker left its pool: a prefill worker closes its channels to it (each
        holds a thread and sockets); in any other role there is nothing to close."""
        if isinstance(self.worker, PrefillWorker):
            await asyncio.wrap_future(self.worker.forget_peer(decode_id))

    # -- decode ----------------------------------------------------------------------------

    async def reserve(
        self,
        request: WorkRequest,
        prefill_id: str,
        broken_key: str | None = None,
        prefill_tp: int = 1,
        lease_s: float | None = None,
    ) -> Ticket | None:
        decode = self._as(DecodeWorker)
        reserving = decode.reserve(request, prefill_id, broken_key, prefill_tp, lease_s)
        return await asyncio.wrap_future(reserving)

    async def add_local(self, request: WorkRequest) -> None:
        await asyncio.wrap_future(self._as(DecodeWorker).add_local(request))

    async def stream_updates(self, endpoint: Endpoint, secret: str) -> None:
        """Connects to the coordinator at `endpoint` and pushes this worker's token updates
        there, one frame per engine step, until the role ends or the connection breaks."""
        await asyncio.to_thread(self._as(DecodeWorker).stream_updates, endpoint, secret)

    def _as(self, kind: type) -> PrefillWorker | DecodeWorker:
        worker = self.worker
        if not isinstance(worker, kind):
            raise RoleError(f"worker {self.worker_id} now serves as {self.role}")
        return worker


def _set(future: asyncio.Future, result: PrefillResult | Exception) -> None:
    if future.done():
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
