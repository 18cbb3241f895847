"""PlannerLoop: the SLO planner (planning/planner.py) run against the live pools.

    every interval_s (2 s):
        observe: arrivals, prompt and output lengths, TTFT/ITL percentiles over the last 10 s
            (planning/window.py), tokens queued on the prefill pool, the pools' sizes, and the
            workers' latest engine steps (they recalibrate the profile: planning Calibrated)
        decide (planning/planner.py): none | switch | grow | shrink | infeasible
        mode "on": carry it out through the pool controls the admin API uses
            switch -> the least busy worker of the pool that gives one changes role
            grow   -> the cluster is asked for room for the whole new layout at once (Ray's
                      autoscaler, where there is one), then the pools are set to it
            shrink -> the pools are set to it: the extra worker drains, then leaves
        mode "dry-run": the same decisions, logged and exported, never carried out
        mode "off": no loop (the mode can be changed at run time: POST /admin/planner)

Every decision keeps its inputs, its predicted and observed TTFT/ITL and a reason
(`status()`, for GET /admin/planner and /metrics). An action that fails is logged with the
error and tried again only when the planner decides it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from planning.cost_model import Calibrated
from planning.planner import Decision, Observation, Planner
from planning.window import LoadWindow
from protocol.errors import PoolError
from protocol.telemetry import StepRecord

log = logging.getLogger(__name__)

MODES = ("on", "dry-run", "off")
ACTIONS = ("switch", "grow", "shrink")
KEPT = 256  # decisions shown at /admin/planner


class PoolControl(Protocol):
    """What the loop needs of the coordinator."""

    def layout(self) -> dict[str, tuple[int, int]]:
        """Per pool ("prefill", "decode"): (serving workers, workers starting)."""

    def queued_prefill_tokens(self) -> int: ...

    def decode_kv_tokens(self) -> int:
        """The KV cache of the smallest decode worker, in tokens (0 before any report)."""

    def waiting_for_room(self) -> int:
        """Requests in line for a decode worker with room."""

    def worker_start_s(self) -> float | None:
        """How long the newest worker took from spawn to serving (None before any)."""

    def take_steps(self) -> list[StepRecord]:
        """Engine steps (of every worker) reported since the last call, each handed out once."""

    def least_busy(self, pool: str) -> str:
        """The serving worker of `pool` with the fewest requests relying on it."""

    async def switch_role(self, worker_id: str, role: str) -> float: ...

    def scale(self, sizes: dict[str, int]) -> None: ...

    def request_capacity(self, workers: int) -> None:
        """Asks the cluster for room for `workers` workers in all (a no-op without an
        autoscaler)."""


@dataclass(frozen=True)
class LoopSettings:
    mode: str = "off"
    interval_s: float = 2.0
    percentile: float = 99.0  # of the observed TTFT and ITL
    window_s: float = 10.0  # what "the last window" of traffic is


@dataclass(frozen=True)
class PlannerSetup:
    """What `tandem serve --planner` builds: the planner, its (calibrated) profile, the loop."""

    planner: Planner
    model: Calibrated  # the planner predicts with this same object
    settings: LoopSettings


@dataclass
class Applied:
    decision: Decision
    mode: str
    outcome: str  # "done", "recommended" (dry-run), or the error that stopped it


class PlannerLoop:
    def __init__(
        self,
        pools: PoolControl,
        window: LoadWindow,
        setup: PlannerSetup,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if setup.settings.mode not in MODES:
            raise ValueError(f"planner mode must be one of {', '.join(MODES)}")
        self.pools = pools
        self.window = window
        self.planner = setup.planner
        self.model = setup.model
        self.settings = setup.settings
        self.mode = setup.settings.mode
        self.clock = clock
        self.last: Observation | None = None
        self.current: Decision | None = None  # the latest decision, "none" included
        self.applied: deque[Applied] = deque(maxlen=KEPT)  # actions and infeasible reports
        self.counts: Counter[str] = Counter()  # decisions by action
        pools.take_steps()  # steps from before the planner existed are not its to see
        self._task: asyncio.Task | None = None

    # -- running ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.mode != "off" and self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"planner mode must be one of {', '.join(MODES)}")
        self.mode = mode
        if mode == "off":
            if self._task is not None:
                self._task.cancel()
                self._task = None
        else:
            self.start()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop outlives one bad tick; the log says why
                log.exception("planner tick failed")

    async def tick(self) -> Decision:
        obs = self.observe()
        decision = self.planner.decide(obs)
        previous = self.current
        self.last, self.current = obs, decision
        self.counts[decision.action] += 1
        mode = self.mode  # the mode the decision was made in, whatever it is set to meanwhile
        if decision.action in ACTIONS:
            if mode == "dry-run":
                outcome = "recommended"
            else:
                try:
                    outcome = await self._carry_out(decision)
                except asyncio.CancelledError:  # turned off (or shut down) mid-action
                    why = "cancelled: the planner stopped (a role switch under way completes)"
                    self.applied.append(Applied(decision, mode, why))
                    raise
            self.applied.append(Applied(decision, mode, outcome))
            log.info(
                "planner %s: %s -> %dP%dD (%s): %s", mode, decision.action,
                decision.prefill_workers, decision.decode_workers, decision.reason, outcome,
            )  # fmt: skip
        elif decision.action == "infeasible" and (
            previous is None or previous.action != "infeasible"
        ):
            self.applied.append(Applied(decision, mode, "reported"))  # the first of a run
            log.warning("planner: %s", decision.reason)
        return decision

    # -- observing -------------------------------------------------------------------------

    def observe(self) -> Observation:
        now = self.clock()
        steps = self.pools.take_steps()
        if steps:
            self.model.observe(steps)
        seen = self.window.summary(now)
        layout = self.pools.layout()
        prefill, decode = layout.get("prefill", (0, 0)), layout.get("decode", (0, 0))
        return Observation(
            at=now,
            prefill_workers=sum(prefill),
            decode_workers=sum(decode),
            arrival_rate=seen.arrival_rate,
            mean_prompt=seen.mean_prompt,
            mean_output=seen.mean_output,
            queued_prefill_tokens=self.pools.queued_prefill_tokens(),
            observed_ttft_s=seen.ttft_s,
            observed_itl_s=seen.itl_s,
            starting_workers=prefill[1] + decode[1],
            rate_trend=seen.rate_trend,
            decode_kv_tokens=self.pools.decode_kv_tokens(),
            waiting_for_room=self.pools.waiting_for_room(),
            worker_start_s=self.pools.worker_start_s() or 0.0,
        )

    # -- acting ----------------------------------------------------------------------------

    async def _carry_out(self, decision: Decision) -> str:
        want = {"prefill": decision.prefill_workers, "decode": decision.decode_workers}
        layout = self.pools.layout()
        have = {pool: sum(layout.get(pool, (0, 0))) for pool in want}
        try:
            if decision.action == "switch":
                donor = "prefill" if have["prefill"] > want["prefill"] else "decode"
                taker = "decode" if donor == "prefill" else "prefill"
                count = have[donor] - want[donor]
                for done in range(count):
                    if self.mode != "on":  # set to dry-run meanwhile: no more changes
                        return f"stopped after {done} of {count} switches: mode {self.mode}"
                    await self.pools.switch_role(self.pools.least_busy(donor), taker)
            else:
                if decision.action == "grow":
                    self.pools.request_capacity(sum(want.values()))
                self.pools.scale(want)
                if decision.action == "shrink":
                    self.pools.request_capacity(sum(want.values()))
        except PoolError as err:  # a change the pools refuse: its message says why
            return f"failed: {err}"
        except Exception as err:  # a worker that died mid-switch, Ray refusing a request
            return f"failed: {type(err).__name__}: {err}"
        return "done"

    # -- reporting -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        cfg = self.planner.config
        return {
            "mode": self.mode,
            "now": self.clock(),  # decisions' `at` are on this clock
            "slo": {"ttft_s": cfg.ttft_slo_s, "itl_s": cfg.itl_slo_s},
            "limits": {"min_workers": cfg.min_workers, "max_workers": cfg.max_workers},
            "interval_s": self.settings.interval_s,
            "window_s": self.window.span_s,
            "profile_factor": round(self.model.factor, 4),
            "observation": None if self.last is None else _finite(self.last._asdict()),
            "current": None if self.current is None else decision_json(self.current),
            "decisions": [
                {**decision_json(a.decision), "mode": a.mode, "outcome": a.outcome}
                for a in self.applied
            ],
            "counts": dict(self.counts),
        }


def decision_json(decision: Decision) -> dict[str, Any]:
    d = decision._asdict()
    d["predicted"] = _finite(decision.predicted._asdict())
    d["current"] = _finite(decision.current._asdict())
    return _finite(d)


def _finite(values: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinity: an unbounded prediction is written as null."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()
    }
