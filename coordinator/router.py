"""Router: picks the workers for a request. Pure Python on counts and hashes (no torch, no Ray).

What each worker's prefix cache holds comes from the worker itself: it reports every block hash
entering or leaving its cache (protocol/telemetry.py), and the coordinator applies those to
`WorkerLoad.cached` (`Router.cache_changed`). A placement also counts its prompt as held by the
worker that prefills it, at once, until that worker's own report arrives.

Three policies (`--routing`):

- "cost": every candidate route is priced in seconds of prefill work and the cheapest
  taken. Prefill on worker P costs P's queued prompt tokens plus the prompt tokens P does not hold
  in cache; prefill on the decode worker D itself costs D's uncached tokens, and as long again for
  each request running on D (their next tokens wait for it). Adding the request to D costs
  `decode_seq_seconds` per request already running there. So a prompt D mostly holds is
  prefilled where it is cached, and a busy prefill pool sends short prompts to decode workers.
- "load" (the default until cost routing is the measured better one): decode worker with the
  fewest running requests, then most free KV blocks, then the longest cached prefix; prefill
  worker with the fewest queued prompt tokens (coarse buckets), then prefix overlap; prompts
  under `local_threshold` uncached tokens prefill on decode.
- "round-robin": each pool in turn, for comparison.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.block_manager import chain_hashes
from planning.cost_model import StepCostModel, StepShape

PREFILL_LOAD_BUCKET = 256  # queued tokens
REMEMBERED_PREFIXES = 4096  # hashes of recent placements per worker, until its reports come
POLICIES = ("cost", "load", "round-robin")


@dataclass(frozen=True)
class RouteCosts:
    """Seconds per unit of work, for the "cost" policy. Defaults: SmolLM2-135M on one core of
    the development machine (a 100-token prompt takes ~60 ms; each running request adds ~0.6 ms
    to a decode step); `from_step_model` reads them off a `tandem profile` of the model."""

    prefill_token_seconds: float = 0.0006
    decode_seq_seconds: float = 0.0006

    @classmethod
    def from_step_model(
        cls, model: StepCostModel, prompt_tokens: int = 512, batch: int = 16, context: int = 512
    ) -> RouteCosts:
        """The two prices read off a step cost model: what a fresh `prompt_tokens` chunk adds
        to an empty step, per token (its attention included); what each decode of `context`
        tokens adds to a step, on average from `batch` to twice as many (a slope across the
        model's small-batch knee, not the jump at it)."""
        empty = model.predict(StepShape(0, 0, 0, 0))
        prompt = model.predict(StepShape(prompt_tokens, prompt_tokens * prompt_tokens, 0, 0))
        few, many = (model.predict(StepShape(0, 0, n, n * context)) for n in (batch, 2 * batch))
        return cls(
            prefill_token_seconds=max((prompt - empty) / prompt_tokens, 0.0),
            decode_seq_seconds=max((many - few) / batch, 0.0),
        )


@dataclass
class WorkerLoad:
    worker_id: str
    running: int = 0  # requests the coordinator has placed there and not seen finish
    queued_tokens: int = 0  # prompt tokens placed there and not yet prefilled
    free_blocks: int = 0  # from the worker's last stats report
    accepting: bool = True  # False while draining: alive, finishing its work, gets none new
    full: bool = False  # refused a reservation; until a request ends there or it reports again
    reported_queue: int = 0  # prompt tokens waiting in its engine, from its last stats report
    cached: set[int] = field(default_factory=set)  # block hashes its prefix cache reported
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)  # recent placements

    def overlap(self, hashes: list[int]) -> int:
        """How many leading blocks of the prompt this worker holds (or was just sent)."""
        count = 0
        for digest in hashes:
            if digest not in self.cached and digest not in self.prefixes:
                break
            count += 1
        return count

    def remember(self, hashes: list[int]) -> None:
        prefixes = self.prefixes
        for digest in hashes:  # each one now the most recent
            if digest in prefixes:
                prefixes.move_to_end(digest)
            else:
                prefixes[digest] = None
        for _ in range(len(prefixes) - REMEMBERED_PREFIXES):
            prefixes.popitem(last=False)


def prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks, as every worker's block manager makes them."""
    return chain_hashes(token_ids, block_size, [], len(token_ids) // block_size)


class NoWorkerError(RuntimeError):
    """Every worker of a pool is dead."""


@dataclass(frozen=True)
class Route:
    decode_id: str
    prefill_id: str | None  # None: prefill on the decode worker
    # Prompt tokens the prefill worker must compute (what it does not hold); None: all of them.
    # Not part of a route's identity: two routes to the same workers are equal.
    prefill_tokens: int | None = field(default=None, compare=False)


def queued_tokens(route: Route, token_ids: list[int]) -> int:
    """What the route adds to its prefill worker's queue."""
    return len(token_ids) if route.prefill_tokens is None else route.prefill_tokens


class Router:
    def __init__(
        self,
        prefill_ids: list[str],
        decode_ids: list[str],
        block_size: int,
        local_threshold: int,
        policy: str = "load",
        costs: RouteCosts | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, not {policy!r}")
        self.prefill = {w: WorkerLoad(w) for w in prefill_ids}
        self.decode = {w: WorkerLoad(w) for w in decode_ids}
        self.block_size = block_size
        self.local_threshold = local_threshold
        self.policy = policy
        self.costs = costs or RouteCosts()
        self._turns = {"prefill": 0, "decode": 0}  # round-robin positions

    def route(
        self,
        token_ids: list[int],
        avoid: frozenset[str] = frozenset(),
        local: bool = False,
        hashes: list[int] | None = None,
    ) -> Route:
        """Picks workers (it records nothing: call `placed` as soon as the route is used).
        Workers in `avoid` (those that just failed this request) are chosen only when no
        other worker of their pool can take it. `local`: the decode worker prefills it.
        `hashes`: the prompt's `prefix_hashes`, when the caller has them already."""
        if hashes is None:
            hashes = prefix_hashes(token_ids, self.block_size)
        # Room first, then preference: an avoided worker with room beats a full one (the other
        # way round, a request could be sent back to a full worker again and again while
        # `may_have_room` saw the avoided one's room).
        decodes = _open(self.decode, "decode")
        decodes = _preferred([w for w in decodes if not w.full] or decodes, avoid)
        prefills = _preferred([w for w in self.prefill.values() if w.accepting], avoid)
        if self.policy == "cost":
            return self._cheapest(len(token_ids), hashes, decodes, [] if local else prefills)
        if self.policy == "round-robin":
            decode = self._next_turn("decode", decodes)
            if local or not prefills:
                return Route(decode.worker_id, None)
            prefill = self._next_turn("prefill", prefills)
            uncached = self._uncached(prefill, len(token_ids), hashes)
            return Route(decode.worker_id, prefill.worker_id, uncached)
        decode = min(decodes, key=lambda w: (w.running, -w.free_blocks, -w.overlap(hashes)))
        uncached = len(token_ids) - decode.overlap(hashes) * self.block_size
        if local or not prefills or uncached < self.local_threshold:
            return Route(decode.worker_id, None)
        prefill = min(
            prefills, key=lambda w: (w.queued_tokens // PREFILL_LOAD_BUCKET, -w.overlap(hashes))
        )
        uncached = self._uncached(prefill, len(token_ids), hashes)
        return Route(decode.worker_id, prefill.worker_id, uncached)

    def _cheapest(
        self,
        num_tokens: int,
        hashes: list[int],
        decodes: list[WorkerLoad],
        prefills: list[WorkerLoad],
    ) -> Route:
        """The route of least predicted work (seconds): see the module docstring. A tie goes
        to the prefill pool."""
        per_token, per_seq = self.costs.prefill_token_seconds, self.costs.decode_seq_seconds
        best: WorkerLoad | None = None  # the prefill worker with the least work ahead
        if prefills:
            work = {w.worker_id: self._uncached(w, num_tokens, hashes) for w in prefills}
            best = min(prefills, key=lambda w: w.queued_tokens + work[w.worker_id])
            tokens = work[best.worker_id]
            remote_seconds = per_token * (best.queued_tokens + tokens)
        options: list[tuple[float, int, bool, Route]] = []  # (seconds, tie-breaks, route)
        for decode in decodes:
            base = per_seq * decode.running
            uncached = self._uncached(decode, num_tokens, hashes)
            local = per_token * (decode.reported_queue + uncached * (1 + decode.running))
            options.append((base + local, -decode.free_blocks, True, Route(decode.worker_id, None)))
            if best is not None:
                route = Route(decode.worker_id, best.worker_id, tokens)
                options.append((base + remote_seconds, -decode.free_blocks, False, route))
        return min(options, key=lambda option: option[:3])[3]

    def _uncached(self, worker: WorkerLoad, num_tokens: int, hashes: list[int]) -> int:
        return max(0, num_tokens - worker.overlap(hashes) * self.block_size)

    def _next_turn(self, pool: str, workers: list[WorkerLoad]) -> WorkerLoad:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        turn = self._turns[pool] % len(ordered)
        self._turns[pool] += 1
        return ordered[turn]

    def cache_changed(
        self, worker_id: str, stored: list[int], evicted: list[int], snapshot: bool = False
    ) -> None:
        """Applies a worker's prefix-cache report; `snapshot`: `stored` is all it holds."""
        load = self.decode.get(worker_id) or self.prefill.get(worker_id)
        if load is None:
            return
        if snapshot:
            load.cached = set(stored)
        else:
            load.cached.update(stored)
            load.cached.difference_update(evicted)
        for digest in load.prefixes.keys() & evicted:  # (usually few of many evicted)
            del load.prefixes[digest]

    def placed(self, route: Route, token_ids: list[int], hashes: list[int] | None = None) -> None:
        if hashes is None:
            hashes = prefix_hashes(token_ids, self.block_size)
        self.decode[route.decode_id].running += 1
        if route.prefill_id is None:
            self.decode[route.decode_id].remember(hashes)
        else:  # the decode worker's own report says once the KV is there
            self.prefill[route.prefill_id].queued_tokens += queued_tokens(route, token_ids)
            self.prefill[route.prefill_id].remember(hashes)

    def unplace(self, route: Route, token_ids: list[int]) -> None:
        """Undoes `placed` for a route that was not taken after all (no room, no answer)."""
        self.prefilled(route, queued_tokens(route, token_ids))
        self.finished(route)

    def prefilled(self, route: Route, num_tokens: int) -> None:
        load = self.prefill.get(route.prefill_id) if route.prefill_id is not None else None
        if load is not None:  # (a worker that left, or changed pools, has no load here)
            load.queued_tokens = max(0, load.queued_tokens - num_tokens)

    def finished(self, route: Route) -> None:
        load = self.decode.get(route.decode_id)
        if load is not None:
            load.running = max(0, load.running - 1)
            load.full = False

    def refused(self, decode_id: str) -> None:
        """The decode worker had no room for a reservation: other decode workers are tried
        first until a request ends there or its next stats report comes."""
        load = self.decode.get(decode_id)
        if load is not None:
            load.full = True

    def may_have_room(self) -> bool:
        """Some open decode worker has not refused a reservation since it last reported."""
        return any(w.accepting and not w.full for w in self.decode.values())

    def observe(self, worker_id: str, free_blocks: int, queued_tokens: int = 0) -> None:
        """Records a worker's latest free KV blocks and prompt tokens waiting in its engine."""
        for pool in (self.prefill, self.decode):
            if worker_id in pool:
                pool[worker_id].free_blocks = free_blocks
                pool[worker_id].reported_queue = queued_tokens
                pool[worker_id].full = False

    def is_alive(self, worker_id: str) -> bool:
        """The worker is in a pool (a worker that died or left is forgotten: `remove`)."""
        return worker_id in self.decode or worker_id in self.prefill

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
    open_ = [w for w in pool.values() if w.accepting]
    if not open_:
        raise NoWorkerError(f"no live {name} worker")
    return open_


def _preferred(workers: list[WorkerLoad], avoid: frozenset[str]) -> list[WorkerLoad]:
    others = [w for w in workers if w.worker_id not in avoid]
    return others or workers
