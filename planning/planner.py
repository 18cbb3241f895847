"""The SLO planner's decisions: how many prefill and decode workers the load in front of us needs.

Pure logic on numbers (no Ray, no simulator): whoever drives it (coordinator/planner_loop.py
live, simulation/autoscale.py in simulation) hands it an `Observation` every few seconds and
carries out the `Decision` it returns.

Prediction, queue included (`predict`), from the per-step cost model:
- prefill: a prompt of the mean length takes t_p seconds on a prefill worker; P workers serve
  utilisation rho = rate x t_p / P; TTFT = the backlog already queued (tokens x seconds per
  token / P) + t_p / (1 - rho) (an M/M/1 wait per worker), infinite at rho >= 1;
- decode: with n requests per decode worker a step takes step(n) (n decodes of mean context),
  and Little's law ties them: n = rate / D x output_len x step(n); solved by iteration, capped
  at max_num_seqs. A decode pool that cannot keep up even at the cap is infinite ITL.

Decisions, in order of cost, at most one per tick:
1. the SLO is threatened (predicted or observed TTFT/ITL over its limit): switch one worker to
   the other pool when some split of the same workers meets the SLO;
2. no split does: grow, asking for the whole deficit at once (the smallest worker count up to
   `max_workers` whose best split meets it); none does up to the cap: move to the layout of
   `max_workers` closest to the SLO (best score) if it is clearly closer than the layout now,
   else report it infeasible; never grow past the cap;
3. all is well and one worker fewer would still meet the SLO with margin (its load re-predicted
   on the survivors) for `shrink_hold_s`: shrink by one.
Stability: a cool-down after each action; a layout left less than `flap_window_s` ago is not
returned to unless the SLO is violated right now; shrinking needs the wide margin `shrink_at`,
growing only the limit, so a constant load settles and stays.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from planning.cost_model import CostModel, StepShape

ITERATIONS = 40
CLOSER = 0.9  # an infeasible SLO: move only to a layout this much closer to it (score ratio)
DECISION_LOG = 256


@dataclass(frozen=True)
class PlannerConfig:
    ttft_slo_s: float
    itl_slo_s: float
    min_workers: int = 2  # one prefill and one decode
    max_workers: int = 8  # the planner never asks for more
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    cooldown_s: float = 10.0  # after an action, before the next (a switch needs to land)
    flap_window_s: float = 600.0
    shrink_hold_s: float = 60.0
    shrink_at: float = 0.6  # shrink only if the smaller layout predicts <= this x the SLO


class Observation(NamedTuple):
    at: float  # seconds
    prefill_workers: int
    decode_workers: int
    arrival_rate: float  # requests per second, over the last window
    mean_prompt: float  # tokens
    mean_output: float  # tokens
    queued_prefill_tokens: int  # waiting on the prefill pool now
    observed_ttft_s: float | None = None  # p99 over the last window, if any finished
    observed_itl_s: float | None = None
    starting_workers: int = 0  # asked for (counted in the pools above), not serving yet


class Prediction(NamedTuple):
    ttft_s: float
    itl_s: float
    prefill_utilisation: float
    decode_per_worker: float  # running requests per decode worker

    def within(self, config: PlannerConfig, factor: float = 1.0) -> bool:
        return self.ttft_s <= config.ttft_slo_s * factor and self.itl_s <= config.itl_slo_s * factor

    def score(self, config: PlannerConfig) -> float:
        """The worse of the two, as a multiple of its limit."""
        return max(self.ttft_s / config.ttft_slo_s, self.itl_s / config.itl_slo_s)


class Decision(NamedTuple):
    at: float
    action: str  # "none", "switch", "grow", "shrink", "infeasible"
    prefill_workers: int  # the layout asked for
    decode_workers: int
    reason: str
    predicted: Prediction  # of the layout asked for
    current: Prediction  # of the layout now
    observed_ttft_s: float | None
    observed_itl_s: float | None


def predict(
    model: CostModel, config: PlannerConfig, obs: Observation, prefill: int, decode: int
) -> Prediction:
    prompt, output = max(obs.mean_prompt, 1.0), max(obs.mean_output, 1.0)
    chunk = min(prompt, config.max_num_batched_tokens)
    steps = math.ceil(prompt / chunk)
    t_prefill = steps * model.predict(StepShape(int(chunk), int(chunk * prompt), 0, 0))
    rho = obs.arrival_rate * t_prefill / max(prefill, 1)
    backlog = obs.queued_prefill_tokens * t_prefill / prompt / max(prefill, 1)
    ttft = math.inf if rho >= 1 else backlog + t_prefill / (1 - rho)
    context = prompt + output / 2
    per_worker_rate = obs.arrival_rate / decode
    n = 1.0
    for _ in range(ITERATIONS):
        step = model.predict(StepShape(0, 0, max(round(n), 1), round(max(n, 1) * context)))
        n = min(per_worker_rate * output * step, config.max_num_seqs)
    step = model.predict(StepShape(0, 0, max(round(n), 1), round(max(n, 1) * context)))
    keeps_up = per_worker_rate * output * step <= config.max_num_seqs
    itl = step if keeps_up else math.inf
    if not keeps_up:
        ttft = math.inf  # admission waits behind a decode pool that falls behind
    return Prediction(ttft, itl, rho, n)


@dataclass
class Planner:
    model: CostModel
    config: PlannerConfig
    log: deque[Decision] = field(default_factory=lambda: deque(maxlen=DECISION_LOG))
    _last_action_at: float = -math.inf
    _left: dict[tuple[int, int], float] = field(default_factory=dict)  # layout -> when left
    _shrinkable_since: float | None = None

    def decide(self, obs: Observation) -> Decision:
        cfg = self.config
        now_layout = (obs.prefill_workers, obs.decode_workers)
        current = predict(self.model, cfg, obs, *now_layout)
        violated = _over(obs.observed_ttft_s, cfg.ttft_slo_s) or _over(
            obs.observed_itl_s, cfg.itl_slo_s
        )
        threatened = violated or not current.within(cfg)
        cooling = obs.at - self._last_action_at < cfg.cooldown_s

        def decision(action: str, layout: tuple[int, int], reason: str, pred: Prediction):
            made = Decision(
                obs.at, action, *layout, reason, pred, current,
                obs.observed_ttft_s, obs.observed_itl_s,
            )  # fmt: skip
            if action in ("switch", "grow", "shrink"):
                self._left[now_layout] = obs.at
                self._last_action_at = obs.at
                self._shrinkable_since = None
            if action != "none" or not self.log or self.log[-1].action != "none":
                self.log.append(made)
            return made

        if cooling:
            return decision("none", now_layout, "cooling down after the last action", current)
        if obs.starting_workers and current.within(cfg):
            reason = f"waiting for {obs.starting_workers} workers to start"
            return decision("none", now_layout, reason, current)
        total = sum(now_layout)
        if threatened:
            self._shrinkable_since = None
            why = f"SLO {'observed' if violated else 'predicted'} over its limit"
            same = self._best_split(obs, total, violated)
            if same is not None and same[0] != now_layout:
                reason = f"{why}; another split of the same {total} workers meets it"
                return decision("switch", same[0], reason, same[1])
            for workers in range(total + 1, cfg.max_workers + 1):
                grown = self._best_split(obs, workers, violated)
                if grown is not None:
                    reason = f"{why}; no split of {total} workers meets it, {workers} do"
                    return decision("grow", grown[0], reason, grown[1])
            best = self._best_split(obs, cfg.max_workers, True, require=False)
            assert best is not None
            none_meets = f"no layout of up to {cfg.max_workers} workers meets it"
            layout, pred = best
            if layout != now_layout and pred.score(cfg) < CLOSER * current.score(cfg):
                # Still the best we can do: the closest layout within bounds serves more.
                action = "switch" if sum(layout) == total else "grow"
                reason = f"{why}; {none_meets}: moving to the closest, {layout[0]}P{layout[1]}D"
                return decision(action, layout, reason, pred)
            reason = f"{why}; {none_meets}: not growing"
            return decision("infeasible", now_layout, reason, pred)
        if total > cfg.min_workers:
            smaller = self._best_split(obs, total - 1, False, factor=cfg.shrink_at)
            if smaller is not None:
                if self._shrinkable_since is None:
                    self._shrinkable_since = obs.at
                if obs.at - self._shrinkable_since >= cfg.shrink_hold_s:
                    held = f"{cfg.shrink_hold_s:.0f} s"
                    reason = f"{total - 1} workers meet the SLO with margin for {held}"
                    return decision("shrink", smaller[0], reason, smaller[1])
                return decision("none", now_layout, "could shrink; holding", current)
        self._shrinkable_since = None
        return decision("none", now_layout, "within the SLO", current)

    def _best_split(
        self,
        obs: Observation,
        workers: int,
        urgent: bool,
        factor: float = 1.0,
        require: bool = True,
    ) -> tuple[tuple[int, int], Prediction] | None:
        """The split of `workers` with the best score (meeting the SLO x factor unless not
        `require`); layouts left recently are skipped unless `urgent`."""
        options = []
        for prefill in range(1, workers):
            layout = (prefill, workers - prefill)
            left = self._left.get(layout)
            if not urgent and left is not None and obs.at - left < self.config.flap_window_s:
                continue
            pred = predict(self.model, self.config, obs, *layout)
            if require and not pred.within(self.config, factor):
                continue
            options.append((pred.score(self.config), layout, pred))
        if not options:
            return None
        _, layout, pred = min(options)
        return layout, pred


def _over(value: float | None, limit: float) -> bool:
    return value is not None and value > limit
