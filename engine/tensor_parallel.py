"""The ranks of a tensor-parallel engine: rank 0 leads, the others follow its step plan.

Rank 0 runs the whole engine (scheduler, block manager, sampler); ranks 1..N-1 hold only
their model shard and KV cache. Each step rank 0 sends every follower the step's batch as
plain lists over a TCP connection, then all ranks run the forward pass together (the
all-reduces inside keep them in step), so every rank writes the same slots of its own KV
heads:

    rank 0:  schedule -> send BatchSpec -> forward -> sample -> update
    rank r:              read BatchSpec -> forward

A follower waits for its next batch with no deadline (an idle engine sends nothing); the
connection closing (rank 0 gone) ends it. The collectives have the process group's
deadline, so a rank that dies or hangs mid-step fails the step on every rank, and the engine
with it: a tensor-parallel worker lives or dies as a whole.

Who starts the followers is the caller's: `spawn_followers` (local processes, for
`tandem generate` and tests) or a Ray launcher that places one actor per rank
(worker/ranks.py).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import secrets
import socket
import time
from collections.abc import Callable
from typing import NamedTuple

import msgpack
import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from engine.config import EngineConfig
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

    def join(self, device: torch.device) -> dist.ProcessGroup:
        """The ranks' process group, once every follower has joined it."""
        return process_group(device, self._store, 0, self.size, self._timeout)

    def wait_ready(self) -> None:
        """Waits for every follower to connect (each does once its shard is loaded);
        TimeoutError past the config's rank_timeout."""
        deadline = time.monotonic() + self._timeout
        while len(self._followers) < self.size - 1:
            self._server.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                connection, _ = self._server.accept()
            except TimeoutError:
                missing = self.size - 1 - len(self._followers)
                raise TimeoutError(f"{missing} tensor-parallel rank(s) did not start") from None
            connection.settimeout(self._timeout)
            if _read(connection) != [HELLO, self._secret]:
                connection.close()
                continue
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._followers.append(connection)
        self._server.close()

    def send(self, spec: BatchSpec) -> None:
        """Every follower gets the batch; OSError when one is gone."""
        message = frame(list(spec))
        for connection in self._followers:
            connection.sendall(message)

    def close(self) -> None:
        """Followers see their connection close and exit."""
        for connection in self._followers:
            connection.close()
        self._followers.clear()


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

    torch.set_num_threads(spec.num_threads)
    store = TCPStore(
        spec.store.host, spec.store.port, is_master=False, timeout=_delta(spec.timeout)
    )
    group = process_group(
        torch.device(spec.config.device), store, spec.rank, spec.size, spec.timeout
    )
    runner = ModelRunner.follower(spec, group)
    connection = socket.create_connection(tuple(spec.control), timeout=spec.timeout)
    connection.settimeout(None)  # an idle engine sends nothing for as long as it is idle
    connection.sendall(frame([HELLO, spec.secret]))
    try:
        while True:
            try:
                body = _read(connection)
            except (ConnectionError, EOFError):
                return  # rank 0 closed or died
            runner.run_spec(BatchSpec(*body))
    finally:
        connection.close()


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


def _read(connection: socket.socket) -> object:
    header = _read_exactly(connection, HEADER.size)
    return msgpack.unpackb(_read_exactly(connection, frame_length(header)))


def _read_exactly(connection: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = connection.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
