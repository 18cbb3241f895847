"""Metrics from hand-made request results: every value checked against arithmetic done by hand."""

from __future__ import annotations

import pytest

from loadtest.client import RequestResult
from loadtest.config import GoodputSLO
from loadtest.metrics import compute_metrics
from loadtest.results import percentile_key, result_record
from loadtest.runner import RunOutcome

PERCENTILES = (50.0, 90.0, 99.0)
VLLM_KEYS = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "ttfts", "itls", "latencies", "input_lens", "output_lens", "errors", "generated_texts",
    "start_times", "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p50", "p99.9")
      for metric in ("ttft", "tpot", "itl", "e2el")),
)  # fmt: skip


def ok(sent_at: float, ttft: float, itl: tuple[float, ...], tokens: int, prompt_len: int = 10):
    latency = ttft + sum(itl)
    return RequestResult(prompt_len, sent_at, ttft, itl, latency, tokens, "x " * tokens, None)


def failed(prompt_len: int = 7) -> RequestResult:
    return RequestResult(prompt_len, 0.5, None, (), None, None, "", "HTTP 500: boom")


# Request A: TTFT 100 ms, gaps 20 and 30 ms, 3 tokens -> E2EL 150 ms, TPOT (150-100)/2 = 25 ms.
# Request B: TTFT 200 ms, gap 50 ms, 2 tokens -> E2EL 250 ms, TPOT 50 ms.
# Request C: TTFT 300 ms, 1 token -> E2EL 300 ms, no TPOT.
RESULTS = [
    ok(0.0, 0.1, (0.02, 0.03), 3, prompt_len=10),
    ok(0.1, 0.2, (0.05,), 2, prompt_len=20),
    ok(0.2, 0.3, (), 1, prompt_len=30),
    failed(),
]


def test_latency_distributions() -> None:
    m = compute_metrics(RESULTS, duration_s=2.0, percentiles=PERCENTILES, slo=None)
    assert m.ttft.mean == pytest.approx(200.0)
    assert m.ttft.median == pytest.approx(200.0)
    assert m.ttft.std == pytest.approx((2 / 3 * 100**2) ** 0.5)  # population std of 100, 200, 300
    assert m.ttft.percentiles[90.0] == pytest.approx(280.0)  # 200 + 0.8 * 100, linear
    assert m.tpot.mean == pytest.approx(37.5)  # C has one token: no TPOT
    assert m.tpot.percentiles[50.0] == pytest.approx(37.5)
    assert m.itl.mean == pytest.approx(100 / 3)  # gaps 20, 30, 50
    assert m.itl.median == pytest.approx(30.0)
    assert m.e2el.mean == pytest.approx((150 + 250 + 300) / 3)
    assert m.e2el.percentiles[99.0] == pytest.approx(250 + 0.98 * 50)


def test_counts_and_throughputs() -> None:
    m = compute_metrics(RESULTS, duration_s=2.0, percentiles=PERCENTILES, slo=None)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (60, 6)  # the failed request counts for neither
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_token_throughput == pytest.approx(33.0)
    assert m.request_goodput is None


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        (GoodputSLO(ttft_ms=150), 1),  # A only
        (GoodputSLO(tpot_ms=30), 2),  # A (25 ms) and C (one token counts as TPOT 0)
        (GoodputSLO(e2el_ms=260), 2),  # A and B
        (GoodputSLO(ttft_ms=250, tpot_ms=30), 1),  # both needed: A
        (GoodputSLO(ttft_ms=1000, tpot_ms=1000, e2el_ms=1000), 3),  # never the failed one
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slo: GoodputSLO, good: int) -> None:
    m = compute_metrics(RESULTS, duration_s=2.0, percentiles=PERCENTILES, slo=slo)
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_no_success_summarizes_to_zeros() -> None:
    m = compute_metrics([failed()], duration_s=1.0, percentiles=PERCENTILES, slo=None)
    assert (m.completed, m.failed, m.request_throughput) == (0, 1, 0.0)
    assert (m.ttft.mean, m.itl.percentiles[99.0]) == (0.0, 0.0)


def test_record_uses_vllm_keys_and_keeps_failed_requests() -> None:
    m = compute_metrics(
        RESULTS, duration_s=2.0, percentiles=(50.0, 99.9), slo=GoodputSLO(ttft_ms=150)
    )
    outcome = RunOutcome(
        tuple(RESULTS), started_at=-1.0, duration_s=2.0, num_aborted=0, num_unsent=0
    )
    record = result_record(m, RESULTS, outcome, {"model_id": "m"})
    assert set(VLLM_KEYS) <= set(record)
    assert record["request_goodput"] == pytest.approx(0.5)
    assert record["input_lens"] == [10, 20, 30, 7]
    assert record["output_lens"] == [3, 2, 1, 0]
    assert record["ttfts"] == [0.1, 0.2, 0.3, 0.0]
    assert record["itls"] == [[0.02, 0.03], [0.05], [], []]
    assert record["errors"] == ["", "", "", "HTTP 500: boom"]
    assert record["start_times"] == pytest.approx([1.0, 1.1, 1.2, 1.5])
    assert record["model_id"] == "m"


def test_percentile_keys_follow_vllm_spelling() -> None:
    assert percentile_key(99.0, "ttft") == "p99_ttft_ms"
    assert percentile_key(99.9, "itl") == "p99.9_itl_ms"


def test_peaks_as_vllm_counts_them() -> None:
    # A, B and C above: every chunk lands in the first second, all three are active within it
    # (vLLM's count), and at most two are in flight at once (A until 0.15 s, B over
    # [0.1, 0.35), C over [0.2, 0.5)).
    m = compute_metrics(RESULTS, duration_s=2.0, percentiles=PERCENTILES, slo=None)
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (6.0, 3)
    assert m.peak_concurrent_requests == 2


def test_peaks_with_touching_requests_and_two_seconds() -> None:
    # [0, 0.5) then [0.5, 1.0): one at a time; their chunks at 0.5 s and 1.0 s: one per second.
    # vLLM's count sees both in second 0 (and the second ends in second 1).
    back_to_back = [ok(0.0, 0.5, (), 1), ok(0.5, 0.5, (), 1)]
    m = compute_metrics(back_to_back, duration_s=1.0, percentiles=PERCENTILES, slo=None)
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (1.0, 2)
    assert m.peak_concurrent_requests == 1
