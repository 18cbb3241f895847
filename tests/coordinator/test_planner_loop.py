"""The planner's live loop: what it observes, what each decision does to the pools (on) or
does not (dry-run), failed actions recorded, the profile recalibrated from live steps; and over
HTTP in front of the real Coordinator: a prefill-bound load switches a decode worker to prefill,
the pools shrink once traffic stops, /admin/planner and /metrics show it all."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from coordinator.planner_loop import LoopSettings, PlannerLoop, PlannerSetup
from planning.cost_model import Calibrated, StepCostModel, StepShape
from planning.nnls import FitStats
from planning.planner import Planner, PlannerConfig
from planning.window import LoadWindow
from protocol.errors import PoolError
from protocol.telemetry import StepRecord
from tests.support.fake_workers import served_fake_cluster
from tests.support.servers import wait_until

KEY = "planner-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def slow_prefill_model(prefill_s: float = 0.15, step_s: float = 0.001) -> StepCostModel:
    """Every step costs `step_s`, one with a prompt chunk `prefill_s` more."""
    return StepCostModel(
        ("step", "prefill_step"), (step_s, prefill_s), 16, 1024, FitStats(10, 0.0, 0, None)
    )


def setup(mode: str = "on", **config) -> PlannerSetup:
    model = Calibrated(slow_prefill_model())
    settings = dict(ttft_slo_s=0.5, itl_slo_s=0.05, max_workers=3, cooldown_s=0.5,
                    shrink_hold_s=1.0)  # fmt: skip
    planner = Planner(model, PlannerConfig(**{**settings, **config}))
    return PlannerSetup(planner, model, LoopSettings(mode, interval_s=0.2, window_s=2.0))


class FakePools:
    """The PoolControl the loop drives, recording what it was asked to do."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.sizes = {"prefill": prefill, "decode": decode}
        self.calls: list[tuple] = []
        self.steps: list[StepRecord] = []
        self.fail: Exception | None = None

    def layout(self) -> dict[str, tuple[int, int]]:
        return {pool: (size, 0) for pool, size in self.sizes.items()}

    def queued_prefill_tokens(self) -> int:
        return 0

    def decode_kv_tokens(self) -> int:
        return 0

    def waiting_for_room(self) -> int:
        return 0

    def worker_start_s(self) -> float | None:
        return None

    def take_steps(self) -> list[StepRecord]:
        taken, self.steps = self.steps, []
        return taken

    def least_busy(self, pool: str) -> str:
        return f"{pool}-0"

    async def switch_role(self, worker_id: str, role: str) -> float:
        if self.fail is not None:
            raise self.fail
        self.calls.append(("switch", worker_id, role))
        self.sizes[role] += 1
        self.sizes["decode" if role == "prefill" else "prefill"] -= 1
        return 0.0

    def scale(self, sizes: dict[str, int]) -> None:
        self.calls.append(("scale", dict(sizes)))
        self.sizes.update(sizes)

    def request_capacity(self, workers: int) -> None:
        self.calls.append(("capacity", workers))


def loaded_loop(mode: str, pools: FakePools, rate: float, **config) -> PlannerLoop:
    clock = [100.0]
    window = LoadWindow(span_s=2.0)
    for i in range(int(rate * 2)):
        window.arrived(98.0 + i / rate, 6)
    loop = PlannerLoop(pools, window, setup(mode, **config), clock=lambda: clock[0])
    loop.clock_value = clock  # type: ignore[attr-defined]
    return loop


def test_dry_run_recommends_and_changes_nothing() -> None:
    pools = FakePools(1, 2)
    loop = loaded_loop("dry-run", pools, rate=5.0)
    decision = asyncio.run(loop.tick())
    assert decision.action == "switch" and (decision.prefill_workers, decision.decode_workers) == (
        2,
        1,
    )
    assert pools.calls == [] and pools.sizes == {"prefill": 1, "decode": 2}
    status = json.loads(json.dumps(loop.status()))  # JSON as it is served: no infinities
    assert status["mode"] == "dry-run" and status["decisions"][0]["outcome"] == "recommended"
    assert status["decisions"][0]["reason"].startswith("SLO predicted over its limit")
    assert status["observation"]["arrival_rate"] == pytest.approx(5.0)


def test_on_switches_the_least_busy_worker() -> None:
    pools = FakePools(1, 2)
    loop = loaded_loop("on", pools, rate=5.0)
    asyncio.run(loop.tick())
    assert pools.calls == [("switch", "decode-0", "prefill")]
    assert loop.status()["decisions"][-1]["outcome"] == "done"


