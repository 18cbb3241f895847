"""Fake prefill and decode actors, so the Coordinator runs without Ray, a model or torch.

A FakeHandle stands for a Ray actor handle: `handle.method.remote(*args)` returns a coroutine
(the coordinator awaits it under a deadline) and is recorded in `handle.calls`. Setting
`handle.dead` makes every later call raise RayActorError, as a dead actor's calls do, and closes
its update stream, as a dead process's sockets close.

A fake decode worker pushes its updates over a real connection to the coordinator's
UpdateServer, in the real framing: the coordinator's reading path is the production one.

Every request's output is OUTPUT[:max_tokens], whichever workers and attempts produce it: a
worker resumes from the request's `output_ids`, so a retried request must still stream exactly
those tokens. The decode worker starts a request's tokens once its KV "arrives" (the prefill
worker's call, or at once for a local prefill), and its first batch repeats the prefill worker's
token, as the real one does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest
from ray.exceptions import RayActorError

from coordinator.coordinator import Coordinator, CoordinatorConfig
from coordinator.planner_loop import PlannerSetup
from coordinator.supervisor import SupervisorConfig
from protocol.kv import Endpoint, KVLayout, Ticket
from protocol.messages import PrefillResult, RequestFailed, TokenUpdate, WorkerUpdate, WorkRequest
from protocol.sampling import FinishReason
from protocol.stats import EngineHealth, WorkerStats
from protocol.telemetry import Telemetry
from protocol.wire import hello, pack_updates

OUTPUT = [10, 11, 12, 13, 14, 15, 16, 17]  # every request's tokens, in order
MAX_MODEL_LEN = 512
VOCAB_SIZE = 64
LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=16, dtype="float32")


class FakeTokenizer:
    """Token id n decodes to one letter, chr(ord("a") + n % 26): 10 -> "k", 11 -> "l", ..."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)

    def decode_stream(self, context: list[int], skip_special_tokens: bool) -> None:
        return None  # not a `tokenizers` tokenizer: the detokenizer keeps its window in Python


def text_of(token_ids: list[int]) -> str:
    return FakeTokenizer().decode(token_ids)


class FakeMethod:
    def __init__(self, handle: FakeHandle, name: str, fn: Callable[..., Coroutine]) -> None:
        self._handle, self._name, self._fn = handle, name, fn

    def remote(self, *args: Any) -> Coroutine:
        self._handle.calls[self._name].append(args)
        if self._handle.dead:
            return _raise(RayActorError(error_msg=f"{self._handle.actor.worker_id} died"))
        return self._fn(*args)


class FakeHandle:
    def __init__(self, actor: FakePrefillActor | FakeDecodeActor) -> None:
        self.actor = actor
        self.make_role: Callable[[str, str], Any] = _no_roles
        self.set_role_seconds = 0.0  # an engine that takes this long to stop and restart
        self._dead = False
        self.calls: dict[str, list[tuple]] = defaultdict(list)

    @property
    def dead(self) -> bool:
        return self._dead

    @dead.setter
    def dead(self, dead: bool) -> None:
        self._dead = dead
        if dead:
            self.actor.die()

    def __getattr__(self, name: str) -> FakeMethod:
        if name == "set_role":  # the actor object changes; the handle (the process) stays
            return FakeMethod(self, name, self._set_role)
        return FakeMethod(self, name, getattr(self.actor, name))

    async def _set_role(self, role: str) -> float:
        await asyncio.sleep(self.set_role_seconds)
        self.actor.die()  # the old role's update stream ends with it
        self.actor.stopped = True  # and its engine thread: calls still running fail
        self.actor = self.make_role(role, self.actor.worker_id)
        return 0.0

    def ids(self, method: str) -> list[str]:
        """The worker request ids this method was called about, in call order."""
        return [_request_id(args[0]) for args in self.calls.get(method, [])]


