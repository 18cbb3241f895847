"""The ranks of a tensor-parallel engine: rank 0 leads, the others follow its step plan.

Rank 0 runs the whole engine (scheduler, block manager, sampler); ranks 1..N-1 hold only
their model shard and KV cache. Each step rank 0 sends every follower the step's batch as
plain lists over a TCP connection, then all ranks run the forward pass together (the
all-reduces inside keep them in step), so every rank writes the same slots of its own KV
heads:

    rank 0:  schedule -> send BatchSpec -> forward -> sample -> update
    rank r:              read BatchSpec -> forward

A follower waits for its next batch with no deadline (an idle engine sends nothing); the
connection closing (rank 0 gone) ends it.

Beside the forward pass a follower may play a part in its worker's role, through the
`FollowerHooks` its spec names (worker/rank_roles.py: each rank sends or receives the KV heads
it holds). On the same connection:

    rank 0 -> rank r   ["step", batch, extra]   extra: what the hooks need for this step
                       ["call", request, n]     answered by ["reply", [n, ok, answer]]
    rank r -> rank 0   ["event", body]          any time, from any thread of rank r

The collectives have the process group's deadline, so a rank that dies or hangs mid-step
fails the step on every rank, and the engine with it: a tensor-parallel worker lives or dies
as a whole.

Who starts the followers is the caller's: `spawn_followers` (local processes, for
`tandem generate` and tests) or a Ray launcher that places one actor per rank
(worker/ranks.py).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import multiprocessing
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import msgpack
import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from engine.config import EngineConfig
from engine.model import LayerHook
from kernels.threads import use_threads
from protocol.kv import Endpoint
from protocol.wire import HEADER, frame, frame_length

log = logging.getLogger(__name__)
HELLO = "tandem-rank/1"


class BatchSpec(NamedTuple):
    """One step's batch as plain lists (engine/forward_batch.py has its meaning)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    logits_rows: list[int]
    decode_tables: list[list[int]]
    decode_lens: list[int]
    prefills: list[tuple[int, int, list[int], int]]  # start, end, block table, context_len


class FollowerSpec(NamedTuple):
    """Everything a follower needs to join rank 0."""

    config: EngineConfig
    rank: int
    size: int
    num_blocks: int
    store: Endpoint  # the process group's rendezvous
    control: Endpoint  # where rank 0 sends batches
    secret: str
    num_threads: int
    timeout: float  # seconds any collective, or joining, may take
    hooks: HooksFactory | None = None  # a module-level callable, so the spec pickles


class FollowerHooks(Protocol):
    """A follower's part in its worker's role, beside the forward pass."""

    def call(self, request: list) -> object:
        """Answers a `RankGroup.call` from rank 0, on the follower's main thread."""

    def step(self, extra: object, forward: Callable[[LayerHook | None], None]) -> None:
        """Runs one step: `forward(on_layer)` is the forward pass; `extra` what rank 0 sent."""


class RemoteError(RuntimeError):
    """A follower's hooks raised while answering a call."""


# Builds a follower's hooks: (its runner, its spec, emit) -> FollowerHooks, where emit(body)
# sends an event to rank 0 from any thread.
HooksFactory = Callable[[Any, FollowerSpec, Callable[[object], None]], FollowerHooks]
EventHandler = Callable[[int, object], None]


# Starts one follower somewhere and returns at once, with what must stay referenced for the
# follower to live (its process, its Ray actor handle).
Launcher = Callable[[FollowerSpec], object]


