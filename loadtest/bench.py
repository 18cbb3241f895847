"""`tandem bench` from a config to saved results: find the model, build the workload, run it once
or as a sweep, then report, save and plot. Failed requests become one BenchError raised after the
results are saved, so a failed run still leaves its partial results behind."""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TextIO

import httpx

from loadtest import event_loop
from loadtest.client import RequestResult
from loadtest.config import BenchConfig, LoadConfig
from loadtest.datasets import sample_requests
from loadtest.errors import BenchError
from loadtest.metrics import compute_metrics
from loadtest.report import format_record
from loadtest.results import (
    Record,
    check_plot_dir,
    check_result_target,
    result_path,
    result_record,
    save_record,
)
from loadtest.runner import run_load
from loadtest.sample import SampleRequest
from loadtest.sweep import format_sweep, goodput_of, run_sweep, sweep_record
from loadtest.target import Target, build_target, resolve_model
from loadtest.token_count import TokenCounter, open_counter

SETUP_TIMEOUT_S = 30.0  # each setup call to the server (its model list, its tokenizer)


def run_bench(config: BenchConfig, out: TextIO) -> Record:
    """Runs the benchmark, prints its table to `out` and returns its record (a sweep's record
    holds one record per load)."""
    if config.output.save_result is not None:  # refused now, not after the run
        check_result_target(config.output.save_result)
    if config.output.plot_dir is not None:
        check_plot_dir(config.output.plot_dir)
    # trust_env=False: requests go straight to the server, never through a configured proxy.
    # The setup calls (/v1/models, /tokenize) answer at once from a live server: a server that
    # accepts connections and says nothing fails here in seconds, not --request-timeout.
    setup_timeout = min(config.target.request_timeout_s, SETUP_TIMEOUT_S)
    with httpx.Client(timeout=setup_timeout, trust_env=False) as http:
        model = resolve_model(http, config.target)
        target = build_target(config.target, model)
        counter = open_counter(
            config.tokenizer, http, config.target.base_url, target.model, config.trust_remote_code
        )
        samples = sample_requests(config.dataset, counter)
        measure = partial(measure_once, config, target, model, samples, counter)
        if config.sweep is None:
            return _finish_single(config, measure(config.load), out)
        runs = run_sweep(config.sweep, config.load, measure)
        return _finish_sweep(config, sweep_record(config.sweep, runs), out)


def measure_once(
    config: BenchConfig,
    target: Target,
    model_id: str,
    samples: list[SampleRequest],
    counter: TokenCounter,
    load: LoadConfig,
) -> Record:
    """One run at `load`; `model_id` is --model (or the first listed), as vLLM records it."""
    outcome = event_loop.run(
        run_load(
            target,
            samples,
            config.sampling,
            load,
            config.target.request_timeout_s,
            config.output.show_progress,
        )
    )
    results = [_with_output_tokens(result, counter) for result in outcome.results]
    output = config.output
    metrics = compute_metrics(results, outcome.duration_s, output.percentiles, output.goodput)
    settings = _settings(config, model_id, load, len(samples))
    return result_record(metrics, results, outcome, settings)


def _with_output_tokens(result: RequestResult, counter: TokenCounter) -> RequestResult:
    """Counts the generated text when the server sent no usage."""
    if not result.success or result.output_tokens is not None:
        return result
    return replace(result, output_tokens=counter.count(result.generated_text))


def _settings(config: BenchConfig, model_id: str, load: LoadConfig, num_prompts: int) -> Record:
    """vLLM's setup keys, --metadata after them, then tandem's."""
    slo = config.output.goodput
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": config.target.backend_name,
        "backend": config.target.backend_name,
        "label": config.output.label,
        "model_id": model_id,
        **dict(config.output.metadata),
        "base_url": config.target.base_url,
        "endpoint": config.target.endpoint,
        "tokenizer_id": str(config.tokenizer) if config.tokenizer else "server:/tokenize",
        "dataset_name": config.dataset.spec.name,
        "num_prompts": num_prompts,
        "request_rate": "inf" if math.isinf(load.request_rate) else load.request_rate,
        "burstiness": load.burstiness,
        "max_concurrency": load.max_concurrency,
        "seed": load.seed,
        "percentiles": list(config.output.percentiles),
        "goodput_slo": None if slo is None else slo.limits_ms(),
    }


def _finish_single(config: BenchConfig, record: Record, out: TextIO) -> Record:
    print(format_record(record, config.output.percentile_metrics), file=out)
    saved = _save(config, record, out)
    if config.output.plot_dir is not None:
        from loadtest.plots import plot_run  # matplotlib takes a second to import

        plot_run(record, config.output.plot_dir)
    _raise_on_failures([record], saved)
    return record


def _finish_sweep(config: BenchConfig, record: Record, out: TextIO) -> Record:
    print(format_sweep(record), file=out)
    saved = _save(config, record, out)
    if config.output.plot_dir is not None:
        from loadtest.plots import plot_sweep

        summary, runs = record["sweep"], record["runs"]
        goodputs = [goodput_of(run) for run in runs]
        throughputs = [run["request_throughput"] for run in runs]
        path = config.output.plot_dir / "sweep_goodput.png"
        plot_sweep(
            summary["values"],
            goodputs,
            throughputs,
            summary["knee_index"],
            summary["parameter"],
            path,
        )
    _raise_on_failures(record["runs"], saved)
    return record


def _save(config: BenchConfig, record: Record, out: TextIO) -> Path | None:
    if config.output.save_result is None:
        return None
    path = result_path(config.output.save_result, record)
    save_record(record, path)
    print(f"Results saved to {path}", file=out)
    return path


def _raise_on_failures(records: Sequence[Record], saved: Path | None) -> None:
    failed = sum(record["failed"] for record in records)
    if failed == 0:
        return
    total = sum(len(record["errors"]) for record in records)
    first = next(error for record in records for error in record["errors"] if error)
    where = f"; results saved to {saved}" if saved is not None else ""
    raise BenchError(f"{failed} of {total} requests failed (first: {first}){where}")