class _FakeProcess:
    """What every fake worker answers the same way: ping (after loading) and health."""

    max_model_len = MAX_MODEL_LEN
    stopped = False  # its role ended (set_role): calls still running fail
    frozen = False  # like a SIGSTOPped process: no call answers
    ping_delay = 0.0  # seconds its model takes to load

    async def ping(self) -> int:
        if self.frozen:  # never placed, or stopped before its model loaded
            await asyncio.Event().wait()
        await asyncio.sleep(self.ping_delay)
        return self.max_model_len

    async def health(self) -> EngineHealth:
        if self.frozen:
            await asyncio.Event().wait()
        return EngineHealth(alive=True, busy=False, seconds_since_progress=0.0, error=None)

    async def telemetry(self, step_seq: int, prefix_seq: int) -> Telemetry:
        """The records a test put in `steps`, from `step_seq` on; no prefix cache."""
        if self.frozen:
            await asyncio.Event().wait()
        steps = getattr(self, "steps", [])
        return Telemetry(len(steps), steps[step_seq:], 0, prefix_seq, [], None)

    async def forget_peer(self, decode_id: str) -> None:
        return None  # the call is what tests look at (FakeHandle.calls)

    def die(self) -> None:
        """The process is gone: whatever it had open closes."""


class FakeDecodeActor(_FakeProcess):
    """Emits each active request's next `batch` tokens per step. `failures` maps a worker
    request id to the number of tokens after which that attempt is reported lost
    (RequestFailed); `stall_after` stops every request's tokens after that many; `repeat`
    sends every batch twice; `room` False makes every reservation fail (None)."""

    def __init__(self, worker_id: str, eos_ids: frozenset[int] = frozenset()) -> None:
        self.worker_id = worker_id
        self.eos_ids = eos_ids
        self.batch = 2
        self.repeat = False
        self.room = True
        self.free_blocks = 100
        self.failures: dict[str, int] = {}
        self.stall_after: int | None = None
        self.reserved: dict[str, WorkRequest] = {}  # KV not arrived yet
        self.active: dict[str, tuple[WorkRequest, int]] = {}  # request, next output index
        self._wake = asyncio.Event()
        self._pusher: asyncio.Task | None = None
        self.step_seconds = 0.002
        self.reserve_seconds = 0.0  # how long a reservation takes to answer

    async def reserve(
        self,
        work: WorkRequest,
        prefill_id: str,
        broken_key: str | None = None,
        prefill_tp: int = 1,
        lease_s: float | None = None,
    ) -> Ticket | None:
        if self.frozen:
            await asyncio.Event().wait()
        await asyncio.sleep(self.reserve_seconds)
        if self.stopped:
            raise RuntimeError("engine thread stopped")  # what a worker whose role ended says
        if not self.room:
            return None
        self.reserved[work.request_id] = work
        num_tokens = len(work.token_ids)
        rendezvous = Endpoint("127.0.0.1", 1)
        return Ticket(
            work.request_id, self.worker_id, rendezvous, "key", 0, num_tokens, LAYOUT, 5.0
        )

    async def add_local(self, work: WorkRequest) -> None:
        self.reserved[work.request_id] = work
        self.kv_arrived(work.request_id)

    def kv_arrived(self, request_id: str) -> None:
        work = self.reserved.pop(request_id)
        self.active[request_id] = (work, len(work.output_ids))
        self._wake.set()

    async def abort(self, request_id: str) -> bool:
        found = self.active.pop(request_id, None) or self.reserved.pop(request_id, None)
        return found is not None

    async def stream_updates(self, endpoint: Endpoint, secret: str) -> None:
        if self.frozen:
            await asyncio.Event().wait()
        self.die()
        _, writer = await asyncio.open_connection(*endpoint)
        writer.write(hello(self.worker_id, secret))
        self._pusher = asyncio.ensure_future(self._push(writer))

    def die(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()

    async def _push(self, writer: asyncio.StreamWriter) -> None:
        """One frame per step while requests are active, as the real publisher sends."""
        try:
            while True:
                if self.frozen:
                    await asyncio.Event().wait()
                updates = self._step()
                if updates:
                    writer.write(pack_updates(updates))
                    await writer.drain()
                    await asyncio.sleep(self.step_seconds)
                else:
                    self._wake.clear()
                    await self._wake.wait()
        finally:
            writer.close()

    async def stats(self) -> WorkerStats:
        if self.frozen:
            await asyncio.Event().wait()
        return WorkerStats(self.worker_id, "decode", num_free_blocks=self.free_blocks)

    def _step(self) -> list[WorkerUpdate]:
        updates: list[WorkerUpdate] = []
        for request_id, (work, index) in list(self.active.items()):
            update = self._next(work, index)
            if update is None:
                continue
            updates.extend([update, update] if self.repeat else [update])
            if isinstance(update, RequestFailed) or update.finish_reason is not None:
                del self.active[request_id]
            else:
                self.active[request_id] = (work, update.num_output_tokens)
        return updates

    def _next(self, work: WorkRequest, index: int) -> WorkerUpdate | None:
        done_here = index - len(work.output_ids)  # tokens this attempt produced so far
        limits = [work.params.max_tokens, index + self.batch]
        if work.request_id in self.failures:
            limits.append(len(work.output_ids) + self.failures[work.request_id])
            if done_here >= self.failures[work.request_id]:
                return RequestFailed(work.request_id, "kv cache lost")
        if self.stall_after is not None:
            limits.append(len(work.output_ids) + self.stall_after)
        tokens = OUTPUT[index : min(limits)]
        if not tokens:
            return None
        stop_ids = work.params.stop_ids(self.eos_ids)
        stop = next((t for t in tokens if t in stop_ids), None)
        if stop is not None:
            tokens = tokens[: tokens.index(stop) + 1]
        end = index + len(tokens)
        finish = FinishReason.STOP if stop is not None else None
        if finish is None and end == work.params.max_tokens:
            finish = FinishReason.LENGTH
        logprobs = [None] * len(tokens)
        return TokenUpdate(work.request_id, index, tokens, logprobs, finish, stop)


class FakePrefillActor(_FakeProcess):
    """Hands the decode worker named by the ticket its KV and returns the first token.
    `failures` maps a worker request id to the error its prefill raises; a request id in
    `hangs` never answers."""

    def __init__(self, worker_id: str, decodes: dict[str, FakeDecodeActor]) -> None:
        self.worker_id = worker_id
        self.decodes = decodes
        self.failures: dict[str, Exception] = {}
        self.hangs: set[str] = set()
        self.handover_seconds = 0.02  # how long ago its results say the prefill step ended
        self.queue_seconds = 0.375  # what its results say each request waited for KV blocks

    async def prefill(self, work: WorkRequest, ticket: Ticket) -> PrefillResult:
        if work.request_id in self.failures:
            raise self.failures[work.request_id]
        if work.request_id in self.hangs or self.frozen:
            await asyncio.Event().wait()
        self.decodes[ticket.decode_id].kv_arrived(work.request_id)
        token_id = OUTPUT[len(work.output_ids)]
        age_s = self.handover_seconds  # as if the KV took this long
        return PrefillResult(
            work.request_id, token_id, None, 0, ticket.num_bytes, age_s, self.queue_seconds
        )

    async def abort(self, request_id: str) -> None:
        return None

    async def stats(self) -> WorkerStats:
        if self.frozen:
            await asyncio.Event().wait()
        return WorkerStats(self.worker_id, "prefill", num_free_blocks=100)


class FakeCluster:
    """A Coordinator over `num_prefill` fake prefill and `num_decode` fake decode workers."""

    def __init__(
        self,
        config: CoordinatorConfig,
        num_prefill: int = 2,
        num_decode: int = 1,
        eos_ids: frozenset[int] = frozenset(),
        spawn: bool = False,
        planner: PlannerSetup | None = None,
    ) -> None:
        decodes = {
            f"decode-{i}": FakeDecodeActor(f"decode-{i}", eos_ids) for i in range(num_decode)
        }
        prefills = {
            f"prefill-{i}": FakePrefillActor(f"prefill-{i}", decodes) for i in range(num_prefill)
        }
        self.decodes, self.eos_ids = decodes, eos_ids
        self.decode = {w: FakeHandle(actor) for w, actor in decodes.items()}
        self.prefill = {w: FakeHandle(actor) for w, actor in prefills.items()}
        self.spawned: list[str] = []
        for handle in (*self.decode.values(), *self.prefill.values()):
            handle.make_role = self.make_role
        self.coordinator = Coordinator(
            "fake", FakeTokenizer(), MAX_MODEL_LEN, VOCAB_SIZE, eos_ids,  # type: ignore[arg-type]
            self.prefill, self.decode, config, spawn=self.spawn if spawn else None,
            planner=planner,
        )  # fmt: skip

    def make_role(self, role: str, worker_id: str) -> FakePrefillActor | FakeDecodeActor:
        """The fake actor a worker becomes in `role` (what WorkerActor.set_role does)."""
        if role == "prefill":
            self.decodes.pop(worker_id, None)
            return FakePrefillActor(worker_id, self.decodes)
        self.decodes[worker_id] = FakeDecodeActor(worker_id, self.eos_ids)
        return self.decodes[worker_id]

    def spawn(self, pool: str) -> tuple[str, FakeHandle]:
        """A new fake worker of `pool`, as the builder's spawner would start a real one."""
        worker_id = f"{pool}-new{len(self.spawned)}"
        self.spawned.append(worker_id)
        if pool == "prefill":
            handle = FakeHandle(FakePrefillActor(worker_id, self.decodes))
            handle.make_role = self.make_role
            self.prefill[worker_id] = handle
        else:
            self.decodes[worker_id] = FakeDecodeActor(worker_id, self.eos_ids)
            handle = FakeHandle(self.decodes[worker_id])
            handle.make_role = self.make_role
            self.decode[worker_id] = handle
        return worker_id, handle

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Coordinator]:
        """The coordinator, ready (workers pinged, polls started) and shut down after."""
        await self.coordinator.ready()
        try:
            yield self.coordinator
        finally:
            await self.coordinator.shutdown()

    def decoder(self, worker_id: str = "decode-0") -> FakeDecodeActor:
        return self.decode[worker_id].actor  # type: ignore[return-value]

    def prefiller(self, worker_id: str = "prefill-0") -> FakePrefillActor:
        return self.prefill[worker_id].actor  # type: ignore[return-value]


