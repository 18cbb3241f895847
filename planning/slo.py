"""Service-level objectives as operators write them: "ttft_p99=2s,itl_p99=50ms".

Each objective names a metric (ttft, itl, tpot, e2el), a percentile and a limit; `tandem plan`,
`tandem serve --planner` and goodput counting read the same spelling.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple


def percentile_key(percentile: float, metric: str) -> str:
    """p99_ttft_ms, p99.9_ttft_ms: vLLM's spelling."""
    word = str(int(percentile)) if int(percentile) == percentile else str(percentile)
    return f"p{word}_{metric}_ms"


class SloError(ValueError):
    """An SLO that cannot be read; the message says why."""


SLO_KEY = re.compile(r"^(ttft|itl|tpot|e2el)_p(\d+(?:\.\d+)?)$")


class Objective(NamedTuple):
    metric: str  # ttft | itl | tpot | e2el
    percentile: float
    limit_ms: float

    @property
    def key(self) -> str:
        """Its key in a result record, e.g. p99_ttft_ms."""
        return percentile_key(self.percentile, self.metric)


def parse_slo(text: str) -> tuple[Objective, ...]:
    """ "ttft_p99=2s,itl_p99=50ms" -> objectives (a bare number is milliseconds)."""
    objectives = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        match = SLO_KEY.match(name.strip())
        if match is None or not value:
            raise SloError(
                f"an SLO is metric_pNN=limit (metric: ttft, itl, tpot, e2el), not {part!r}"
            )
        if not 0 < float(match[2]) <= 100:
            raise SloError(f"a percentile is in (0, 100], not {match[2]} in {part!r}")
        objectives.append(Objective(match[1], float(match[2]), _milliseconds(value.strip())))
    if not objectives:
        raise SloError("give at least one objective, e.g. ttft_p99=2s,itl_p99=50ms")
    return tuple(objectives)


def _milliseconds(value: str) -> float:
    for suffix, scale in (("ms", 1.0), ("s", 1000.0)):
        if value.endswith(suffix):
            value, factor = value[: -len(suffix)], scale
            break
    else:
        factor = 1.0
    try:
        limit = float(value) * factor
    except ValueError:
        raise SloError(f"not a time limit: {value!r} (e.g. 2s or 50ms)") from None
    if not 0 < limit < math.inf:  # (NaN fails too)
        raise SloError("time limits must be finite and > 0")
    return limit


class PlannerTargets(NamedTuple):
    ttft_s: float
    itl_s: float
    percentile: float  # of TTFT and ITL the planner watches


def planner_targets(objectives: tuple[Objective, ...]) -> PlannerTargets:
    """The TTFT and ITL limits the planner keeps (tpot counts as itl); SloError without both,
    or with two percentiles."""
    limits = {"ttft": [], "itl": []}
    percentiles = set()
    for o in objectives:
        metric = "itl" if o.metric == "tpot" else o.metric
        if metric in limits:
            limits[metric].append(o.limit_ms / 1000.0)
            percentiles.add(o.percentile)
    if not limits["ttft"] or not limits["itl"]:
        raise SloError(
            "the planner needs a TTFT and an ITL objective, e.g. ttft_p99=2s,itl_p99=50ms"
        )
    if len(percentiles) > 1:
        raise SloError("the planner watches one percentile: give TTFT and ITL the same one")
    return PlannerTargets(min(limits["ttft"]), min(limits["itl"]), percentiles.pop())
