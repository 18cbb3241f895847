"""The admin API over HTTP, in front of the real Coordinator driving fake workers: the pools
as they are, growth, shrinking, draining, their errors, and what /metrics and /ready say."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from protocol.telemetry import StepRecord
from tests.support.fake_workers import OUTPUT, served_fake_cluster
from tests.support.servers import wait_until

KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def cluster(monkeypatch):
    with (
        served_fake_cluster(monkeypatch, KEY) as (cluster, url),
        httpx.Client(base_url=url, timeout=10) as http,
    ):
        yield cluster, http


def serving(http: httpx.Client, pool: str) -> list[str]:
    workers = http.get("/admin/pools", headers=AUTH).json()["workers"]
    return [w["id"] for w in workers if w["pool"] == pool and w["state"] == "serving"]


def test_admin_routes_need_the_key(cluster) -> None:
    _, http = cluster
    assert http.get("/admin/pools").status_code == 401
    assert http.post("/admin/pools", json={"decode": 2}).status_code == 401
    assert http.get("/admin/pools", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_pools_grow_and_shrink_over_http(cluster) -> None:
    fakes, http = cluster
    view = http.get("/admin/pools", headers=AUTH).json()
    assert sorted((w["id"], w["pool"], w["state"]) for w in view["workers"]) == [
        ("decode-0", "decode", "serving"),
        ("prefill-0", "prefill", "serving"),
    ]
    assert http.post("/admin/pools", json={"decode": 2}, headers=AUTH).status_code == 200
    assert wait_until(lambda: len(serving(http, "decode")) == 2, timeout=5)
    body = {"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 8, "temperature": 0}
    for _ in range(3):
        reply = http.post("/v1/completions", json=body, headers=AUTH)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
    assert http.post("/admin/pools", json={"decode": 1}, headers=AUTH).status_code == 200
    assert wait_until(lambda: len(serving(http, "decode")) == 1, timeout=5)
    assert serving(http, "decode") == ["decode-0"]  # the newest leaves first
    metrics = http.get("/metrics").text
    assert 'tandem:pool_workers{model="fake",pool="decode",state="serving"} 1.0' in metrics
    assert 'tandem:worker_restarts_total{model="fake",pool="decode"} 0.0' in metrics
    assert http.get("/ready").status_code == 200
    assert fakes.spawned == ["decode-new0"]


def test_drain_and_its_errors(cluster) -> None:
    fakes, http = cluster
    http.post("/admin/pools", json={"decode": 2}, headers=AUTH)
    assert wait_until(lambda: len(serving(http, "decode")) == 2, timeout=5)
    drained = http.post("/admin/workers/decode-0/drain", headers=AUTH)
    assert drained.status_code == 200
    assert wait_until(lambda: serving(http, "decode") == ["decode-new0"], timeout=5)
    missing = http.post("/admin/workers/nobody/drain", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "worker_not_found"
    # A huge count once hung the event loop (a start task per worker) and ran the node out of
    # memory; strings and booleans are no counts.
    for bad in ({"decode": 0}, {}, {"bogus": 1}, {"decode": -1}, {"decode": 10**20},
                {"decode": 1025}, {"decode": "2"}, {"decode": True}):  # fmt: skip
        reply = http.post("/admin/pools", json=bad, headers=AUTH)
        assert reply.status_code == 400, (bad, reply.text)
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert fakes.spawned == ["decode-new0"]  # nothing started by the refused ones


def test_a_thousand_readiness_probes_start_nothing(cluster) -> None:
    _, http = cluster
    assert http.get("/ready").status_code == 200
    time.sleep(0.1)
    threads = threading.active_count()
    for _ in range(1000):
        assert http.get("/ready").status_code == 200
    assert threading.active_count() == threads
    assert OUTPUT  # the fake workers' script is loaded


def test_the_handover_of_disaggregated_requests_is_in_metrics(cluster) -> None:
    _, http = cluster
    body = {"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 4, "temperature": 0}
    for _ in range(3):
        assert http.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    metrics = http.get("/metrics").text
    count = _sample(metrics, "tandem:kv_handover_seconds_count")
    total = _sample(metrics, "tandem:kv_handover_seconds_sum")
    assert count == 3.0  # one per request: its prefill worker's token
    # The fake prefill step ended 20 ms before its result; its decode worker may send the
    # first token a little before the result is read, which the handover counts (less).
    assert 3 * 0.015 <= total < 3 * 1.0


def _sample(metrics: str, name: str) -> float:
    lines = [line for line in metrics.splitlines() if line.startswith(name + "{")]
    assert len(lines) == 1, lines
    return float(lines[0].rsplit(" ", 1)[1])


def test_role_switch_over_http(cluster) -> None:
    _, http = cluster
    http.post("/admin/pools", json={"decode": 2}, headers=AUTH)
    assert wait_until(lambda: len(serving(http, "decode")) == 2, timeout=5)
    switched = http.post("/admin/workers/decode-0/role", json={"role": "prefill"}, headers=AUTH)
    assert switched.status_code == 200, switched.text
    assert switched.json()["switch_seconds"] < 1.0
    assert sorted(serving(http, "prefill")) == ["decode-0", "prefill-0"]
    body = {"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 8, "temperature": 0}
    assert http.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    last_decode = http.post(
        "/admin/workers/decode-new0/role", json={"role": "prefill"}, headers=AUTH
    )
    assert last_decode.status_code == 400  # the decode pool would be empty
    bad = http.post("/admin/workers/decode-0/role", json={"role": "both"}, headers=AUTH)
    assert bad.status_code == 400
    missing = http.post("/admin/workers/nobody/role", json={"role": "decode"}, headers=AUTH)
    assert missing.status_code == 404


def test_a_role_switch_the_worker_fails_is_a_503_not_a_500(cluster) -> None:
    fakes, http = cluster
    http.post("/admin/pools", json={"prefill": 2}, headers=AUTH)
    assert wait_until(lambda: len(serving(http, "prefill")) == 2, timeout=5)

    def cannot(role: str, worker_id: str):
        raise RuntimeError("no memory for the new role")

    fakes.prefill["prefill-new0"].make_role = cannot
    reply = http.post("/admin/workers/prefill-new0/role", json={"role": "decode"}, headers=AUTH)
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == "role_switch_failed" and "no memory" in error["message"]


def test_telemetry_shows_each_workers_reported_steps(cluster) -> None:
    fakes, http = cluster
    records = [StepRecord(1.0 + i, 0.01, 0, 0, 4, 40 + 4 * i, 10, 0) for i in range(3)]
    fakes.decodes["decode-0"].steps = records

    def reported() -> list:
        reply = http.get("/admin/telemetry?worker=decode-0&limit=2", headers=AUTH)
        return reply.json()["workers"]["decode-0"]["steps"] if reply.status_code == 200 else []

    assert wait_until(lambda: len(reported()) == 2, timeout=5)  # one stats poll: 1 s
    assert reported() == [r._asdict() for r in records[1:]]  # the latest two
    everyone = http.get("/admin/telemetry", headers=AUTH).json()["workers"]
    assert everyone["decode-0"]["steps_total"] == 3
    missing = http.get("/admin/telemetry?worker=decode-9", headers=AUTH)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "worker_not_found"
    assert http.get("/admin/telemetry?limit=0", headers=AUTH).status_code == 400
