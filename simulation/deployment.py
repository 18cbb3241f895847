"""What a simulation runs: the pools, each engine's limits, the costs and the serving overheads."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from coordinator.router import POLICIES, RouteCosts
from planning.cost_model import StepCostModel
from planning.transfer_model import TransferCostModel
from protocol.kv import KVLayout
from simulation.workload import SimulationError


@dataclass(frozen=True)
class EngineLimits:
    """One engine's limits, as `EngineConfig` sets them on a real worker."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    decode_headroom_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise SimulationError(f"{name} must be at least 1")
        if self.decode_headroom_tokens < 0:
            raise SimulationError("decode_headroom_tokens must be at least 0")


@dataclass(frozen=True)
class Deployment:
    """Pools of single-engine workers. `prefill_workers == 0` is colocated: every worker
    prefills and decodes its own requests."""

    prefill_workers: int
    decode_workers: int
    engine: EngineLimits
    routing: str = "load"
    local_threshold: int = 0  # "load" routing: prompts this short (uncached) prefill on decode
    route_costs: RouteCosts = RouteCosts()
    gpus_per_worker: int = 1  # tensor parallel ranks: what a worker costs
    late_after_s: float | None = None  # the coordinator's (the TTFT objective): see room.py
    # CPU workers sharing one machine: the cores their (single-thread) engines share. A step
    # that starts while k workers (itself included) are in a step takes max(1, k / host_cores)
    # times its modelled time. None: every worker has its own device (GPUs).
    host_cores: float | None = None
    # CPU workers that pace a machine's cores instead (kernels/core_share.py, what `tandem
    # serve` does on a CPU host it splits): each step runs on max(1, paced_cores // k) threads,
    # k the workers that have work (itself included), and takes what the cost model for that
    # many threads says (Costs.by_threads). None: no pacing.
    paced_cores: int | None = None
    # Measured slowdown of a decode step that starts while a prefill worker is in a step, when
    # they share a CPU host (their threads preempt each other; fitted from telemetry by
    # benchmarks/simulator_fidelity.py): such a step runs X times slower until that prefill
    # step ends, then at its own pace (simulation/interference.py). One factor, or the factors
    # measured, each such step drawing one of them (seeded: the same draws every run). 1: no
    # interference (each worker on its own device).
    prefill_interference: float | tuple[float, ...] = 1.0
    # The other way: a prefill step that starts while a decode worker is in a step, measured
    # against the prefill steps' cost alone. 1: none.
    decode_interference: float | tuple[float, ...] = 1.0
    # Measured spread of step times around the model: real step time over the model's, of the
    # decode steps (no prompt tokens) the model was fitted on (benchmarks/simulator_fidelity.py).
    # Each such step draws one (seeded: the same draws every run). Empty: every step takes what
    # the model says. `prefill_step_noise`: the same for steps with prompt tokens.
    step_noise: tuple[float, ...] = ()
    prefill_step_noise: tuple[float, ...] = ()
    # On paced cores, the same per thread count: threads -> (decode steps' spread, prompt
    # steps' spread), measured on the steps that ran on that many (a two-thread team on two
    # shared cores has a longer tail than one thread). A step on a count not here, or whose
    # kind's spread is empty, draws from the two above.
    thread_noise: Mapping[int, tuple[tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        if self.prefill_workers < 0 or self.decode_workers < 1:
            raise SimulationError("a deployment needs >= 0 prefill and >= 1 decode workers")
        if self.host_cores is not None and not 0 < self.host_cores < math.inf:  # (NaN too)
            raise SimulationError("host_cores must be a finite number more than 0")
        if self.late_after_s is not None and not 0 <= self.late_after_s < math.inf:
            raise SimulationError("late_after_s must be a finite number >= 0")
        if self.paced_cores is not None and self.paced_cores < 1:
            raise SimulationError("paced_cores must be at least 1")
        if self.paced_cores is not None and self.host_cores is not None:
            raise SimulationError("workers either pace their cores or share them, not both")
        interference = (self.prefill_interference, self.decode_interference)
        if self.paced_cores is not None and interference != (1.0, 1.0):
            # pacing re-times steps in progress from the model; a slowdown factor would be lost
            raise SimulationError("paced cores take no interference factors (their threads are it)")
        for factors in (self.prefill_interference, self.decode_interference):
            if isinstance(factors, tuple):
                if not factors or not all(0 < f < math.inf for f in factors):
                    raise SimulationError("measured interference factors must be more than 0")
            elif not 1 <= factors < math.inf:  # (NaN fails too)
                raise SimulationError(
                    "prefill_interference and decode_interference must be finite and >= 1"
                )
        measured = [f for pair in self.thread_noise.values() for kind in pair for f in kind]
        if min([*self.step_noise, *self.prefill_step_noise, *measured], default=1) <= 0:
            raise SimulationError("step_noise factors must be more than 0")
        if self.routing not in POLICIES:
            raise SimulationError(f"routing must be one of {', '.join(POLICIES)}")

    @property
    def colocated(self) -> bool:
        return self.prefill_workers == 0

    @property
    def shares_host(self) -> bool:
        """Its workers' steps slow each other down (CPU workers on one machine)."""
        return (
            self.host_cores is not None
            or self.paced_cores is not None
            or self.prefill_interference != 1
            or self.decode_interference != 1
        )

    @property
    def num_workers(self) -> int:
        return self.prefill_workers + self.decode_workers

    @property
    def num_gpus(self) -> int:
        return self.num_workers * self.gpus_per_worker

    def describe(self) -> str:
        if self.colocated:
            return f"{self.decode_workers} colocated"
        return f"{self.prefill_workers}P{self.decode_workers}D"


@dataclass(frozen=True)
class Costs:
    """Seconds: one engine step from its shape; one layer of KV from its bytes (no transfer
    model or no KV layout: sending is free). `by_threads`: step models fitted on steps that ran
    on that many threads, for workers that pace their cores (Deployment.paced_cores)."""

    step: StepCostModel
    transfer: TransferCostModel | None = None
    kv: KVLayout | None = None
    by_threads: Mapping[int, StepCostModel] = field(default_factory=dict)

    def step_on(self, threads: int) -> StepCostModel:
        """The model for a step on `threads` threads: the one fitted on the most threads up to
        that many (a worker never runs on more than it was measured on), else `step`."""
        fitted = [t for t in self.by_threads if t <= threads]
        return self.by_threads[max(fitted)] if fitted else self.step


@dataclass(frozen=True)
class Overheads:
    """Seconds the serving path adds around engine steps (measured on a real server; 0 leaves
    the engines alone). `stats_interval` is the coordinator's stats poll: the router's view
    of free blocks, queues and cached prefixes is that old."""

    step_gap: float = 0.0  # between one step's end and the next step's start, on a worker
    dispatch: float = 0.0  # the client sends -> the coordinator routes it
    handover: float = 0.0  # KV in place on the decode worker -> first token out, request admitted
    delivery: float = 0.0  # a step's tokens -> the client
    stats_interval: float = 1.0
    failure_detect: float = 1.0  # a worker dies -> its requests are placed again
    worker_start: float = 60.0  # a new worker: asked for -> serving (model load, warm-up)
    role_switch: float = 5.0  # a drained worker moves to the other pool

    def __post_init__(self) -> None:
        # (an infinite one leaves an event at infinity, which the stats poll waits for forever)
        for name, value in vars(self).items():
            if not 0 <= value < math.inf:
                raise SimulationError(f"{name} must be a finite number of seconds >= 0")
        if self.stats_interval <= 0:
            raise SimulationError("stats_interval must be > 0")


@dataclass(frozen=True)
class Fault:
    """Worker `worker_id` dies at `at` seconds."""

    at: float
    worker_id: str

    def __post_init__(self) -> None:
        if not 0 <= self.at < math.inf:
            raise SimulationError(f"a fault's time must be finite and >= 0, not {self.at}")


@dataclass(frozen=True)
class Scenario:
    deployment: Deployment
    costs: Costs
    overheads: Overheads = Overheads()
    faults: tuple[Fault, ...] = field(default=())