def test_growth_asks_the_cluster_for_the_whole_layout_first() -> None:
    pools = FakePools(1, 1)
    loop = loaded_loop("on", pools, rate=5.0, max_workers=4)
    decision = asyncio.run(loop.tick())
    assert decision.action == "grow"
    total = decision.prefill_workers + decision.decode_workers
    assert pools.calls[0] == ("capacity", total)
    assert pools.calls[1] == ("scale", {"prefill": decision.prefill_workers,
                                        "decode": decision.decode_workers})  # fmt: skip


def test_an_infeasible_slo_is_reported_once_and_nothing_grows() -> None:
    pools = FakePools(2, 1)  # already the 3-worker layout serving the most of this load
    loop = loaded_loop("on", pools, rate=40.0, max_workers=3)
    for _ in range(3):
        assert asyncio.run(loop.tick()).action == "infeasible"
    assert pools.calls == []
    reports = loop.status()["decisions"]
    assert [d["outcome"] for d in reports] == ["reported"]
    assert loop.status()["current"]["current"]["ttft_s"] is None  # infinite, served as null


def test_an_infeasible_slo_grows_to_the_cap_once_and_no_further() -> None:
    pools = FakePools(1, 1)
    loop = loaded_loop("on", pools, rate=40.0, max_workers=3)
    decision = asyncio.run(loop.tick())
    assert decision.action == "grow" and "serving the most" in decision.reason
    assert pools.sizes == {"prefill": 2, "decode": 1}  # the cap, prefill-heavy as the load is
    loop.clock_value[0] += 0.6  # past the cool-down (the window still sees over 9 req/s)
    for _ in range(3):
        assert asyncio.run(loop.tick()).action == "infeasible"
    assert [c[0] for c in pools.calls] == ["capacity", "scale"]


def test_each_run_of_infeasible_reports_is_recorded() -> None:
    """Infeasible, then a quiet spell, then infeasible again: the second spell was compared
    with the last action recorded (the first report) and went unreported."""
    pools = FakePools(2, 1)
    loop = loaded_loop("on", pools, rate=40.0, max_workers=3)
    assert asyncio.run(loop.tick()).action == "infeasible"
    loop.clock_value[0] = 200.0  # the burst is out of the window: nothing arrives
    assert asyncio.run(loop.tick()).action == "none"
    loop.clock_value[0] = 300.0
    for i in range(80):
        loop.window.arrived(298.0 + i / 40, 6)
    assert asyncio.run(loop.tick()).action == "infeasible"
    assert asyncio.run(loop.tick()).action == "infeasible"
    reports = [d for d in loop.status()["decisions"] if d["action"] == "infeasible"]
    assert [d["at"] for d in reports] == [100.0, 300.0]


class SlowPools(FakePools):
    async def switch_role(self, worker_id: str, role: str) -> float:
        await asyncio.sleep(0.05)
        return await super().switch_role(worker_id, role)


def test_a_mode_change_mid_action_stops_further_changes_and_is_recorded() -> None:
    async def to_dry_run() -> tuple[PlannerLoop, SlowPools]:
        pools = SlowPools(1, 3)  # a switch of two workers: prefill-bound at 4 workers
        loop = loaded_loop("on", pools, rate=10.0, max_workers=4)
        tick = asyncio.ensure_future(loop.tick())
        await asyncio.sleep(0.01)
        loop.set_mode("dry-run")  # while the first switch is under way
        decision = await tick
        assert decision.action == "switch" and decision.prefill_workers == 3
        return loop, pools

    loop, pools = asyncio.run(to_dry_run())
    assert len(pools.calls) == 1  # the second switch was not made in dry-run
    last = loop.applied[-1]
    assert last.mode == "on" and last.outcome == "stopped after 1 of 2 switches: mode dry-run"

    async def to_off() -> tuple[PlannerLoop, SlowPools]:
        pools = SlowPools(1, 2)
        loop = loaded_loop("on", pools, rate=5.0)
        loop.settings = LoopSettings("on", interval_s=0.01, window_s=2.0)
        loop.start()
        await asyncio.sleep(0.03)  # its first tick is switching
        loop.set_mode("off")
        await asyncio.sleep(0.1)
        return loop, pools

    loop, pools = asyncio.run(to_off())
    assert loop.counts["switch"] == 1
    assert [a.outcome for a in loop.applied] == [
        "cancelled: the planner stopped (a role switch under way completes)"
    ]


def test_a_failed_action_is_recorded_with_its_error() -> None:
    pools = FakePools(1, 2)
    pools.fail = PoolError("the decode pool would be empty")
    loop = loaded_loop("on", pools, rate=5.0)
    asyncio.run(loop.tick())
    assert loop.status()["decisions"][-1]["outcome"] == "failed: the decode pool would be empty"


