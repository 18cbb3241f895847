"""The planner (planning/planner.py) driving a simulated deployment: every `interval_s` it sees
what the coordinator would see (arrivals and lengths over the last window, the prefill queue,
TTFT and ITL p99 of recent requests) and its decisions are carried out on the simulation, with
the real delays: role switches take `Overheads.role_switch`, new workers `worker_start`."""

from __future__ import annotations

from dataclasses import dataclass, field

from planning.planner import Decision, Observation, Planner
from planning.window import LoadWindow
from simulation.cluster import Simulation


@dataclass
class PlannerDriver:
    planner: Planner
    interval_s: float = 2.0
    # the last 10 s, watched from the simulation's start
    window: LoadWindow = field(default_factory=lambda: LoadWindow(opened_at=0.0))
    decisions: list[Decision] = field(default_factory=list)  # every action (not "none")
    layouts: list[tuple[float, int, int]] = field(default_factory=list)  # (time, P, D)
    _next_at: float = 0.0
    _previous: str = "none"  # the last decision's action

    def __call__(self, sim: Simulation) -> None:
        if sim.now < self._next_at:
            return
        self._next_at = sim.now + self.interval_s
        obs = self.observe(sim)
        self.layouts.append((sim.now, obs.prefill_workers, obs.decode_workers))
        decision = self.planner.decide(obs)
        if decision.action in ("switch", "grow", "shrink"):
            self.decisions.append(decision)
            self.apply(sim, decision)
        elif decision.action == "infeasible" and self._previous != "infeasible":
            self.decisions.append(decision)  # the first of each run of them
        self._previous = decision.action

    def observe(self, sim: Simulation) -> Observation:
        while sim.sent:
            at, prompt, _ = sim.sent.popleft()
            self.window.arrived(at, prompt)
        while sim.finished:
            r = sim.finished.popleft()
            if r.error is None and r.token_times and r.sent_at is not None:
                gaps = len(r.token_times) - 1
                itl = (r.token_times[-1] - r.token_times[0]) / gaps if gaps else None
                self.window.finished(
                    r.finished_at, len(r.token_times), r.token_times[0] - r.sent_at, itl
                )
        seen = self.window.summary(sim.now)
        pending = {pool: sim.pending(pool) for pool in ("prefill", "decode")}
        return Observation(
            at=sim.now,
            prefill_workers=len(sim.serving("prefill")) + pending["prefill"],
            decode_workers=len(sim.serving("decode")) + pending["decode"],
            arrival_rate=seen.arrival_rate,
            mean_prompt=seen.mean_prompt,
            mean_output=seen.mean_output,
            queued_prefill_tokens=sum(w.queued_prompt_tokens for w in sim.serving("prefill")),
            observed_ttft_s=seen.ttft_s,
            observed_itl_s=seen.itl_s,
            starting_workers=sum(pending.values()),
            rate_trend=seen.rate_trend,
            waiting_for_room=len(sim.room),
            worker_start_s=sim.scenario.overheads.worker_start,
            decode_kv_tokens=min((w.blocks.num_blocks for w in sim.serving("decode")), default=0)
            * sim.router.block_size,
        )

    def apply(self, sim: Simulation, decision: Decision) -> None:
        want = {"prefill": decision.prefill_workers, "decode": decision.decode_workers}
        have = {pool: len(sim.serving(pool)) + sim.pending(pool) for pool in want}
        if decision.action == "switch":
            donor = "prefill" if have["prefill"] > want["prefill"] else "decode"
            taker = "decode" if donor == "prefill" else "prefill"
            for _ in range(have[donor] - want[donor]):
                worker = min(sim.serving(donor), key=lambda w: w.scheduler.num_unfinished)
                sim.switch_role(worker.worker_id, taker)
        elif decision.action == "grow":
            for pool in want:
                for _ in range(max(0, want[pool] - have[pool])):
                    sim.add_worker(pool, sim.scenario.overheads.worker_start)
        elif decision.action == "shrink":
            for pool in want:
                for _ in range(max(0, have[pool] - want[pool])):
                    worker = min(sim.serving(pool), key=lambda w: w.scheduler.num_unfinished)
                    sim.drain(worker.worker_id)
