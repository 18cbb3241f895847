"""`tandem bench compare`: saved results side by side, each against the first, and overlaid
plots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from loadtest.errors import BenchError
from loadtest.results import Record, has_requests, load_record, request_rows

ROWS = (
    ("completed", "successful requests"),
    ("failed", "failed requests"),
    ("duration", "duration (s)"),
    ("request_throughput", "requests/s"),
    ("request_goodput", "goodput (req/s)"),
    ("output_throughput", "output tokens/s"),
    ("total_token_throughput", "total tokens/s"),
    *(
        (f"{stat}_{metric}_ms", f"{stat} {metric.upper()} (ms)")
        for metric in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "p99")
    ),
)
BAR_METRICS = ("request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms")


def load_labelled(paths: Sequence[Path]) -> dict[str, Record]:
    """Records by label: the record's own label, else the file name; repeats get a suffix."""
    if len(paths) < 2:
        raise BenchError("compare needs at least two result files")
    labelled: dict[str, Record] = {}
    for path in paths:
        record = load_record(path)
        label = str(record.get("label") or path.stem)
        while label in labelled:
            label += "'"
        labelled[label] = record
    return labelled


def compare_table(labelled: Mapping[str, Record]) -> str:
    labels = list(labelled)
    base = labelled[labels[0]]
    cells = [
        [_cell(record.get(key), base.get(key), record is base) for record in labelled.values()]
        for key, _ in ROWS
    ]
    width = max(14, *(len(label) for label in labels), *(len(c) for row in cells for c in row))
    title_width = max(len(title) for _, title in ROWS)
    lines = [" " * title_width + "".join(f"  {label:>{width}}" for label in labels)]
    for (_, title), row in zip(ROWS, cells, strict=True):
        lines.append(f"{title:<{title_width}}" + "".join(f"  {cell:>{width}}" for cell in row))
    return "\n".join(lines)


def _cell(value: object, base: object, is_base: bool) -> str:
    if value is None:
        return "-"
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    numeric = isinstance(value, (int, float)) and isinstance(base, (int, float)) and base != 0
    return text if is_base or not numeric else f"{text} ({(value - base) / base:+.1%})"


def plot_comparison(labelled: Mapping[str, Record], out_dir: Path) -> list[Path]:
    from loadtest.plots import plot_bars, plot_latency_cdfs  # matplotlib takes a second to import

    series = {  # (a record without per-request lists has bars only)
        label: [r for r in request_rows(rec) if not r.error]
        for label, rec in labelled.items()
        if has_requests(rec)
    }
    bars = {
        key: {label: float(rec.get(key) or 0.0) for label, rec in labelled.items()}
        for key in BAR_METRICS
    }
    plots = [plot_latency_cdfs(series, out_dir / "compare_latency_cdf.png")] if series else []
    return [*plots, plot_bars(bars, out_dir / "compare_summary.png")]