def _request_id(arg: object) -> str:
    return arg.request_id if isinstance(arg, WorkRequest) else str(arg)


async def _raise(err: Exception) -> Any:
    raise err


def _no_roles(role: str, worker_id: str) -> Any:
    raise RuntimeError("this fake worker cannot change roles")


ADMIN_SUPERVISION = SupervisorConfig(probe_interval=0.02, probe_timeout=0.2, restart_backoff=0.01)


@contextlib.contextmanager
def served_fake_cluster(
    monkeypatch: pytest.MonkeyPatch,
    api_key: str,
    num_prefill: int = 1,
    num_decode: int = 1,
    planner: PlannerSetup | None = None,
) -> Iterator[tuple[FakeCluster, str]]:
    """A real HTTP server (the app and the Coordinator) over fake workers that can be spawned,
    with fast polls and probes and no Ray: (the cluster, the server's URL)."""
    from coordinator.api.app import create_app
    from coordinator.api.settings import ServerSettings
    from tests.support.servers import ServerThread

    monkeypatch.setattr("ray.kill", lambda handle: None)
    config = CoordinatorConfig(block_size=4, supervision=ADMIN_SUPERVISION)
    cluster = FakeCluster(config, num_prefill, num_decode, spawn=True, planner=planner)
    cluster.coordinator.tokenizer.encode = lambda text, **_: [1, 2, 3, 4, 5, 6]
    app = create_app(cluster.coordinator, ServerSettings(api_key=api_key))
    server = ServerThread(app).start()
    try:
        yield cluster, server.url
    finally:
        server.stop()
