"""Sweeps over offered load (request rates or concurrencies): one run per value, goodput against
load, and the knee: the lowest load that reaches KNEE_SHARE of the best goodput, where adding
load stops paying."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from loadtest.config import LoadConfig, SweepParameter, SweepSpec
from loadtest.errors import BenchError
from loadtest.results import Record

KNEE_SHARE = 0.95


def parse_sweep(text: str) -> SweepSpec:
    """'request-rate=1,2,4' or 'max-concurrency=1,8,32'."""
    name, sep, listed = text.partition("=")
    choices = ", ".join(p.value for p in SweepParameter)
    if not sep or name not in {p.value for p in SweepParameter}:
        raise BenchError(f"--sweep {text!r}: expected NAME=V1,V2,... with NAME one of {choices}")
    parameter = SweepParameter(name)
    try:
        values = tuple(float(v) for v in listed.split(","))
    except ValueError:
        raise BenchError(f"--sweep {text!r}: values must be numbers") from None
    if not all(0 < v < math.inf for v in values):  # (NaN fails too)
        raise BenchError(f"--sweep {text!r}: values must be finite and > 0")
    if parameter is SweepParameter.MAX_CONCURRENCY and any(v != int(v) for v in values):
        raise BenchError(f"--sweep {text!r}: concurrencies must be whole numbers")
    return SweepSpec(parameter, tuple(sorted(set(values))))


def load_at(spec: SweepSpec, base: LoadConfig, value: float) -> LoadConfig:
    if spec.parameter is SweepParameter.REQUEST_RATE:
        return replace(base, request_rate=value)
    return replace(base, max_concurrency=int(value))


def run_sweep(
    spec: SweepSpec, base: LoadConfig, measure: Callable[[LoadConfig], Record]
) -> list[Record]:
    return [measure(load_at(spec, base, value)) for value in spec.values]


def goodput_of(record: Record) -> float:
    """Request goodput when SLOs were given; otherwise every completed request counts."""
    goodput = record.get("request_goodput")
    return float(record["request_throughput"] if goodput is None else goodput)


def find_knee(goodputs: Sequence[float], share: float = KNEE_SHARE) -> int:
    """Index of the first point within `share` of the best goodput."""
    best = max(goodputs)
    return next(i for i, goodput in enumerate(goodputs) if goodput >= share * best)


def sweep_record(spec: SweepSpec, runs: list[Record]) -> Record:
    knee = find_knee([goodput_of(run) for run in runs])
    summary = {
        "parameter": spec.parameter.value,
        "values": list(spec.values),
        "knee_index": knee,
        "knee_value": spec.values[knee],
        "goodput_metric": "request_goodput"
        if runs[0].get("request_goodput") is not None
        else "request_throughput",
    }
    return {"sweep": summary, "runs": runs}


def format_sweep(record: Record) -> str:
    summary, runs = record["sweep"], record["runs"]
    header = (
        f"{summary['parameter']:>16} {'ok':>6} {'failed':>6} {'req/s':>8} {'goodput':>8} "
        f"{'TTFT ms':>9} {'p99 TTFT':>9} {'TPOT ms':>9} {'p99 TPOT':>9}"
    )
    lines = [header, "-" * len(header)]
    for index, (value, run) in enumerate(zip(summary["values"], runs, strict=True)):
        mark = "  <- knee" if index == summary["knee_index"] else ""
        lines.append(
            f"{value:>16g} {run['completed']:>6} {run.get('failed', 0):>6} "
            f"{run['request_throughput']:>8.2f} {goodput_of(run):>8.2f} "
            f"{run['mean_ttft_ms']:>9.1f} {run['p99_ttft_ms']:>9.1f} "
            f"{run['mean_tpot_ms']:>9.1f} {run['p99_tpot_ms']:>9.1f}{mark}"
        )
    lines.append(
        f"goodput = {summary['goodput_metric']}; knee: first load within "
        f"{KNEE_SHARE:.0%} of the best goodput"
    )
    return "\n".join(lines)
