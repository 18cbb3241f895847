"""The planner (planning/planner.py) driving a simulated deployment: every `interval_s` it sees
what the coordinator would see (arrivals and lengths over the last window, the prefill queue,
TTFT and ITL p99 of recent requests) and its decisions are carried out on the simulation, with
the real delays: role switches take `Overheads.role_switch`, new workers `worker_start`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planning.planner import Decision, Observation, Planner
from simulation.cluster import Simulation

MIN_SAMPLES = 5  # fewer finished requests in the window: no observed percentile


@dataclass
class PlannerDriver:
    planner: Planner
    interval_s: float = 2.0
    window_s: float = 10.0
    decisions: list[Decision] = field(default_factory=list)  # every action (not "none")
    layouts: list[tuple[float, int, int]] = field(default_factory=list)  # (time, P, D)
    _next_at: float = 0.0

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
        elif decision.action == "infeasible" and (
            not self.decisions or self.decisions[-1].action != "infeasible"
        ):
            self.decisions.append(decision)

    def observe(self, sim: Simulation) -> Observation:
        since = sim.now - self.window_s
        while sim.sent and sim.sent[0][0] < since:
            sim.sent.popleft()
        sent = list(sim.sent)
        span = min(self.window_s, max(sim.now, 1e-9))
        prompts = [p for _, p, _ in sent]
        outputs = [o for _, _, o in sent]
        while sim.finished and sim.finished[0].finished_at < since:  # type: ignore[operator]
            sim.finished.popleft()
        recent = [r for r in sim.finished if r.error is None]
        ttfts = [r.token_times[0] - r.sent_at for r in recent if r.token_times and r.sent_at]
        itls = [
            (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
            for r in recent
            if len(r.token_times) > 1
        ]
        prefill = sim.serving("prefill")
        return Observation(
            at=sim.now,
            prefill_workers=len(sim.serving("prefill")) + sim.pending("prefill"),
            decode_workers=len(sim.serving("decode")) + sim.pending("decode"),
            arrival_rate=len(sent) / span,
            mean_prompt=float(np.mean(prompts)) if prompts else 0.0,
            mean_output=float(np.mean(outputs)) if outputs else 0.0,
            queued_prefill_tokens=sum(w.queued_prompt_tokens for w in prefill),
            observed_ttft_s=_p99(ttfts),
            observed_itl_s=_p99(itls),
            starting_workers=sim.pending("prefill") + sim.pending("decode"),
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


def _p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if len(values) >= MIN_SAMPLES else None
