"""The console table of one run, read from its result record, in the layout of vLLM's."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from loadtest.config import METRICS

WIDTH = 50
LABEL_WIDTH = 40
MAX_ERROR_KINDS = 5
SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def format_record(record: Mapping[str, Any], metrics: Sequence[str] = METRICS) -> str:
    """The summary, then a section for each of `metrics` (--percentile-metrics)."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    lines += _row_lines(_summary_rows(record))
    for key, short, title in SECTIONS:
        if key not in metrics:
            continue
        lines.append(f" {title} ".center(WIDTH, "-"))
        lines += _row_lines(_latency_rows(record, key, short))
    lines.append("=" * WIDTH)
    lines += _error_lines(record.get("errors", []))
    return "\n".join(lines)


def _summary_rows(record: Mapping[str, Any]) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [
        ("Successful requests:", record["completed"]),
        ("Failed requests:", record.get("failed", 0)),
    ]
    for key, label in (
        ("aborted_requests", "Aborted at --max-duration:"),
        ("unsent_requests", "Not sent before --max-duration:"),
    ):
        if record.get(key):
            rows.append((label, record[key]))
    rows += [
        ("Benchmark duration (s):", record["duration"]),
        ("Total input tokens:", record["total_input_tokens"]),
        ("Total generated tokens:", record["total_output_tokens"]),
        ("Request throughput (req/s):", record["request_throughput"]),
    ]
    if record.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", record["request_goodput"]))
    rows.append(("Output token throughput (tok/s):", record["output_throughput"]))
    # (as vLLM prints them; a simulated or older record may lack them)
    for key, label in (
        ("max_output_tokens_per_s", "Peak output token throughput (tok/s):"),
        ("max_concurrent_requests", "Peak concurrent requests:"),
    ):
        if key in record:
            rows.append((label, record[key]))
    rows.append(("Total token throughput (tok/s):", record["total_token_throughput"]))
    return rows


def _latency_rows(record: Mapping[str, Any], key: str, short: str) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [
        (f"Mean {short} (ms):", record[f"mean_{key}_ms"]),
        (f"Median {short} (ms):", record[f"median_{key}_ms"]),
        (f"Std {short} (ms):", record[f"std_{key}_ms"]),
    ]
    suffix = f"_{key}_ms"
    for name, value in record.items():
        if name.startswith("p") and name.endswith(suffix) and name[1].isdigit():
            rows.append((f"P{name[1 : -len(suffix)]} {short} (ms):", value))
    return rows


def _row_lines(rows: list[tuple[str, object]]) -> list[str]:
    return [f"{label:<{LABEL_WIDTH}}{_number(value):<10}" for label, value in rows]


def _number(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _error_lines(errors: list[str]) -> list[str]:
    kinds = Counter(error for error in errors if error)
    if not kinds:
        return []
    lines = ["Failure reasons:"]
    lines += [f"  {count} x {error}" for error, count in kinds.most_common(MAX_ERROR_KINDS)]
    if len(kinds) > MAX_ERROR_KINDS:
        lines.append(f"  ... and {len(kinds) - MAX_ERROR_KINDS} other reasons")
    return lines
