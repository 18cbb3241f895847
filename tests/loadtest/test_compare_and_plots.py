"""`tandem bench compare` and the PNG plots, from records built out of hand-made results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import cli as bench_cli
from loadtest.client import RequestResult
from loadtest.compare import compare_table, load_labelled
from loadtest.errors import BenchError
from loadtest.metrics import compute_metrics
from loadtest.plots import plot_run
from loadtest.results import Record, load_record, request_rows, result_record
from loadtest.runner import RunOutcome
from tests.support.bench import parse_bench
from tests.support.png import png_size


def make_record(itl: float, label: str | None = None, failures: int = 0) -> Record:
    results = [
        RequestResult(10, 0.1 * i, 0.1, (itl,) * 4, 0.1 + 4 * itl, 5, "t " * 5, None)
        for i in range(4)
    ]
    results += [RequestResult(10, 0.5, None, (), None, None, "", "HTTP 500")] * failures
    metrics = compute_metrics(results, 1.0, (50.0, 99.0), None)
    outcome = RunOutcome(
        tuple(results), started_at=0.0, duration_s=1.0, num_aborted=0, num_unsent=0
    )
    return result_record(metrics, results, outcome, {"label": label})


def save(record: Record, path: Path) -> Path:
    path.write_text(json.dumps(record))
    return path


def test_compare_table_shows_each_run_against_the_first(tmp_path: Path) -> None:
    a = save(make_record(itl=0.02, label="baseline"), tmp_path / "a.json")
    b = save(make_record(itl=0.03), tmp_path / "tandem.json")
    table = compare_table(load_labelled([a, b]))
    header, *rows = table.splitlines()
    assert header.split() == ["baseline", "tandem"]
    tpot = next(row for row in rows if row.startswith("mean TPOT (ms)"))
    assert tpot.split()[-3:] == ["20.00", "30.00", "(+50.0%)"]
    completed = next(row for row in rows if row.startswith("successful requests"))
    assert completed.split()[-3:] == ["4", "4", "(+0.0%)"]


def test_compare_cli_prints_and_plots(tmp_path: Path, capsys) -> None:
    a = save(make_record(itl=0.02), tmp_path / "a.json")
    b = save(make_record(itl=0.04, failures=1), tmp_path / "b.json")
    args = parse_bench("compare", str(a), str(b), "--plot", str(tmp_path / "plots"))
    assert bench_cli.run(args) == 0
    assert "(+100.0%)" in capsys.readouterr().out
    for name in ("compare_latency_cdf.png", "compare_summary.png"):
        assert min(png_size(tmp_path / "plots" / name)) > 100


def test_vllm_records_compare_with_or_without_per_request_lists(tmp_path: Path) -> None:
    """vLLM's `bench serve --save-result` writes the per-request lists only with
    --save-detailed, and never `e2els`: the first was refused ("not a benchmark result"), the
    second plotted every E2EL as 0 and every TPOT negative."""
    ours = make_record(itl=0.02, label="tandem")
    summary = {k: v for k, v in ours.items() if k not in ("ttfts", "itls", "output_lens",
               "errors", "e2els", "start_times", "generated_texts", "input_lens")}  # fmt: skip
    detailed = {k: v for k, v in ours.items() if k != "e2els"}
    a = save(ours, tmp_path / "a.json")
    b = save({**summary, "label": "vllm"}, tmp_path / "b.json")
    c = save({**detailed, "label": "vllm-detailed"}, tmp_path / "c.json")
    assert "vllm" in compare_table(load_labelled([a, b]))
    args = parse_bench("compare", str(a), str(b), str(c), "--plot", str(tmp_path / "plots"))
    assert bench_cli.run(args) == 0
    [row, *_] = request_rows(load_record(c))
    assert row.e2el == pytest.approx(0.1 + 4 * 0.02)  # TTFT and the gaps after it
    assert row.tpot == pytest.approx(0.02)
    assert request_rows(load_record(b)) == []


def test_compare_rejects_files_that_are_not_results(tmp_path: Path) -> None:
    good = save(make_record(itl=0.02), tmp_path / "good.json")
    sweep = save({"sweep": {}, "runs": []}, tmp_path / "sweep.json")
    other = save({"hello": 1}, tmp_path / "other.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(BenchError, match="is a sweep; compare takes single-run results"):
        load_labelled([good, sweep])
    with pytest.raises(BenchError, match=r"other.json is not a benchmark result \(no duration, "):
        load_labelled([good, other])
    with pytest.raises(BenchError, match="broken.json is not readable JSON"):
        load_labelled([good, broken])
    with pytest.raises(BenchError, match="compare needs at least two result files"):
        load_labelled([good])


def test_plot_run_writes_the_three_plots(tmp_path: Path) -> None:
    paths = plot_run(make_record(itl=0.02, failures=2), tmp_path / "plots")
    assert [p.name for p in paths] == ["latency_cdf.png", "latency_over_time.png", "timeline.png"]
    assert all(min(png_size(p)) > 100 for p in paths)
