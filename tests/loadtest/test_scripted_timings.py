"""A benchmark against the fake server, whose token timings are scripted: the first token TTFT
after the request, then one every ITL. Every metric must match the value computed by hand from
that script. The server never sends early, so measured times are bounded below exactly and above
by the client's and server's own overhead (SLACK, sized for a busy 2-core machine)."""

from __future__ import annotations

import heapq

import pytest

from tests.support.bench import bench
from tests.support.fake_server import FakeServer, Script

TTFT, ITL = 0.150, 0.060
SLACK = 0.050  # seconds of overhead allowed on one measurement
CONCURRENCY = 3
E2EL_SLO_MS = 445  # 5 tokens take 390 ms (+ SLACK < 445), 6 take 450 ms


def scripted_e2el(tokens: int) -> float:
    return TTFT + (tokens - 1) * ITL


def scripted_duration(lens: list[int], concurrency: int) -> float:
    """When the last request ends, each slot taking the next request in order as it frees."""
    free_at = [0.0] * concurrency
    for tokens in lens:
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + scripted_e2el(tokens))
    return max(free_at)


@pytest.fixture(scope="module")
def run():
    server = FakeServer(Script(ttft_s=TTFT, itl_s=ITL)).start()
    try:
        record = bench(
            server.url,
            "--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "5",
            "--random-range-ratio", "0.5", "--max-concurrency", str(CONCURRENCY),
            "--goodput", f"e2el:{E2EL_SLO_MS}",
        )  # fmt: skip
    finally:
        server.stop()
    return server, record


def test_every_request_completes_with_the_requested_tokens(run) -> None:
    server, rec = run
    assert (rec["completed"], rec["failed"]) == (6, 0)
    sent = sorted(p["max_tokens"] for p in server.received[1:])  # [0] is the probe
    assert sorted(rec["output_lens"]) == sent
    assert len(set(sent)) > 2
    prompts = server.received[1:]
    assert sorted(rec["input_lens"]) == sorted(len(p["prompt"].split()) for p in prompts)
    assert rec["total_output_tokens"] == sum(sent)
    assert rec["total_input_tokens"] == sum(rec["input_lens"])


def test_ttft_itl_e2el_tpot_match_the_script(run) -> None:
    _, rec = run
    for ttft in rec["ttfts"]:
        assert TTFT <= ttft <= TTFT + SLACK
    assert TTFT * 1000 <= rec["mean_ttft_ms"] <= (TTFT + SLACK) * 1000
    gaps = [gap for itl in rec["itls"] for gap in itl]
    assert len(gaps) == sum(n - 1 for n in rec["output_lens"])
    assert all(abs(gap - ITL) <= SLACK for gap in gaps)
    for e2el, tokens in zip(rec["e2els"], rec["output_lens"], strict=True):
        assert scripted_e2el(tokens) <= e2el <= scripted_e2el(tokens) + SLACK
    # Per request, the gaps add up to E2EL - TTFT, so both means stay close to the script.
    assert rec["mean_itl_ms"] == pytest.approx(ITL * 1000, abs=SLACK * 1000 / 4)
    assert rec["mean_tpot_ms"] == pytest.approx(ITL * 1000, abs=SLACK * 1000 / 4)


def test_throughput_and_goodput_match_the_script(run) -> None:
    _, rec = run
    lens = rec["output_lens"]
    expected = scripted_duration(lens, CONCURRENCY)
    assert expected <= rec["duration"] <= expected + 2 * SLACK  # two requests in a row per slot
    low, high = expected + 2 * SLACK, expected  # duration bounds -> throughput bounds
    total = sum(lens) + sum(rec["input_lens"])
    assert 6 / low <= rec["request_throughput"] <= 6 / high
    assert sum(lens) / low <= rec["output_throughput"] <= sum(lens) / high
    assert total / low <= rec["total_token_throughput"] <= total / high
    good = sum(1 for n in lens if scripted_e2el(n) * 1000 <= E2EL_SLO_MS)
    assert 0 < good < 6
    assert good / low <= rec["request_goodput"] <= good / high
