"""Sweeps: one run per load, goodput against load, the knee where more load stops paying."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.config import LoadConfig, SweepParameter
from loadtest.sweep import find_knee, load_at, parse_sweep
from tests.support.bench import bench
from tests.support.png import png_size


@pytest.mark.parametrize(
    ("goodputs", "knee"),
    [
        ([1.0, 2.0, 4.0], 2),  # still growing: the last point
        ([1.0, 2.0, 3.0, 3.05, 3.1], 2),  # a plateau: where it starts
        ([1.0, 5.0, 2.0], 1),  # overload: the peak
        ([3.0], 0),
    ],
)
def test_knee(goodputs: list[float], knee: int) -> None:
    assert find_knee(goodputs) == knee


def test_parse_and_apply() -> None:
    spec = parse_sweep("request-rate=4,1,2")
    assert (spec.parameter, spec.values) == (SweepParameter.REQUEST_RATE, (1.0, 2.0, 4.0))
    assert load_at(spec, LoadConfig(max_concurrency=3), 2.0) == LoadConfig(2.0, max_concurrency=3)
    spec = parse_sweep("max-concurrency=8")
    assert load_at(spec, LoadConfig(request_rate=5.0), 8.0) == LoadConfig(5.0, max_concurrency=8)


def test_concurrency_sweep_finds_the_server_capacity(serve, tmp_path: Path) -> None:
    # The server generates two requests at a time; each takes 100 + 2 * 20 = 140 ms. With an E2EL
    # SLO of 210 ms, queued requests (280 ms) miss it: goodput peaks at concurrency 2.
    server = serve(ttft_s=0.1, itl_s=0.02, capacity=2)
    saved, plots = tmp_path / "sweep.json", tmp_path / "plots"
    rec = bench(
        server.url, "--random-input-len", "4", "--random-output-len", "3", "--num-prompts", "4",
        "--sweep", "max-concurrency=1,2,4", "--goodput", "e2el:210",
        "--result-path", str(saved), "--plot", str(plots),
    )  # fmt: skip
    assert rec["sweep"]["knee_value"] == 2
    assert rec["sweep"]["goodput_metric"] == "request_goodput"
    runs = rec["runs"]
    assert [run["max_concurrency"] for run in runs] == [1, 2, 4]
    assert [run["completed"] for run in runs] == [4, 4, 4]
    good = [round(run["request_goodput"] * run["duration"]) for run in runs]
    assert good == [4, 4, 2]  # at concurrency 4, two requests wait 140 ms for a slot
    assert json.loads(saved.read_text())["sweep"]["knee_index"] == 1
    assert png_size(plots / "sweep_goodput.png")[0] > 100
