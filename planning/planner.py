"""The SLO planner's decisions: how many prefill and decode workers the load in front of us needs.

Pure logic on numbers (no Ray, no simulator): whoever drives it (coordinator/planner_loop.py
live, simulation/autoscale.py in simulation) hands it an `Observation` every few seconds and
carries out the `Decision` it returns.

Prediction, queue included (`predict`), from the per-step cost model:
- prefill: a prompt of the mean length takes t_p seconds on a prefill worker; P workers serve
  utilisation rho = rate x t_p / P; TTFT (at the SLO's percentile) = the backlog already queued
  (tokens x seconds per token / P) + that percentile of the wait for one of P servers (M/M/c,
  halved: prefills of like prompts take like times) + t_p, infinite at rho >= 1; plus, while
  requests wait in line for decode room, that line over the rate requests finish on a full
  decode pool;
- decode: with n requests per decode worker a step takes step(n) (n decodes of mean context),
  and Little's law ties them: n = rate / D x output_len x step(n); solved by iteration, capped
  at max_num_seqs and at the requests of mean context (plus the growth room the worker keeps for
  each) its KV cache holds. A decode pool
  that cannot keep up even at the cap is infinite ITL.
- the rate it predicts for is the one a worker start ahead (as last measured, else `lead_s`)
  when the window sees a clear upward trend: a worker asked for now serves the load of then.

Decisions, in order of cost, at most one per tick:
1. the SLO is threatened (predicted or observed TTFT/ITL over its limit): if predicted, switch
   as few workers as will do to the other pool when some split of the same workers meets the
   SLO (an observed-only violation switches nothing: latency observed now may be the backlog of
   a past peak, which a switch does not clear but does restart the requests it moves);
2. no split does: grow, asking for the whole deficit at once (the smallest worker count up to
   `max_workers` with a layout adding to each pool that meets it); none does up to the cap:
   move to the layout of `max_workers` (adding to each pool; at the cap, any split) with the
   most capacity (the highest rate it serves within the SLO, which depends on the lengths, not
   on the backlog of the moment) if it serves `ROOMIER` times more than the layout now and was
   not left within `flap_window_s`, else report it infeasible; never grow past the cap;
3. all is well, the rate is not rising, and one worker fewer (from either pool) would still meet
   the SLO with margin (its load re-predicted on the survivors) for `shrink_hold_s`: shrink by
   one.
Stability: a cool-down after each action; the layout just left is not returned to within
`flap_window_s` (no A -> B -> A), and a switch goes to no layout left within it; shrinking needs
the wide margin `shrink_at`, growing only the limit, so a constant load settles and stays.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from planning.cost_model import CostModel, StepShape

ITERATIONS = 40
NEAR_CONSTANT = 0.5  # M/D/c waits are about half M/M/c's
ROOMIER = 1.1  # an infeasible SLO: move only to a layout serving this much more (capacity ratio)
CAPACITY_STEPS = 16  # bisections of the rate a layout serves within the SLO
CAPACITY_CACHE = 1024  # capacities kept, by layout and whole-token mean lengths
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
    # A rising rate is predicted this far ahead: a new worker's start, until one is measured
    # (Observation.worker_start_s).
    lead_s: float = 0.0
    decode_headroom_tokens: int = 0  # growth room a decode worker keeps per request (engine)
    # Workers asked for and not serving yet hold further decisions while the SLO is met, for
    # at most this long: a start that never lands (no node for it) must not stop a shrink.
    start_wait_s: float = 300.0
    percentile: float = 99.0  # of TTFT and ITL, as the SLO states them


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
    rate_trend: float = 0.0  # requests per second, per second (LoadWindow.trend)
    decode_kv_tokens: int = 0  # the KV cache of a decode worker (the smallest), 0: unknown
    waiting_for_room: int = 0  # requests in line for decode room (coordinator/room.py)
    worker_start_s: float = 0.0  # measured spawn -> serving of a new worker (0: not yet)


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
    wait = queue_wait(obs.arrival_rate, t_prefill, max(prefill, 1), config.percentile / 100)
    ttft = backlog + wait + t_prefill
    context = prompt + output / 2
    cap = config.max_num_seqs
    if obs.decode_kv_tokens:
        held = context + min(config.decode_headroom_tokens, output / 2)  # and its growth room
        cap = max(1, min(cap, int(obs.decode_kv_tokens // held)))
    if decode < 1:  # every decode worker died (replacements on the way): nothing is served
        return Prediction(math.inf, math.inf, rho, 0.0)
    per_worker_rate = obs.arrival_rate / decode
    n = 1.0
    for _ in range(ITERATIONS):
        step = model.predict(StepShape(0, 0, max(round(n), 1), round(max(n, 1) * context)))
        n = min(per_worker_rate * output * step, cap)
    step = model.predict(StepShape(0, 0, max(round(n), 1), round(max(n, 1) * context)))
    keeps_up = per_worker_rate * output * step <= cap
    itl = step if keeps_up else math.inf
    if not keeps_up:
        ttft = math.inf  # admission waits behind a decode pool that falls behind
    elif obs.waiting_for_room:  # the line for decode room drains as requests finish there
        full_step = model.predict(StepShape(0, 0, cap, round(cap * context)))
        finishing = decode * cap / (output * full_step)  # requests per second, pool full
        ttft += obs.waiting_for_room / finishing
    return Prediction(ttft, itl, rho, n)


def queue_wait(rate: float, service_s: float, servers: int, quantile: float) -> float:
    """The `quantile` of the wait for one of `servers` equal servers (M/M/c: P(wait > t) =
    C e^-(c mu - lambda) t, C from Erlang's formula), halved for service times that hardly vary
    (prefills of like prompts); infinite at or past saturation."""
    offered = rate * service_s
    if offered >= servers:
        return math.inf
    blocked = 1.0  # Erlang B, built up one server at a time (stable for any c)
    for k in range(1, servers + 1):
        blocked = offered * blocked / (k + offered * blocked)
    waits = blocked / (1 - offered / servers * (1 - blocked))  # Erlang C: P(wait > 0)
    tail = 1.0 - quantile
    if waits <= tail:
        return 0.0
    return NEAR_CONSTANT * math.log(waits / tail) / (servers / service_s - rate)


@dataclass
class Planner:
    model: CostModel
    config: PlannerConfig
    log: deque[Decision] = field(default_factory=lambda: deque(maxlen=DECISION_LOG))
    _last_action_at: float = -math.inf
    _left: dict[tuple[int, int], float] = field(default_factory=dict)  # layout -> when left
    _previous: tuple[int, int] | None = None  # the layout the last action left
    _shrinkable_since: float | None = None
    _starting_since: float | None = None  # since when some workers have been starting
    _capacities: dict[tuple[int, int, int, int], float] = field(default_factory=dict)

    def decide(self, obs: Observation) -> Decision:
        cfg = self.config
        seen, obs = obs, self.ahead(obs)  # predictions are for the rate a new worker will meet
        now_layout = (obs.prefill_workers, obs.decode_workers)
        current = predict(self.model, cfg, obs, *now_layout)
        # Latency is observed as requests finish: with nothing arriving or waiting, a miss is
        # the tail of a past peak, and nothing would serve more workers.
        loaded = obs.arrival_rate > 0 or obs.queued_prefill_tokens > 0 or obs.waiting_for_room
        violated = loaded and (
            _over(obs.observed_ttft_s, cfg.ttft_slo_s) or _over(obs.observed_itl_s, cfg.itl_slo_s)
        )
        threatened = violated or not current.within(cfg)
        cooling = obs.at - self._last_action_at < cfg.cooldown_s
        rate = f"at {obs.arrival_rate:.2f} req/s"
        if obs.arrival_rate != seen.arrival_rate:
            rate += f" ({seen.arrival_rate:.2f} now, rising {obs.rate_trend:+.3f}/s)"

        def decision(action: str, layout: tuple[int, int], reason: str, pred: Prediction):
            made = Decision(
                obs.at, action, *layout, f"{reason} [{rate}]", pred, current,
                obs.observed_ttft_s, obs.observed_itl_s,
            )  # fmt: skip
            if action in ("switch", "grow", "shrink"):
                self._left[now_layout] = obs.at
                self._previous = now_layout
                self._last_action_at = obs.at
                self._shrinkable_since = None
            if action != "none" or not self.log or self.log[-1].action != "none":
                self.log.append(made)
            return made

        if cooling:
            return decision("none", now_layout, "cooling down after the last action", current)
        if not obs.starting_workers:
            self._starting_since = None
        elif self._starting_since is None:
            self._starting_since = obs.at
        waited = 0.0 if self._starting_since is None else obs.at - self._starting_since
        if obs.starting_workers and current.within(cfg) and waited < cfg.start_wait_s:
            reason = f"waiting for {obs.starting_workers} workers to start"
            return decision("none", now_layout, reason, current)
        total = sum(now_layout)
        if threatened:
            self._shrinkable_since = None
            why = f"SLO {'observed' if violated else 'predicted'} over its limit"
            if not current.within(cfg):  # (an observed-only violation may be a past backlog)
                same = self._best(obs, self._splits(now_layout, total), switch=True)
                if same is not None:
                    reason = f"{why}; another split of the same {total} workers meets it"
                    return decision("switch", same[0], reason, same[1])
            for workers in range(total + 1, cfg.max_workers + 1):
                grown = self._best(obs, self._grown(now_layout, workers))
                if grown is not None:
                    reason = f"{why}; no split of {total} workers meets it, {workers} do"
                    return decision("grow", grown[0], reason, grown[1])
            none_meets = f"no layout of up to {cfg.max_workers} workers meets it"
            capped = max(cfg.max_workers, total)  # past the cap (set by hand): switches only
            layouts = (
                self._splits(now_layout, capped)
                if total >= capped
                else self._grown(now_layout, capped)
            )
            roomiest = self._roomiest(obs, layouts, switch=total >= capped)
            if roomiest is not None:
                layout, room = roomiest
                if room > ROOMIER * self.capacity(obs, now_layout):
                    # Still the best we can do: the layout within bounds that serves the most.
                    action = "switch" if sum(layout) == total else "grow"
                    reason = (
                        f"{why}; {none_meets}: moving to the one serving the most, "
                        f"{layout[0]}P{layout[1]}D ({room:.2f} req/s within the SLO)"
                    )
                    return decision(action, layout, reason, predict(self.model, cfg, obs, *layout))
            reason = f"{why}; {none_meets}: not growing"
            return decision("infeasible", now_layout, reason, current)
        if total > cfg.min_workers and obs.rate_trend <= 0:
            p, d = now_layout
            fewer = [layout for layout in ((p - 1, d), (p, d - 1)) if min(layout) >= 1]
            smaller = self._best(obs, fewer, factor=cfg.shrink_at)
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

    def ahead(self, obs: Observation) -> Observation:
        """The observation with the rate expected a worker start from now, if it is rising."""
        lead = obs.worker_start_s or self.config.lead_s
        if obs.rate_trend <= 0 or not lead:
            return obs
        return obs._replace(arrival_rate=obs.arrival_rate + obs.rate_trend * lead)

    def capacity(self, obs: Observation, layout: tuple[int, int]) -> float:
        """The highest arrival rate (requests per second, of the observed lengths, no backlog)
        the layout serves within the SLO; 0 if it cannot at any rate."""
        key = (*layout, round(obs.mean_prompt), round(obs.mean_output))
        if key not in self._capacities:
            if len(self._capacities) >= CAPACITY_CACHE:
                self._capacities.clear()
            self._capacities[key] = self._capacity(obs, layout)
        return self._capacities[key]

    def _capacity(self, obs: Observation, layout: tuple[int, int]) -> float:
        quiet = obs._replace(queued_prefill_tokens=0)

        def meets(rate: float) -> bool:
            pred = predict(self.model, self.config, quiet._replace(arrival_rate=rate), *layout)
            return pred.within(self.config)

        low, high = 0.0, 1.0
        while meets(high) and high < 1e6:
            low, high = high, high * 2
        if low == 0.0 and not meets(1e-6):
            return 0.0
        for _ in range(CAPACITY_STEPS):
            middle = (low + high) / 2
            low, high = (middle, high) if meets(middle) else (low, middle)
        return low

    def _roomiest(
        self, obs: Observation, layouts: list[tuple[int, int]], switch: bool
    ) -> tuple[tuple[int, int], float] | None:
        """The fresh layout with the most capacity."""
        fresh = self._fresh(obs, layouts, switch)
        options = [(self.capacity(obs, layout), layout) for layout in fresh]
        if not options:
            return None
        room, layout = max(options, key=lambda option: (option[0], -option[1][0]))
        return layout, room

    @staticmethod
    def _splits(now: tuple[int, int], workers: int) -> list[tuple[int, int]]:
        """Every split of `workers` but the layout now."""
        return [(p, workers - p) for p in range(1, workers) if (p, workers - p) != now]

    @staticmethod
    def _grown(now: tuple[int, int], workers: int) -> list[tuple[int, int]]:
        """Splits of `workers` that only add to each pool (no worker changes role)."""
        p, d = now
        return [(q, workers - q) for q in range(max(p, 1), workers - max(d, 1) + 1)]

    def _fresh(
        self, obs: Observation, layouts: list[tuple[int, int]], switch: bool
    ) -> list[tuple[int, int]]:
        """The layouts one may go to: never back to the layout just left within `flap_window_s`
        (no A -> B -> A); by a switch, to none left within it (a switch answers the mix of
        the moment, and switching around would chase it)."""
        window = self.config.flap_window_s

        def recent(layout: tuple[int, int]) -> bool:
            return obs.at - self._left.get(layout, -math.inf) < window

        if switch:
            return [x for x in layouts if not recent(x)]
        return [x for x in layouts if x != self._previous or not recent(x)]

    def _best(
        self,
        obs: Observation,
        layouts: list[tuple[int, int]],
        factor: float = 1.0,
        switch: bool = False,
    ) -> tuple[tuple[int, int], Prediction] | None:
        """Of the fresh `layouts` meeting the SLO x `factor`, the best score; for a `switch`, the
        fewest workers switching pools first (each switch restarts the requests it holds)."""
        now = obs.prefill_workers
        options = []
        for layout in self._fresh(obs, layouts, switch):
            pred = predict(self.model, self.config, obs, *layout)
            if pred.within(self.config, factor):
                moves = abs(layout[0] - now) if switch else 0
                options.append((moves, pred.score(self.config), layout, pred))
        if not options:
            return None
        *_, layout, pred = min(options)
        return layout, pred


def _over(value: float | None, limit: float) -> bool:
    return value is not None and value > limit
