"""`tandem simulate` and `tandem plan` from the command line: tandem bench's flags in, tandem
bench's JSON out (comparable with `tandem bench compare`), plans that pick a feasible layout or
say there is none, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main
from loadtest.results import load_record

PROFILE = (
    Path(__file__).resolve().parents[2] / "benchmarks" / "profiles" / "smollm2-cpu-1thread.json"
)
WORKLOAD = [
    "--dataset-name", "random", "--random-input-len", "120", "--random-output-len", "16",
    "--num-prompts", "30", "--request-rate", "4", "--num-kv-blocks", "512",
]  # fmt: skip


def test_simulate_saves_a_bench_record_that_compare_reads(tmp_path, capsys):
    args = ["simulate", "--profile", str(PROFILE), "--prefill-workers", "1", "--decode-workers",
            "2", *WORKLOAD, "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "sim.json", "--goodput", "ttft:500", "tpot:60"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Median TTFT (ms)" in out and "1P2D" in out
    record = load_record(tmp_path / "sim.json")
    assert record["completed"] == 30 and record["total_output_tokens"] == 30 * 16
    assert record["simulation"]["decode_workers"] == 2
    assert record["request_goodput"] is not None
    assert main(["bench", "compare", str(tmp_path / "sim.json"), str(tmp_path / "sim.json")]) == 0


def test_simulate_colocated_with_a_killed_worker_still_serves(tmp_path, capsys):
    args = ["simulate", "--profile", str(PROFILE), "--mode", "colocated", "--decode-workers",
            "2", *WORKLOAD, "--kill", "worker-1@2", "--save-result", "--result-dir",
            str(tmp_path), "--result-filename", "k.json"]  # fmt: skip
    assert main(args) == 0
    record = json.loads((tmp_path / "k.json").read_text())
    assert record["completed"] == 30 and record["failed"] == 0


def test_simulate_late_after_serves_newest_first_under_overload(tmp_path, capsys):
    """A decode pool with room for a few requests at a time and a burst beyond it: with the
    TTFT objective given, more requests start within it."""
    on_time = []
    for extra in ([], ["--late-after-ms", "500"]):
        args = ["simulate", "--profile", str(PROFILE), "--prefill-workers", "1",
                "--decode-workers", "1", "--dataset-name", "random", "--random-input-len", "120",
                "--random-output-len", "64", "--num-prompts", "60", "--request-rate", "20",
                "--num-kv-blocks", "60", *extra, "--save-result", "--result-dir",
                str(tmp_path), "--result-filename", "o.json"]  # fmt: skip
        assert main(args) == 0
        record = json.loads((tmp_path / "o.json").read_text())
        assert record["completed"] == 60
        on_time.append(sum(t <= 0.5 for t in record["ttfts"]))
    assert on_time[1] > on_time[0]


def test_a_simulation_whose_every_request_failed_says_so(capsys):
    """Prompts longer than the context: every request failed, and the exit was 0 with the
    reason only in the saved JSON."""
    args = ["simulate", "--profile", str(PROFILE), *WORKLOAD, "--random-input-len", "100000"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "30 of 30 simulated requests failed (first:" in err


def test_a_profile_that_is_not_text_is_named(tmp_path, capsys):
    binary = tmp_path / "profile.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert main(["simulate", "--profile", str(binary), *WORKLOAD]) == 1
    err = capsys.readouterr().err
    assert f"{binary} is not JSON: not UTF-8 text" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kill", "decode-0"], "WORKER@SECONDS"),
        (["--kill", "decode-0@nan"], "WORKER@SECONDS"),
        (["--kill", "decode-7@1"], "no worker decode-7 to kill"),
        # (an event at infinity: the stats poll waited for it forever)
        (["--dispatch-ms", "inf"], "dispatch must be a finite number"),
        (["--step-gap-ms", "nan"], "step_gap must be a finite number"),
        (["--decode-workers", "0"], "decode workers"),
        (["--routing", "cost", "--num-kv-blocks", "0"], "num_blocks"),
        (["--decode-headroom-tokens", "-1"], "decode_headroom_tokens"),
        (["--host-cores", "0"], "host_cores"),
        (["--prefill-interference", "0.5"], "prefill_interference"),
        (["--paced-cores", "2", "--host-cores", "2"], "not both"),
        (["--paced-cores", "2", "--thread-profile", "one=x.json"], "THREADS=PATH"),
        (["--paced-cores", "2", "--thread-profile", "1=/nonexistent.json"], "nonexistent"),
        (["--prefill-interference", "nan"], "must be finite and >= 1"),
        (["--sweep", "request-rate=1,2"], "--sweep is tandem bench's"),
        (["--plot", "plots"], "--plot is tandem bench's"),
        (["--random-input-len", "100000000"], "dataset lengths must be at most 1,048,576"),
    ],
)
def test_bad_simulate_input_is_one_line(extra, message, capsys):
    assert main(["simulate", "--profile", str(PROFILE), *WORKLOAD, *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_simulate_paces_cores_with_a_profile_per_thread_count(tmp_path, capsys):
    """Two colocated workers pacing two cores: a 1-thread profile twice as slow as the one
    given for two threads gives a slower run than the two-thread profile alone, and faster
    than the 1-thread profile alone."""
    data = json.loads(PROFILE.read_text())
    slow = {**data, "coefficients": {k: 2 * v for k, v in data["coefficients"].items()}}
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    durations = {}
    for name, extra in {
        "fast": [],
        "paced": ["--paced-cores", "2", "--thread-profile", f"1={tmp_path / 'slow.json'}",
                  "--thread-profile", f"2={PROFILE}"],
        "slow": ["--paced-cores", "2", "--thread-profile", f"1={tmp_path / 'slow.json'}",
                 "--thread-profile", f"2={tmp_path / 'slow.json'}"],
    }.items():  # fmt: skip
        args = ["simulate", "--profile", str(PROFILE), "--mode", "colocated",
                "--decode-workers", "2", *WORKLOAD, *extra, "--save-result", "--result-dir",
                str(tmp_path), "--result-filename", f"{name}.json"]  # fmt: skip
        assert main(args) == 0
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["completed"] == 30
        durations[name] = record["mean_e2el_ms"]
    assert durations["fast"] < durations["paced"] < durations["slow"]


def test_simulate_without_a_profile_says_what_to_give(capsys):
    assert main(["simulate", *WORKLOAD]) == 1
    assert "--profile" in capsys.readouterr().err


def test_plan_picks_a_layout_that_meets_the_slo(tmp_path, capsys):
    slo = "ttft_p99=2s,itl_p99=80ms"
    args = ["plan", "--profile", str(PROFILE), "--gpus", "3", "--slo", slo, *WORKLOAD,
            "--plan-json", str(tmp_path / "p.json")]  # fmt: skip
    assert main(args) == 0
    plan = json.loads((tmp_path / "p.json").read_text())
    layouts = {c["layout"] for c in plan["candidates"]}
    assert layouts == {"3 colocated", "1P2D", "2P1D"}
    best = plan["best"]
    assert best["feasible"] and best["predicted_ms"]["p99_ttft_ms"] <= 2000
    feasible = [c for c in plan["candidates"] if c["feasible"]]
    assert best["goodput_per_gpu"] == max(c["goodput_per_gpu"] for c in feasible)
    assert "plan:" in capsys.readouterr().out


def test_plan_simulates_layouts_in_parallel_processes_to_the_same_plan(tmp_path, capsys):
    args = ["plan", "--profile", str(PROFILE), "--gpus", "3", "--slo", "ttft_p99=2s", *WORKLOAD]
    plans = []
    for jobs in ("1", "3"):
        out = tmp_path / f"plan-{jobs}.json"
        assert main([*args, "--jobs", jobs, "--plan-json", str(out)]) == 0
        plans.append(json.loads(out.read_text()))
    assert plans[0] == plans[1] and len(plans[0]["candidates"]) == 3


def test_plan_refuses_more_gpus_than_it_can_search(capsys):
    args = ["plan", "--profile", str(PROFILE), "--gpus", "100000000", "--slo", "ttft_p99=2s"]
    assert main([*args, *WORKLOAD]) == 1
    assert "--gpus takes at most" in capsys.readouterr().err


def test_plan_reports_an_slo_no_layout_meets(capsys):
    args = ["plan", "--profile", str(PROFILE), "--gpus", "2", "--slo", "itl_p99=1ms", *WORKLOAD]
    assert main(args) == 3
    assert "infeasible" in capsys.readouterr().out


def test_plan_rejects_a_malformed_slo(capsys):
    args = ["plan", "--profile", str(PROFILE), "--gpus", "2", "--slo", "ttft=2s", *WORKLOAD]
    assert main(args) == 1
    assert "metric_pNN=limit" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gpus", "4", "--tp", "8"], "4 GPUs hold no worker of 8 GPUs"),
        (["--gpus", "2", "--plan-json", "{tmp}"], "is a folder"),
        (["--gpus", "2", "--plan-json", "{tmp}/no/such/plan.json"], "is in no existing folder"),
        # bench's output flags were taken and silently ignored
        (["--gpus", "2", "--result-path", "{tmp}/r.json"], "--result-path is tandem bench's"),
        (["--gpus", "2", "--save-result"], "--save-result is tandem bench's"),
        (["--gpus", "2", "--plot", "{tmp}"], "--plot is tandem bench's"),
    ],
)
def test_plan_refuses_before_it_searches(tmp_path, capsys, extra, message):
    """Said before the table's header (or after the whole search, for --plan-json)."""
    extra = [part.replace("{tmp}", str(tmp_path)) for part in extra]
    args = ["plan", "--profile", str(PROFILE), "--slo", "ttft_p99=2s", *WORKLOAD, *extra]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert message in err and out == ""