class RankGroup:
    """Rank 0's side: starts the followers, then sends each of them every step's batch."""

    def __init__(self, config: EngineConfig, num_blocks: int, launch: Launcher) -> None:
        size, timeout = config.tensor_parallel_size, config.rank_timeout
        self.size = size
        self._store = TCPStore("127.0.0.1", 0, is_master=True, timeout=_delta(timeout))
        self._server = socket.create_server(("127.0.0.1", 0))
        secret = secrets.token_hex(16)
        self._launched = [
            launch(
                FollowerSpec(
                    config, rank, size, num_blocks,
                    Endpoint("127.0.0.1", self._store.port),
                    Endpoint(*self._server.getsockname()[:2]),
                    secret, torch.get_num_threads(), timeout,
                )
            )
            for rank in range(1, size)
        ]  # fmt: skip
        self._secret, self._timeout = secret, timeout
        self._followers: list[socket.socket] = []
        self._replies: list[queue.SimpleQueue] = []
        self.on_event: EventHandler | None = None  # (rank, body), on a reader thread
        self.on_lost: Callable[[int], None] | None = None  # (rank): its connection ended
        self._lost: set[int] = set()
        self._closing = False
        self._calls = 0  # numbers each call: a reply that missed its deadline answers no other

    def join(self, device: torch.device) -> dist.ProcessGroup:
        """The ranks' process group, once every follower has joined it."""
        return process_group(device, self._store, 0, self.size, self._timeout)

    def wait_ready(self) -> None:
        """Waits for every follower to connect (each does once its shard is loaded);
        TimeoutError past the config's rank_timeout."""
        deadline = time.monotonic() + self._timeout
        joined: dict[int, socket.socket] = {}
        while len(joined) < self.size - 1:
            self._server.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                connection, _ = self._server.accept()
            except TimeoutError:
                missing = self.size - 1 - len(joined)
                raise TimeoutError(f"{missing} tensor-parallel rank(s) did not start") from None
            connection.settimeout(self._timeout)
            hello = _read(connection)
            if not isinstance(hello, list) or hello[:2] != [HELLO, self._secret]:
                connection.close()
                continue
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            joined[int(hello[2])] = connection
        self._server.close()
        self._followers = [joined[rank] for rank in range(1, self.size)]
        for rank, connection in enumerate(self._followers, start=1):
            replies: queue.SimpleQueue = queue.SimpleQueue()
            self._replies.append(replies)
            threading.Thread(
                target=self._read_follower,
                args=(rank, connection, replies),
                name="tandem-rank-reader",
                daemon=True,
            ).start()

    def send(self, spec: BatchSpec, extra: object = None) -> None:
        """Every follower gets the batch (and `extra`, for its hooks); OSError when one is
        gone."""
        message = frame(["step", list(spec), extra])
        for connection in self._followers:
            connection.sendall(message)

    def call(self, request: list) -> list[object]:
        """Every follower's hooks answer `request` (in rank order). Raises RemoteError when
        one's hooks raise, TimeoutError past the rank deadline, OSError when one is gone.
        One caller at a time (the engine thread)."""
        if self._lost:  # at once: no waiting out the deadline for a rank that cannot answer
            raise RemoteError(f"tensor-parallel rank(s) {sorted(self._lost)} gone")
        self._calls += 1
        number = self._calls
        message = frame(["call", request, number])
        for connection in self._followers:
            connection.sendall(message)
        deadline = time.monotonic() + self._timeout
        answers = []
        for rank, replies in enumerate(self._replies, start=1):
            while True:  # replies to earlier calls, late or left by a raise, are passed over
                try:
                    answered, ok, answer = replies.get(
                        timeout=max(deadline - time.monotonic(), 0.001)
                    )
                except queue.Empty:
                    raise TimeoutError(f"tensor-parallel rank {rank} did not answer") from None
                if answered in (number, None):  # None: the rank is gone
                    break
            if not ok:
                raise RemoteError(f"tensor-parallel rank {rank}: {answer}")
            answers.append(answer)
        return answers

    def close(self) -> None:
        """Followers see their connection close and exit."""
        self._closing = True
        for connection in self._followers:
            # shutdown first: it also wakes this side's reader thread (a plain close does not)
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self._followers.clear()

    def _read_follower(
        self, rank: int, connection: socket.socket, replies: queue.SimpleQueue
    ) -> None:
        while True:
            try:
                kind, body = _read(connection, patient=True)
            except (OSError, EOFError, ValueError):
                self._lost.add(rank)
                replies.put((None, False, "the rank is gone"))
                if not self._closing and self.on_lost is not None:
                    self.on_lost(rank)
                return
            if kind == "reply":
                replies.put(body)
            elif self.on_event is not None:
                try:
                    self.on_event(rank, body)
                except Exception:
                    log.exception("handling an event of tensor-parallel rank %d failed", rank)


