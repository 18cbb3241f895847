"""The result record of one run: a JSON-ready dict with vLLM's `bench serve` keys, plus tandem's
extras (`e2els`, `aborted_requests`, `unsent_requests`, run settings). Per-request lists are
parallel and cover every finished request, failed ones included, as in vLLM. Saved under the
file name vLLM would give it unless one is named."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from loadtest.client import RequestResult
from loadtest.config import METRICS, ResultFile
from loadtest.errors import BenchError
from loadtest.metrics import BenchmarkMetrics, Distribution, output_len
from loadtest.runner import RunOutcome
from planning.slo import percentile_key

REQUIRED_KEYS = ("duration", "completed")  # what the comparison table reads
# vLLM writes these only with --save-detailed: without them a record has no per-request plots
PER_REQUEST_KEYS = ("ttfts", "itls", "output_lens", "errors")

Record = dict[str, Any]  # one run's result, as saved to JSON


class RequestRow(NamedTuple):
    """One request read back from a record; times in seconds."""

    start: float  # since the benchmark started
    ttft: float
    itl: list[float]
    e2el: float
    output_len: int
    error: str  # "" when the request succeeded

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def result_record(
    metrics: BenchmarkMetrics,
    results: Sequence[RequestResult],
    outcome: RunOutcome,
    settings: Mapping[str, object],
) -> Record:
    record: Record = dict(settings)
    record.update(
        duration=outcome.duration_s,
        completed=metrics.completed,
        failed=metrics.failed,
        aborted_requests=outcome.num_aborted,
        unsent_requests=outcome.num_unsent,
        total_input_tokens=metrics.total_input,
        total_output_tokens=metrics.total_output,
        request_throughput=metrics.request_throughput,
        request_goodput=metrics.request_goodput,
        output_throughput=metrics.output_throughput,
        total_token_throughput=metrics.total_token_throughput,
        max_output_tokens_per_s=metrics.max_output_tokens_per_s,
        max_concurrent_requests=metrics.max_concurrent_requests,
        peak_concurrent_requests=metrics.peak_concurrent_requests,
    )
    for name in METRICS:
        record.update(_distribution_keys(name, getattr(metrics, name)))
    record.update(_per_request_lists(results, outcome.started_at))
    return record


def _distribution_keys(name: str, dist: Distribution) -> dict[str, float]:
    keys = {f"mean_{name}_ms": dist.mean, f"median_{name}_ms": dist.median}
    keys[f"std_{name}_ms"] = dist.std
    keys.update({percentile_key(p, name): value for p, value in dist.percentiles.items()})
    return keys


def _per_request_lists(results: Sequence[RequestResult], started_at: float) -> dict[str, list]:
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [output_len(r) for r in results],
        "ttfts": [_or_zero(r.ttft) for r in results],
        "itls": [list(r.itl) for r in results],
        "latencies": [_or_zero(r.latency) for r in results],
        "e2els": [_or_zero(r.latency) for r in results],
        "start_times": [r.sent_at - started_at for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error or "" for r in results],
    }


def _or_zero(seconds: float | None) -> float:
    return 0.0 if seconds is None else seconds  # vLLM writes 0 for a request that never got a token


def has_requests(record: Mapping[str, Any]) -> bool:
    return all(key in record for key in PER_REQUEST_KEYS)


def request_rows(record: Mapping[str, Any]) -> list[RequestRow]:
    """Empty for a record without per-request lists (vLLM's without --save-detailed)."""
    if not has_requests(record):
        return []
    count = len(record["ttfts"])
    starts = record.get("start_times") or [0.0] * count
    # vLLM writes no e2els: send to last chunk is TTFT plus the gaps after it
    e2els = record.get("e2els") or [
        ttft + sum(itl) if ttft else 0.0
        for ttft, itl in zip(record["ttfts"], record["itls"], strict=True)
    ]
    columns = (starts, record["ttfts"], record["itls"], e2els, record["output_lens"])
    return [RequestRow(*fields) for fields in zip(*columns, record["errors"], strict=True)]


def default_result_filename(record: Mapping[str, Any]) -> str:
    """vLLM's name: {label or backend}-{request_rate}qps[-concurrency{N}]-{model}-{date}.json,
    the model's last path part; a sweep's names its parameter where the rate would be."""
    if "sweep" in record:
        first = record["runs"][0]
        load = f"sweep-{record['sweep']['parameter']}"
    else:
        first = record
        concurrency = first["max_concurrency"]
        load = f"{first['request_rate']}qps" + (
            "" if concurrency is None else f"-concurrency{concurrency}"
        )
    label = first["label"] or first["backend"]
    model = str(first["model_id"]).split("/")[-1]
    return f"{label}-{load}-{model}-{first['date']}.json"


def result_path(where: ResultFile, record: Mapping[str, Any]) -> Path:
    name = Path(where.filename or default_result_filename(record))
    return name if where.directory is None else where.directory / name


def check_result_target(where: ResultFile) -> None:
    """Refuses, before a run, a --save-result target the run could not write: a
    --result-dir that is a file (or cannot be made), a --result-filename that is a folder."""
    if where.directory is not None:
        try:
            where.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise BenchError(f"--result-dir {where.directory} cannot be used: {err}") from None
    if where.filename is not None:
        path = Path(where.filename) if where.directory is None else where.directory / where.filename
        if path.is_dir():
            raise BenchError(f"the result file {path} is a folder")
        folder = next((p for p in path.parents if p.exists()), None)  # the nearest that exists
        if folder is not None and not folder.is_dir():  # (found out only after the run)
            raise BenchError(f"the result file {path} cannot be made: {folder} is a file")


def check_plot_dir(plot_dir: Path) -> None:
    """Refuses, before a run, a --plot folder the plots could not be written to."""
    try:
        plot_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BenchError(f"--plot {plot_dir} cannot be used: {err.strerror}") from None


def save_record(record: Mapping[str, Any], path: Path) -> None:
    """Writes the record; when `path` cannot be written, writes it to the working folder
    instead (a long run's results are not lost) and raises BenchError naming both."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    except OSError as err:
        fallback = Path(f"tandem-result-{os.getpid()}-{int(time.time())}.json")
        fallback.write_text(json.dumps(record) + "\n", encoding="utf-8")
        raise BenchError(f"cannot write {path} ({err}); the result is in {fallback}") from None


def load_record(path: Path) -> Record:
    """A saved single-run record; BenchError when the file is not one."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"result file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BenchError(f"result file {path} is not readable JSON: {err}") from None
    if isinstance(record, dict) and "runs" in record and "sweep" in record:
        raise BenchError(f"result file {path} is a sweep; compare takes single-run results")
    missing = [key for key in REQUIRED_KEYS if not isinstance(record, dict) or key not in record]
    if missing:
        raise BenchError(f"result file {path} is not a benchmark result (no {', '.join(missing)})")
    return record