def test_live_steps_recalibrate_the_profile() -> None:
    pools = FakePools(1, 1)
    loop = loaded_loop("dry-run", pools, rate=1.0)
    decode = StepShape(0, 0, 4, 40)
    assert loop.planner.model.predict(decode) == pytest.approx(0.001)
    start = time.time()
    for tick in range(12):  # each tick brings new steps, measured at twice the profile's time
        pools.steps += [StepRecord(start + tick + i / 10, 0.002, 0, 0, 4, 40, 10, 0)
                        for i in range(1, 10)]  # fmt: skip
        asyncio.run(loop.tick())
    assert loop.model.factor == pytest.approx(2.0, rel=0.05)
    assert loop.planner.model.predict(decode) == pytest.approx(0.002, rel=0.05)
    assert loop.status()["profile_factor"] == pytest.approx(2.0, rel=0.05)


def test_off_runs_no_loop_and_modes_switch_at_run_time() -> None:
    async def go() -> None:
        loop = PlannerLoop(FakePools(1, 1), LoadWindow(), setup("off"))
        loop.start()
        assert loop._task is None
        loop.set_mode("dry-run")
        await asyncio.sleep(0.5)
        assert loop.counts["none"] >= 1  # ticking every 0.2 s
        loop.set_mode("off")
        ticks = sum(loop.counts.values())
        await asyncio.sleep(0.5)
        assert sum(loop.counts.values()) == ticks
        with pytest.raises(ValueError):
            loop.set_mode("auto")

    asyncio.run(go())


# -- over HTTP, in front of the real Coordinator -------------------------------------------


@pytest.fixture
def served(monkeypatch):
    planner = setup("on")
    with (
        served_fake_cluster(monkeypatch, KEY, 1, 2, planner) as (cluster, url),
        httpx.Client(base_url=url, timeout=10) as http,
    ):
        yield cluster, http


def pools_of(http: httpx.Client) -> dict[str, list[str]]:
    workers = http.get("/admin/pools", headers=AUTH).json()["workers"]
    found: dict[str, list[str]] = {"prefill": [], "decode": []}
    for w in workers:
        if w["state"] == "serving":
            found[w["pool"]].append(w["id"])
    return found


def test_a_prefill_bound_load_moves_a_worker_and_traffic_stopping_shrinks(served) -> None:
    _, http = served
    body = {"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 4, "temperature": 0}
    stop = threading.Event()
    statuses: list[int] = []

    def traffic() -> None:  # ~8 requests/s: one prefill worker predicts TTFT over 0.5 s
        with httpx.Client(base_url=str(http.base_url), timeout=10) as client:
            for _ in range(200):
                if stop.is_set():
                    return
                statuses.append(client.post("/v1/completions", json=body, headers=AUTH).status_code)
                time.sleep(0.12)

    sender = threading.Thread(target=traffic)
    sender.start()
    try:
        assert wait_until(lambda: len(pools_of(http)["prefill"]) == 2, timeout=10)
    finally:
        stop.set()
        sender.join()
    assert statuses and set(statuses) == {200}
    status = http.get("/admin/planner", headers=AUTH).json()
    switch = next(d for d in status["decisions"] if d["action"] == "switch")
    assert switch["outcome"] == "done" and switch["mode"] == "on"
    assert (switch["prefill_workers"], switch["decode_workers"]) == (2, 1)
    metrics = http.get("/metrics").text
    assert 'tandem:planner_mode{mode="on",model="fake"} 1.0' in metrics
    assert 'tandem:planner_decisions_total{action="switch",model="fake"} 1.0' in metrics
    # traffic stopped: the window empties (2 s), one worker fewer holds (1 s): a drain
    assert wait_until(lambda: sum(map(len, pools_of(http).values())) == 2, timeout=15)
    shrink = http.get("/admin/planner", headers=AUTH).json()["decisions"][-1]
    assert shrink["action"] == "shrink" and shrink["outcome"] == "done"


def test_the_mode_changes_over_http_and_bad_modes_are_400(served) -> None:
    _, http = served
    reply = http.post("/admin/planner", json={"mode": "dry-run"}, headers=AUTH)
    assert reply.status_code == 200 and reply.json()["mode"] == "dry-run"
    assert http.post("/admin/planner", json={"mode": "auto"}, headers=AUTH).status_code == 400
    assert http.get("/admin/planner").status_code == 401


def test_a_server_without_a_planner_says_so(monkeypatch) -> None:
    with served_fake_cluster(monkeypatch, KEY) as (_, url), httpx.Client(base_url=url) as http:
        reply = http.get("/admin/planner", headers=AUTH)
        assert reply.status_code == 404
        assert reply.json()["error"]["code"] == "planner_not_configured"
        assert "tandem:planner_mode" not in http.get("/metrics").text
