"""Router: picks the workers for a request. Pure Python on counts and hashes (no torch, no Ray).

Decode worker: fewest running requests, then most free KV blocks, then the longest prefix of the
prompt it has seen before (its prefix cache likely still holds it). Prefill worker: fewest queued
prompt tokens (in coarse buckets, so near-equal loads count as equal), then prefix overlap.
A prompt with fewer than `local_prefill_threshold` tokens that the chosen decode worker does not
already hold is prefilled on that decode worker (0: never).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.block_manager import block_hash

PREFILL_LOAD_BUCKET = 256  # queued tokens
REMEMBERED_PREFIXES = 4096  # block hashes remembered per worker


@dataclass
class WorkerLoad:
    worker_id: str
    running: int = 0  # requests the coordinator has placed there and not seen finish
    queued_tokens: int = 0  # prompt tokens placed there and not yet prefilled
    free_blocks: int = 0  # from the worker's last stats report
    alive: bool = True
    accepting: bool = True  # False while draining: alive, finishing its work, gets none new
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def overlap(self, hashes: list[int]) -> int:
        """How many leading blocks of the prompt this worker has seen."""
        count = 0
        for digest in hashes:
            if digest not in self.prefixes:
                break
            count += 1
        return count

    def remember(self, hashes: list[int]) -> None:
        for digest in hashes:
            self.prefixes[digest] = None
            self.prefixes.move_to_end(digest)
        while len(self.prefixes) > REMEMBERED_PREFIXES:
            self.prefixes.popitem(last=False)


def prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks, as every worker's block manager makes them."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


class NoWorkerError(RuntimeError):
    """Every worker of a pool is dead."""


@dataclass(frozen=True)
class Route:
    decode_id: str
    prefill_id: str | None  # None: prefill on the decode worker


class Router:
    def __init__(
        self, prefill_ids: list[str], decode_ids: list[str], block_size: int, local_threshold: int
    ) -> None:
        self.prefill = {w: WorkerLoad(w) for w in prefill_ids}
        self.decode = {w: WorkerLoad(w) for w in decode_ids}
        self.block_size = block_size
        self.local_threshold = local_threshold

    def route(
        self, token_ids: list[int], avoid: frozenset[str] = frozenset(), local: bool = False
    ) -> Route:
        """Picks workers (it records nothing: call `placed` as soon as the route is used).
        Workers in `avoid` (those that just failed this request) are chosen only when no
        other worker of their pool can take it. `local`: the decode worker prefills it."""
        hashes = prefix_hashes(token_ids, self.block_size)
        decode = min(
            _preferred(_open(self.decode, "decode"), avoid),
            key=lambda w: (w.running, -w.free_blocks, -w.overlap(hashes)),
        )
        uncached = len(token_ids) - decode.overlap(hashes) * self.block_size
        prefills = _preferred([w for w in self.prefill.values() if w.alive and w.accepting], avoid)
        if local or not prefills or uncached < self.local_threshold:
            return Route(decode.worker_id, None)
        prefill = min(
            prefills, key=lambda w: (w.queued_tokens // PREFILL_LOAD_BUCKET, -w.overlap(hashes))
        )
        return Route(decode.worker_id, prefill.worker_id)

    def placed(self, route: Route, token_ids: list[int]) -> None:
        hashes = prefix_hashes(token_ids, self.block_size)
        self.decode[route.decode_id].running += 1
        self.decode[route.decode_id].remember(hashes)
        if route.prefill_id is not None:
            self.prefill[route.prefill_id].queued_tokens += len(token_ids)
            self.prefill[route.prefill_id].remember(hashes)

    def unplace(self, route: Route, token_ids: list[int]) -> None:
        """Undoes `placed` for a route that was not taken after all (no room, no answer)."""
        self.prefilled(route, len(token_ids))
        self.finished(route)

    def prefilled(self, route: Route, num_tokens: int) -> None:
        load = self.prefill.get(route.prefill_id) if route.prefill_id is not None else None
        if load is not None:  # (a worker that left, or changed pools, has no load here)
            load.queued_tokens = max(0, load.queued_tokens - num_tokens)

    def finished(self, route: Route) -> None:
        load = self.decode.get(route.decode_id)
        if load is not None:
            load.running = max(0, load.running - 1)

    def observe(self, worker_id: str, free_blocks: int) -> None:
        """Records a worker's latest free KV block count."""
        for pool in (self.prefill, self.decode):
            if worker_id in pool:
                pool[worker_id].free_blocks = free_blocks

    def is_alive(self, worker_id: str) -> bool:
        load = self.decode.get(worker_id) or self.prefill.get(worker_id)
        return load is not None and load.alive

    def mark_dead(self, worker_id: str) -> None:
        for pool in (self.prefill, self.decode):
            if worker_id in pool:
                pool[worker_id].alive = False

    def set_accepting(self, worker_id: str, accepting: bool) -> None:
        """A draining worker stays alive (its requests finish) but gets no new ones."""
        for pool in (self.prefill, self.decode):
            if worker_id in pool:
                pool[worker_id].accepting = accepting

    def remove(self, worker_id: str) -> None:
        """Forgets a worker (it left, or moves to the other pool)."""
        self.prefill.pop(worker_id, None)
        self.decode.pop(worker_id, None)

    def add_worker(self, pool: str, worker_id: str) -> None:
        """A worker that joined a pool at run time ("prefill", or "decode" for the rest)."""
        loads = self.prefill if pool == "prefill" else self.decode
        loads[worker_id] = WorkerLoad(worker_id)


def _open(pool: dict[str, WorkerLoad], name: str) -> list[WorkerLoad]:
    """The pool's workers that take new requests."""
    open_ = [w for w in pool.values() if w.alive and w.accepting]
    if not open_:
        raise NoWorkerError(f"no live {name} worker")
    return open_


def _preferred(workers: list[WorkerLoad], avoid: frozenset[str]) -> list[WorkerLoad]:
    others = [w for w in workers if w.worker_id not in avoid]
    return others or workers
