"""/metrics parses as Prometheus text, and its counters move as requests complete."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.metrics import ServerMetrics
from engine.outputs import RequestOutput
from tests.support.servers import LONG_NUM_KV_BLOCKS, LONG_TOKENS, local_client

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # 9 tokens: two full blocks of 4 to cache


@pytest.fixture(scope="module")
def server(serve, long_llama):
    return serve(local_client(long_llama, num_kv_blocks=LONG_NUM_KV_BLOCKS))


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}."""
    response = httpx.get(url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model": "tiny", **labels}.items())))]


WORKER = {"worker": "colocated-0", "pool": "colocated"}


def test_names_are_prefixed_and_labelled(server) -> None:
    samples = scrape(server.url)
    assert all(name.startswith("tandem:") for name, _ in samples)
    assert value(samples, "tandem:kv_cache_usage_perc", **WORKER) == 0.0
    assert value(samples, "tandem:num_requests_running", **WORKER) == 0.0
    assert value(samples, "tandem:num_requests_waiting", **WORKER) == 0.0
    assert value(samples, "tandem:pool_queue_depth", pool="colocated") == 0.0
    assert value(samples, "tandem:admission_queue_depth") == 0.0
    for name in ("kv_transfer_bytes_total", "kv_transfer_failures_total",
                 "requests_prefilled_locally_total", "kv_transfer_seconds_count"):  # fmt: skip
        assert value(samples, f"tandem:{name}", **WORKER) == 0.0
    assert value(samples, "tandem:kv_transfer_seconds_bucket", le="+Inf", **WORKER) == 0.0


def test_counters_move_as_requests_complete(server) -> None:
    before = scrape(server.url)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    for _ in range(2):  # the second finds the first's full blocks in the prefix cache
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    stream = httpx.post(server.url + "/v1/completions", json={**body, "stream": True})
    assert stream.text.endswith("data: [DONE]\n\n")
    after = scrape(server.url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - before.get(
            (name, tuple(sorted({"model": "tiny", **labels}.items()))), 0.0
        )

    assert moved("tandem:prompt_tokens_total") == 3 * len(PROMPT)
    assert moved("tandem:generation_tokens_total") == 3 * 6
    assert moved("tandem:request_success_total", finished_reason="length") == 3
    assert moved("tandem:time_to_first_token_seconds_count") == 3
    assert moved("tandem:e2e_request_latency_seconds_count") == 3
    assert moved("tandem:inter_token_latency_seconds_count") == 3 * 5
    assert moved("tandem:prefix_cache_queries_total", **WORKER) == 3 * len(PROMPT)
    assert moved("tandem:prefix_cache_hits_total", **WORKER) == 2 * 8
    assert value(after, "tandem:kv_cache_usage_perc", **WORKER) == 0.0
    assert value(after, "tandem:time_to_first_token_seconds_sum") > 0


def test_gauges_show_a_running_request(server) -> None:
    body = {"prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
        lines = r.iter_lines()  # kept open: closing it would close the connection
        assert next(lines).startswith("data: ")
        during = scrape(server.url)
    assert value(during, "tandem:num_requests_running", **WORKER) == 1.0
    held = value(during, "tandem:kv_cache_usage_perc", **WORKER)
    assert 0 < held < 0.5  # a few blocks of the prompt and its first tokens


def test_queue_time_counts_once_even_when_it_comes_after_the_first_token() -> None:
    # Disaggregated, the queue time is the prefill worker's, and the decode worker's first
    # update may reach the client before the prefill worker's answer carries it.
    metrics = ServerMetrics("tiny", list, lambda: 0)

    async def outputs():
        for queued, finish in ((None, None), (0.5, None), (0.5, "length")):
            yield RequestOutput("r", [1], [2], delta_token_ids=[2], queue_seconds=queued,
                                finish_reason=finish)  # fmt: skip

    async def drain() -> None:
        async for _ in metrics.track(outputs(), 0.0):
            pass

    asyncio.run(drain())
    text = metrics.render().decode()
    assert 'tandem:request_queue_time_seconds_count{model="tiny"} 1.0' in text
    assert 'tandem:request_queue_time_seconds_sum{model="tiny"} 0.5' in text


def test_requests_that_end_unfinished_count_as_abort_or_error() -> None:
    metrics = ServerMetrics("tiny", list, lambda: 0)

    async def outputs(fail: bool):
        for _ in range(3):
            yield RequestOutput("r", [1], [2], delta_token_ids=[2])
        if fail:
            raise RuntimeError("the worker died")

    async def client_leaves() -> None:  # the stream is closed after one output
        stream = metrics.track(outputs(False), 0.0)
        await anext(stream)
        await stream.aclose()

    async def worker_fails() -> None:
        with pytest.raises(RuntimeError):
            async for _ in metrics.track(outputs(True), 0.0):
                pass

    asyncio.run(client_leaves())
    asyncio.run(worker_fails())
    text = metrics.render().decode()
    assert 'tandem:request_success_total{finished_reason="abort",model="tiny"} 1.0' in text
    assert 'tandem:request_success_total{finished_reason="error",model="tiny"} 1.0' in text
    assert 'finished_reason="length"' not in text


def test_a_pool_whose_last_worker_left_reads_zero_serving() -> None:
    """An alert on `tandem:pool_workers{state="serving"} < 1` must see the empty pool: the
    series used to vanish with the pool's last worker."""
    from prometheus_client import CollectorRegistry, generate_latest

    from coordinator.api.worker_metrics import WorkerStatsCollector
    from protocol.stats import PoolWorker

    workers = [PoolWorker("prefill-0", "prefill", "serving", 0),
               PoolWorker("decode-0", "decode", "serving", 2)]  # fmt: skip
    registry = CollectorRegistry()
    registry.register(WorkerStatsCollector("m", list, lambda: list(workers)))
    assert 'pool_workers{model="m",pool="decode",state="serving"} 1.0' in (
        generate_latest(registry).decode()
    )
    workers.pop()  # decode-0 died; its replacement is not up yet
    text = generate_latest(registry).decode()
    assert 'pool_workers{model="m",pool="decode",state="serving"} 0.0' in text
    assert 'worker_restarts_total{model="m",pool="decode"} 2.0' in text


def test_joined_tokens_count_as_that_many_gaps_and_tokens() -> None:
    # Outputs that queued while the stream was busy arrive joined: k tokens in one output are
    # k inter-token gaps of 1/k of the wait each (the first output's extra tokens, gaps of 0).
    metrics = ServerMetrics("tiny", list, lambda: 0)

    async def outputs():
        yield RequestOutput("r", [1, 2], [3, 4], delta_token_ids=[3, 4])
        await asyncio.sleep(0.2)
        yield RequestOutput("r", [1, 2], [3, 4, 5, 6, 7], delta_token_ids=[5, 6, 7],
                            finish_reason="length")  # fmt: skip

    async def drain() -> None:
        async for _ in metrics.track(outputs(), 0.0):
            pass

    asyncio.run(drain())
    samples = {
        (s.name, s.labels.get("le")): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert samples[("tandem:generation_tokens_total", None)] == 5
    assert samples[("tandem:prompt_tokens_total", None)] == 2
    assert samples[("tandem:inter_token_latency_seconds_count", None)] == 4
    assert samples[("tandem:inter_token_latency_seconds_bucket", "0.001")] == 1  # the 0 gap
    assert samples[("tandem:inter_token_latency_seconds_bucket", "0.05")] == 1  # 3 of >= 0.066
    assert samples[("tandem:inter_token_latency_seconds_sum", None)] >= 0.19
