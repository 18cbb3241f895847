"""Tensor-parallel workers on Ray: each follower rank an actor in its worker's placement group;
greedy output equal to TP 1, colocated and disaggregated across different layouts; a killed
rank takes its worker down, its requests resume on the other worker, and the worker is
replaced."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group_table

from engine.config import ConfigError
from tests.disagg.test_failures import assert_all_blocks_free, generate_all, run_and_kill
from tests.support.servers import wait_until


@pytest.fixture(autouse=True)
def room(build_pool) -> None:
    """A placement group needs whole free CPUs on one node: earlier tests' pools are stopped."""
    build_pool.stop_all()


def rank_pids() -> list[int]:
    """Processes of live RankActors on this machine (Ray titles them ray::RankActor)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"ray::RankActor" in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def created_groups() -> int:
    return sum(group["state"] == "CREATED" for group in placement_group_table().values())


def test_a_tp_2_pool_serves_the_tp_1_output(tiny_llama, build_pool, loop, prompts, expected):
    groups_before, ranks_before = created_groups(), len(rank_pids())
    client = build_pool(tiny_llama, mode="colocated", num_prefill=0, num_decode=1, decode_tp=2)
    assert created_groups() == groups_before + 1  # one STRICT_PACK group of 2 bundles
    assert len(rank_pids()) == ranks_before + 1  # rank 1; rank 0 is the WorkerActor
    outputs = loop.run(generate_all(client, prompts, lambda i, n: None), timeout=120)
    assert outputs == expected
    loop.run(client.shutdown())
    assert wait_until(lambda: created_groups() == groups_before, timeout=30)  # group removed


def test_a_killed_rank_retires_its_worker_and_requests_resume(
    tiny_llama, build_pool, loop, prompts, expected
):
    before = set(rank_pids())
    client = build_pool(tiny_llama, mode="colocated", num_prefill=0, num_decode=2, decode_tp=2)
    followers = sorted(set(rank_pids()) - before)
    assert len(followers) == 2
    outputs = run_and_kill(
        loop, client, prompts, followers[0],
        kill_when=lambda p: len(p) == len(prompts) and min(p.values()) >= 3,
        kill=lambda pid: os.kill(pid, signal.SIGKILL),
    )  # fmt: skip
    assert outputs == expected
    assert wait_until(lambda: client.supervisor.restarts().get("colocated", 0) >= 1, 60)
    assert wait_until(lambda: len(client.supervisor.serving("colocated")) == 2, timeout=120)
    assert_all_blocks_free(loop, list(client.decode.values()))


def test_disaggregated_prefill_tp_2_to_decode_tp_1_serves_the_tp_1_output(
    tiny_llama, build_pool, loop, prompts, expected
):
    client = build_pool(
        tiny_llama, num_prefill=1, num_decode=1, prefill_tp=2, decode_tp=1
    )  # fmt: skip
    outputs = loop.run(generate_all(client, prompts, lambda i, n: None), timeout=120)
    assert outputs == expected
    stats = ray.get(client.decode["decode-0"].stats.remote(), timeout=30)
    assert stats.requests_prefilled_locally == 0  # every prompt's KV came over both routes
    assert stats.kv_transfer_bytes > 0
    assert_all_blocks_free(loop, list(client.decode.values()))


def test_a_killed_prefill_rank_fails_over_to_the_other_prefill_worker(
    tiny_llama, build_pool, loop, prompts, expected
):
    before = set(rank_pids())
    client = build_pool(
        tiny_llama, num_prefill=2, num_decode=1, prefill_tp=2, decode_tp=1
    )  # fmt: skip
    followers = sorted(set(rank_pids()) - before)
    assert len(followers) == 2
    outputs = run_and_kill(
        loop, client, prompts, followers[0],
        kill_when=lambda p: len(p) >= 1,
        kill=lambda pid: os.kill(pid, signal.SIGKILL),
    )  # fmt: skip
    assert outputs == expected
    assert wait_until(lambda: client.supervisor.restarts().get("prefill", 0) >= 1, 60)
    assert_all_blocks_free(loop, list(client.decode.values()))


def test_a_layout_that_does_not_split_is_refused_clearly(tiny_llama, build_pool) -> None:
    with pytest.raises(ConfigError, match="does not divide"):
        build_pool(tiny_llama, num_prefill=1, num_decode=1, prefill_tp=3)