def test_plan_rejects_negative_jobs(capsys):
    args = ["plan", "--profile", str(PROFILE), "--gpus", "2", "--slo", "ttft_p99=2s", *WORKLOAD]
    assert main([*args, "--jobs", "-1"]) == 1
    assert "--jobs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("coefficient", "value"), [("step", float("inf")), ("step", float("nan")), ("step", -1.0)]
)
def test_a_profile_with_a_cost_no_fit_gives_is_refused(tmp_path, capsys, coefficient, value):
    """A hand-edited profile: an infinite step looped forever, a negative one gave TTFTs of 0."""
    data = json.loads(PROFILE.read_text())
    data["coefficients"][coefficient] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert main(["simulate", "--profile", str(bad), *WORKLOAD]) == 1
    err = capsys.readouterr().err
    assert "cost coefficients must be finite and >= 0: step" in err
    assert len(err.strip().splitlines()) == 1


def test_a_simulation_ends_however_long_its_steps(tmp_path, capsys, monkeypatch):
    """Steps of a million seconds each: the simulated time ends at its cap (here lowered), and
    what is unfinished then counts as aborted, instead of polling stats forever."""
    import simulation.cluster

    monkeypatch.setattr(simulation.cluster, "MAX_SIMULATED_S", 5_000.0)
    data = json.loads(PROFILE.read_text())
    data["coefficients"]["step"] = 1e6
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(data))
    args = ["simulate", "--profile", str(slow), *WORKLOAD[:-4], "--num-prompts", "2",
            "--num-kv-blocks", "512", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "s.json"]  # fmt: skip
    assert main(args) == 0
    assert json.loads((tmp_path / "s.json").read_text())["completed"] == 0
