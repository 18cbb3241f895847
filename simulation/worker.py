"""A simulated worker: the real scheduler and block manager, with steps that take modelled time.

Nothing here computes: a step's plan comes from `engine.scheduler.Scheduler` exactly as on a
real worker, its length from the fitted per-step cost model, and the tokens it "samples" are
made up. Reservations follow `LLMEngine.reserve` (prefix hits taken, blocks for the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, SchedulerConfig, StepPlan, fits_with_headroom
from engine.sequence import Sequence
from protocol.sampling import FinishReason, SamplingParams
from simulation.deployment import EngineLimits
from simulation.leap import Leap

_PARAMS: dict[int, SamplingParams] = {}  # by max_tokens (the simulator ends requests itself)


class PacedStep:
    """A step on workers that pace their cores (Deployment.paced_cores): workers re-pace
    between layers (prefill/worker.py, decode/worker.py), so when another worker starts or
    stops computing, the rest of the step runs on the new thread count."""

    __slots__ = ("plan", "threads", "total", "done", "since", "started", "noise", "landed")

    def __init__(
        self,
        plan: StepPlan,
        threads: int,
        total: float,
        now: float,
        noise: float = 1.0,
        landed: list[str] | None = None,
    ) -> None:
        self.landed = landed or []  # a prefill step's requests: their KV lands at its end
        self.plan = plan
        self.threads = threads
        self.total = total  # the whole step's seconds on `threads` threads
        self.noise = noise  # its draw of Deployment.step_noise, kept when it is re-timed
        self.done = 0.0  # fraction of the step done before `since`
        self.since = now
        self.started = now


@dataclass
class SimWorker:
    worker_id: str
    pool: str  # "prefill" or "decode" (colocated workers are decode workers)
    limits: EngineLimits
    clock: Callable[[], float]  # simulated time
    late_after_s: float | None = None  # the TTFT objective: its scheduler's (engine/scheduler.py)
    blocks: BlockManager = field(init=False)
    scheduler: Scheduler = field(init=False)
    alive: bool = True
    stepping: bool = False
    draining: bool = False  # takes no new requests; leaves once idle
    epoch: int = 0  # bumped when it dies or changes pools: older step events are void
    reserved: dict[str, Sequence] = field(default_factory=dict)  # KV on its way
    # block hashes that entered and left its prefix cache since the last poll
    cache_stored: list[int] = field(default_factory=list)
    cache_evicted: list[int] = field(default_factory=list)
    link_free_at: float = 0.0  # a prefill worker's KV sender: busy until then
    step_ends_at: float = 0.0  # the step in progress (or the last one) ends then
    leap: Leap | None = None  # decode steps planned at once, played as time passes
    busy_seconds: float = 0.0
    num_steps: int = 0
    steps_beside: int = 0  # of them, started while the other pool was in a step (shared host)
    threads_used: dict[int, int] = field(default_factory=dict)  # paced cores: threads -> steps
    # paced cores: the step in progress, re-timed when its share of the cores changes
    paced: PacedStep | None = None
    step_id: int = 0  # bumped when the step's end is re-timed: the older end event is void

    def __post_init__(self) -> None:
        lim = self.limits
        self.blocks = BlockManager(lim.num_blocks, lim.block_size, lim.enable_prefix_caching)
        self.blocks.on_cache_change = self._cache_changed
        self.scheduler = Scheduler(
            SchedulerConfig(lim.max_num_seqs, lim.max_num_batched_tokens, self.late_after_s),
            self.blocks,
            self.clock,
        )

    def _cache_changed(self, digests: list[int], stored: bool) -> None:
        (self.cache_stored if stored else self.cache_evicted).extend(digests)

    def new_sequence(
        self,
        key: str,
        token_ids: Sequence_[int],
        num_prompt: int,
        max_tokens: int,
        hashes: list[int] | None = None,
    ) -> Sequence:
        """`max_tokens`: the request's output length (as the client asks it, ignoring EOS);
        `hashes`: the token list's block hashes, when the caller has them (the router's)."""
        ids = token_ids.copy() if hasattr(token_ids, "copy") else list(token_ids)
        params = _PARAMS.get(max_tokens) or _PARAMS.setdefault(
            max_tokens, SamplingParams(max_tokens=max_tokens)
        )
        seq = Sequence(key, ids, num_prompt, params)  # type: ignore[arg-type]
        if hashes:
            seq.block_hashes = list(hashes)
        return seq

    def has_room(self) -> bool:
        """`LLMEngine.has_room`: running plus promised stay under max_num_seqs."""
        return len(self.scheduler.running) + len(self.reserved) < self.limits.max_num_seqs

    def reserve(self, seq: Sequence) -> bool:
        """`LLMEngine.reserve`: blocks for every token, prefix hits taken, growth room left for
        all; False if no room."""
        if not self.has_room():
            return False
        hits = self.blocks.match_prefix(seq.token_ids, seq.block_hashes)
        held = (*self.scheduler.running, *self.reserved.values())
        if not fits_with_headroom(self.blocks, held, seq, hits, self.limits.decode_headroom_tokens):
            return False
        table = self.blocks.allocate_prefix(hits, seq.num_tokens)
        if table is None:
            return False
        bs = self.limits.block_size
        self.blocks.count_query(seq.num_tokens, min(len(hits) * bs, seq.num_tokens))
        seq.block_table, seq.num_hashed_blocks = table, len(hits)
        self.reserved[seq.request_id] = seq
        return True

    def admit(self, key: str) -> Sequence:
        """`LLMEngine.admit`: the reserved request's KV is here; it joins the batch."""
        seq = self.reserved.pop(key)
        self.scheduler.add_running(seq)
        return seq

    def drop(self, key: str, seq: Sequence | None) -> None:
        """Ends whatever this worker holds of a request (its reservation or its sequence)."""
        reserved = self.reserved.pop(key, None)
        if reserved is not None:
            self.blocks.free_blocks(reserved.block_table)
            reserved.block_table = []
            return
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.ABORT)

    @property
    def queued_prompt_tokens(self) -> int:
        """What its stats report as queued prefill: prompt tokens admitted, not yet computed."""
        sched = self.scheduler
        in_prefill = [s for s in sched.running if s.num_uncomputed_tokens > 1]
        return sum(s.num_uncomputed_tokens for s in (*in_prefill, *sched.waiting))

    @property
    def idle(self) -> bool:
        return not self.scheduler.num_unfinished and not self.reserved