def process_group(
    device: torch.device, store: TCPStore, rank: int, size: int, timeout: float
) -> dist.ProcessGroup:
    """nccl on CUDA, gloo on CPU; every collective on it fails after `timeout` seconds.
    Returns once all `size` ranks have joined."""
    store = dist.PrefixStore("tp/", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _delta(timeout)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, _delta(timeout))


def follow(spec: FollowerSpec) -> None:
    """A follower's whole life: join, load the shard, then run each batch rank 0 sends until
    its connection closes. Any error ends it (and, through the collectives, the step)."""
    from engine.runner import ModelRunner  # the runner imports this module

    use_threads(spec.num_threads)
    store = TCPStore(
        spec.store.host, spec.store.port, is_master=False, timeout=_delta(spec.timeout)
    )
    group = process_group(
        torch.device(spec.config.device), store, spec.rank, spec.size, spec.timeout
    )
    runner = ModelRunner.follower(spec, group)
    connection = socket.create_connection(tuple(spec.control), timeout=spec.timeout)
    connection.settimeout(None)  # an idle engine sends nothing for as long as it is idle
    connection.sendall(frame([HELLO, spec.secret, spec.rank]))
    writing = threading.Lock()

    def write(body: object) -> None:
        message = frame(body)
        with writing:
            connection.sendall(message)

    hooks = spec.hooks(runner, spec, lambda body: write(["event", body])) if spec.hooks else None
    try:
        while True:
            try:
                kind, *body = _read(connection)
            except (ConnectionError, EOFError):
                return  # rank 0 closed or died
            if kind == "call":
                request, number = body
                write(["reply", [number, *_answer(hooks, request)]])
                continue
            batch, extra = BatchSpec(*body[0]), body[1]
            if hooks is not None and extra is not None:
                hooks.step(extra, functools.partial(runner.run_spec, batch))
            else:
                runner.run_spec(batch)
    finally:
        connection.close()


def _answer(hooks: FollowerHooks | None, request: list) -> tuple[bool, object]:
    if hooks is None:
        return False, "this rank has no hooks"
    try:
        return True, hooks.call(request)
    except Exception as err:  # the caller hears it; the rank goes on
        log.exception("tensor-parallel call %s failed", request[:1])
        return False, f"{type(err).__name__}: {err}"


def spawn_followers(spec: FollowerSpec) -> multiprocessing.Process:
    """A Launcher: the follower in a local process that dies with its connection."""
    process = multiprocessing.get_context("spawn").Process(
        target=_follow_logged, args=(spec,), daemon=True, name=f"tandem-rank-{spec.rank}"
    )
    process.start()
    return process


def _follow_logged(spec: FollowerSpec) -> None:
    try:
        follow(spec)
    except Exception:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        raise


def _read(connection: socket.socket, patient: bool = False) -> Any:
    """One frame's body. `patient`: the socket's timeout (kept for sends) does not end a
    wait for the next frame, nor one in the middle of a frame."""
    header = _read_exactly(connection, HEADER.size, patient)
    return msgpack.unpackb(_read_exactly(connection, frame_length(header), patient))


def _read_exactly(connection: socket.socket, count: int, patient: bool = False) -> bytes:
    chunks, left = [], count
    while left:
        try:
            chunk = connection.recv(min(left, 1 << 20))
        except TimeoutError:
            if patient:
                continue
            raise
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
