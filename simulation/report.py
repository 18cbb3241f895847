"""A simulation's outcome as a `tandem bench` record: the same vLLM keys, computed by the same
functions, so `tandem bench compare` lines simulated and real runs up side by side."""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence

import numpy as np

from loadtest.client import RequestResult
from loadtest.config import GoodputSLO, LoadConfig
from loadtest.metrics import compute_metrics
from loadtest.results import Record, result_record
from loadtest.runner import RunOutcome
from simulation.cluster import Outcome, Run, collector_paused
from simulation.deployment import Scenario


def request_result(run: Run) -> RequestResult:
    """What the load client would have recorded for this request."""
    times = run.token_times
    sent = run.sent_at if run.sent_at is not None else 0.0
    done = run.finished_at is not None and run.error is None and len(times) > 0
    return RequestResult(
        prompt_len=len(run.request.prompt_ids),
        sent_at=sent,
        ttft=times[0] - sent if done else None,
        itl=tuple(np.diff(np.frombuffer(times)).tolist()) if done else (),
        latency=times[-1] - sent if done else None,
        output_tokens=len(times) if done else None,
        generated_text="",
        error=None if done else (run.error or "not finished"),
    )


def simulated_record(
    outcome: Outcome,
    scenario: Scenario,
    load: LoadConfig,
    percentiles: Sequence[float] = (50.0, 90.0, 99.0),
    slo: GoodputSLO | None = None,
    dataset_name: str = "trace",
    per_request: bool = True,
    metadata: Mapping[str, object] | None = None,
) -> Record:
    """The record of `tandem bench` keys (and `simulation` with what was simulated);
    `per_request` False leaves the per-request lists empty (long traces)."""
    with collector_paused():
        finished = [r for r in outcome.runs if r.finished_at is not None]
        results = [request_result(r) for r in finished]
        metrics = compute_metrics(results, max(outcome.duration_s, 1e-9), percentiles, slo)
    run_outcome = RunOutcome(
        tuple(results), 0.0, outcome.duration_s, outcome.num_aborted, outcome.num_unsent
    )
    dep = scenario.deployment
    settings: Record = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "simulated",
        "backend": "simulated",
        "label": f"simulated {dep.describe()}",
        "model_id": scenario.costs.step.info.model or "unknown",
        **dict(metadata or {}),
        "dataset_name": dataset_name,
        "num_prompts": len(outcome.runs),
        "request_rate": "inf" if math.isinf(load.request_rate) else load.request_rate,
        "burstiness": load.burstiness,
        "max_concurrency": load.max_concurrency,
        "seed": load.seed,
        "percentiles": list(percentiles),
        "goodput_slo": None if slo is None else slo.limits_ms(),
    }
    record = result_record(metrics, results if per_request else [], run_outcome, settings)
    busy = {w.worker_id: w.busy_seconds for w in outcome.workers.values()}
    record["simulation"] = {
        "deployment": dep.describe(),
        "prefill_workers": dep.prefill_workers,
        "decode_workers": dep.decode_workers,
        "routing": dep.routing,
        "events": outcome.num_events,
        "busy_fraction": {
            w: round(s / outcome.duration_s, 4) if outcome.duration_s else 0.0
            for w, s in busy.items()
        },
    }

    return record
