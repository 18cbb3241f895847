"""PNG plots of result records, drawn on matplotlib's Agg canvas without pyplot's global state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from loadtest.results import RequestRow, request_rows

MS_PER_S = 1000.0
METRIC_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
DPI = 100


def plot_run(record: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """latency_cdf.png, latency_over_time.png and timeline.png for one run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = request_rows(record)
    ok = [row for row in rows if not row.error]
    label = str(record.get("label") or "run")
    return [
        plot_latency_cdfs({label: ok}, out_dir / "latency_cdf.png"),
        _plot_over_time(ok, out_dir / "latency_over_time.png"),
        _plot_timeline(rows, out_dir / "timeline.png"),
    ]


def plot_latency_cdfs(series: Mapping[str, Sequence[RequestRow]], path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT, ITL and E2EL, one line per labelled run."""
    fig = _figure((11, 8))
    for ax, (metric, title) in zip(fig.subplots(2, 2).flat, METRIC_TITLES.items(), strict=True):
        for label, rows in series.items():
            values = np.sort(metric_values_ms(rows, metric))
            if len(values):
                ax.step(
                    values, np.arange(1, len(values) + 1) / len(values), where="post", label=label
                )
        ax.set(title=f"{title} CDF", xlabel=f"{title} (ms)", ylabel="fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path)


def metric_values_ms(rows: Sequence[RequestRow], metric: str) -> np.ndarray:
    if metric == "itl":
        values = [gap for row in rows for gap in row.itl]
    elif metric == "tpot":
        values = [row.tpot for row in rows if row.tpot is not None]
    else:
        values = [getattr(row, metric) for row in rows]
    return np.asarray(values, dtype=float) * MS_PER_S


def plot_bars(values: Mapping[str, Mapping[str, float]], path: Path) -> Path:
    """One bar group per metric (outer key), one bar per run (inner key)."""
    fig = _figure((11, 4))
    axes = np.atleast_1d(fig.subplots(1, len(values)))
    for ax, (metric, by_run) in zip(axes, values.items(), strict=True):
        ax.bar(list(by_run), list(by_run.values()), color=[f"C{i}" for i in range(len(by_run))])
        ax.set_title(metric)
        ax.tick_params(axis="x", labelrotation=20)
    return _save(fig, path)


def plot_sweep(
    loads: Sequence[float],
    goodputs: Sequence[float],
    throughputs: Sequence[float],
    knee: int,
    load_label: str,
    path: Path,
) -> Path:
    """Goodput and request throughput against offered load, the knee marked."""
    fig = _figure((7, 5))
    ax = fig.subplots()
    ax.plot(loads, throughputs, marker=".", color="C7", linestyle=":", label="request throughput")
    ax.plot(loads, goodputs, marker="o", color="C0", label="goodput")
    ax.axvline(loads[knee], color="C3", linestyle="--", label=f"knee at {loads[knee]:g}")
    ax.plot([loads[knee]], [goodputs[knee]], marker="*", markersize=16, color="C3")
    ax.set(xlabel=load_label, ylabel="requests/s", title="Goodput vs offered load")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _plot_over_time(rows: Sequence[RequestRow], path: Path) -> Path:
    fig = _figure((10, 7))
    ttft_ax, itl_ax = fig.subplots(2, 1, sharex=True)
    ttft_ax.scatter([r.start for r in rows], [r.ttft * MS_PER_S for r in rows], s=8)
    ttft_ax.set(ylabel="TTFT (ms)", title="TTFT by send time")
    token_times = [row.start + row.ttft + np.cumsum(row.itl) for row in rows]
    gaps = [np.asarray(row.itl) for row in rows]
    if rows:
        itl_ax.scatter(
            np.concatenate(token_times), np.concatenate(gaps) * MS_PER_S, s=3, color="C1"
        )
    itl_ax.set(xlabel="time since start (s)", ylabel="ITL (ms)", title="ITL by token arrival")
    for ax in (ttft_ax, itl_ax):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _plot_timeline(rows: Sequence[RequestRow], path: Path) -> Path:
    """One line per request by send time: waiting for the first token, then decoding."""
    fig = _figure((10, max(3.0, min(12.0, 0.05 * len(rows) + 2))))
    ax = fig.subplots()
    ordered = sorted(rows, key=lambda row: row.start)
    index = np.arange(len(ordered))
    start = np.array([row.start for row in ordered], dtype=float)
    first = start + np.array([row.ttft for row in ordered], dtype=float)
    end = np.maximum(first, start + np.array([row.e2el for row in ordered], dtype=float))
    ok = np.array([not row.error for row in ordered], dtype=bool)
    ax.hlines(index[ok], start[ok], first[ok], color="C0", label="until first token")
    ax.hlines(index[ok], first[ok], end[ok], color="C2", label="decoding")
    ax.hlines(index[~ok], start[~ok], end[~ok], color="C3", label="failed")
    ax.set(xlabel="time since start (s)", ylabel="request (by send time)", title="Request timeline")
    ax.legend(loc="upper left", fontsize="small")
    return _save(fig, path)


def _figure(size: tuple[float, float]) -> Figure:
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path
