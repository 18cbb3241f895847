"""benchmarks/soak.py without a server: /metrics parsing, window percentiles, the verdict on
synthetic samples, the process-tree reader on this test's own children, and the flags."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak", SCRIPT)
soak = importlib.util.module_from_spec(_spec)
sys.modules["soak"] = soak  # dataclasses resolve their annotations through sys.modules
_spec.loader.exec_module(soak)

MIB = 1 << 20
METRICS = """\
# HELP tandem:kv_cache_usage_perc Fraction of KV blocks in use (1 = full).
# TYPE tandem:kv_cache_usage_perc gauge
tandem:kv_cache_usage_perc{model="m",pool="prefill",worker="prefill-0"} 0.0
tandem:kv_cache_usage_perc{model="m",pool="decode",worker="decode-0"} 0.25
# HELP tandem:num_requests_running Requests in the worker's running batch.
# TYPE tandem:num_requests_running gauge
tandem:num_requests_running{model="m",pool="decode",worker="decode-0"} 3.0
"""


def outcome(ttft: float = 0.1, error: str | None = None, disconnected: bool = False):
    return soak.Outcome(1.0, disconnected, ttft, (0.02, 0.04), 0.5, error)


def make_sample(t: float, rss_mib: dict[int, float], ttft_ms: float = 100.0, itl_ms: float = 20.0):
    processes = {
        pid: soak.ProcStat(pid, f"proc{pid}", int(mib * MIB), 0.0) for pid, mib in rss_mib.items()
    }
    window = soak.Window(
        5, 0, 0, soak.Percentiles(ttft_ms, 2 * ttft_ms), soak.Percentiles(itl_ms, 2 * itl_ms), None
    )
    return soak.Sample(t, max(0.0, t - 10), processes, 50.0, {"decode/decode-0": 0.1}, window)


def test_kv_usage_reads_every_worker_and_nothing_else() -> None:
    assert soak.kv_usage(METRICS) == {"prefill/prefill-0": 0.0, "decode/decode-0": 0.25}
    assert soak.kv_usage("") == {}


def test_window_takes_latencies_of_complete_requests_only() -> None:
    outcomes = [
        outcome(0.1),
        outcome(0.3),
        outcome(9.0, error="HTTP 500"),
        outcome(None, None, True),
    ]
    window = soak.window_of(outcomes)
    assert (window.completed, window.disconnected, window.errors) == (2, 1, 1)
    assert window.ttft.p50_ms == pytest.approx(200.0)
    assert window.ttft.p99_ms == pytest.approx(298.0)
    assert window.itl.p50_ms == pytest.approx(30.0)  # gaps of both complete requests
    assert soak.window_of([]).ttft is None


def test_rss_check_compares_first_sample_after_warmup_with_the_last() -> None:
    steady = [make_sample(0, {1: 100, 2: 500}), make_sample(10, {1: 200, 2: 1000})]
    steady += [make_sample(20, {1: 201, 2: 1040}), make_sample(30, {1: 202, 2: 1020})]
    assert soak.rss_check(steady, warmup_s=10).status is soak.Status.PASS  # 1200 -> 1222 MiB

    leaking = [*steady[:3], make_sample(30, {1: 200, 2: 1070})]  # +7% in one process
    check = soak.rss_check(leaking, warmup_s=10)
    assert check.status is soak.Status.FAIL and "proc2 (pid 2) +7.0%" in check.detail

    tiny = [make_sample(10, {1: 1000, 3: 10}), make_sample(20, {1: 1000, 3: 11})]  # +1 MiB
    assert soak.rss_check(tiny, warmup_s=0).status is soak.Status.PASS
    assert soak.rss_check(steady, warmup_s=30).status is soak.Status.SKIP


def test_drift_check_uses_windows_after_warmup() -> None:
    samples = [make_sample(10, {}, ttft_ms=500), make_sample(20, {}), make_sample(30, {}, 104)]
    assert soak.drift_check(samples, warmup_s=10).status is soak.Status.PASS
    slower = [*samples[:2], make_sample(30, {}, ttft_ms=110)]
    check = soak.drift_check(slower, warmup_s=10)
    assert check.status is soak.Status.FAIL and "TTFT 100.0 -> 110.0 ms (+10.0%)" in check.detail
    assert soak.drift_check(samples[:2], warmup_s=10).status is soak.Status.SKIP


def test_idle_kv_and_error_checks() -> None:
    assert soak.idle_cpu_check(3.0, 4.5, 2.0).status is soak.Status.PASS
    assert soak.idle_cpu_check(3.0, 6.0, 2.0).status is soak.Status.FAIL
    assert soak.idle_cpu_check(None, None, 2.0).status is soak.Status.SKIP
    assert soak.kv_check({"a": 0.0, "b": 0.0}).status is soak.Status.PASS
    assert soak.kv_check({"a": 0.0, "b": 0.01}).status is soak.Status.FAIL
    assert soak.kv_check(None).status is soak.Status.FAIL

    tally = soak.Tally(outcomes=[outcome(), outcome(disconnected=True)], ready_probes=5)
    assert soak.errors_check(tally).status is soak.Status.PASS
    tally.ready_failures = 1
    assert soak.errors_check(tally).status is soak.Status.FAIL
    failed = soak.Tally(outcomes=[outcome(), outcome(error="1 of 32 tokens")], ready_probes=5)
    assert soak.errors_check(failed).status is soak.Status.FAIL


def test_process_tree_finds_children_and_their_memory() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for reader in (soak._proc_tree, soak.process_tree):
            # A child still starting (exec not done) shows 0 RSS for a moment: poll, bounded.
            deadline = time.monotonic() + 10
            tree = reader(os.getpid())
            while not (child.pid in tree and tree[child.pid].rss_bytes > 0):
                assert time.monotonic() < deadline, tree.get(child.pid)
                time.sleep(0.05)
                tree = reader(os.getpid())
            assert all(stat.cpu_s >= 0 for stat in tree.values())
    finally:
        child.kill()
        child.wait()
    assert soak.still_running([child.pid]) == []
    assert soak.process_tree(child.pid) == {}


def test_table_and_verdict_text() -> None:
    samples = [make_sample(0, {1: 100}), make_sample(10, {1: 100})]
    table = soak.format_table(samples).splitlines()
    assert len(table) == 4 and table[0].split("|")[0].strip() == "t s"
    assert "10%" in table[2]  # KV of the one worker
    checks = [soak.Check("a", soak.Status.PASS, ""), soak.Check("b", soak.Status.SKIP, "")]
    assert soak.format_verdict(checks).endswith("verdict: PASS")
    checks.append(soak.Check("c", soak.Status.FAIL, "x"))
    assert soak.format_verdict(checks).endswith("verdict: FAIL")


def test_flags() -> None:
    smoke = soak.soak_config(soak.parse_args(["--smoke", "--concurrency", "2"]))
    assert (smoke.duration_s, smoke.warmup_s, smoke.concurrency) == (12.0, 4.0, 2)
    full = soak.soak_config(soak.parse_args([]))
    assert (full.duration_s, full.warmup_s, full.sample_every_s) == (600.0, 60.0, 15.0)
    args = soak.parse_args(["--serve-args", "--dtype", "float32"])
    assert args.serve_args == ["--dtype", "float32"]
    with pytest.raises(soak.SoakError, match="127.0.0.1"):
        soak.check_target(soak.parse_args(["--url", "http://10.0.0.1:8000"]))
    with pytest.raises(soak.SoakError):
        soak.soak_config(soak.parse_args(["--disconnect-fraction", "2"]))


def test_greedy_texts_are_compared_with_the_first_and_problems_counted_once() -> None:
    tally = soak.Tally()
    load = soak.Load(None, None, None, None, "", [], None, tally)  # _compare reads the tally only
    assert load._compare(3, "the cat sat") is None
    assert load._compare(3, "the cat sat") is None
    message = load._compare(3, "the dog sat")
    assert "from character 4: 'cat sat' then, 'dog sat' now" in message
    assert load._compare(3, "the dog sat") == message and tally.mismatches == 2
    tally.note(message)
    tally.note(message)
    assert tally.messages == {message: 2}
