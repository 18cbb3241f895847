"""connect_ray: only a Ray cluster this process starts itself runs without token auth;
WorkerSpawner: each pool's torch threads, and the core ledger of workers that share cores.
Ray is never started here: ray.init, ray.is_initialized and ray.cluster_resources are
stand-ins."""

from __future__ import annotations

import gc
import os
from dataclasses import replace
from pathlib import Path

import pytest
import ray

from coordinator.builder import WorkerSpawner, cluster_device, connect_ray
from coordinator.deploy import DeployConfig
from engine.config import ConfigError, EngineConfig
from protocol.core_ledger import CoreLedger


@pytest.fixture
def ray_init(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """ray.init's calls, recorded instead of run; RAY_AUTH_MODE unset beforehand."""
    calls: list[dict] = []
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    return calls


@pytest.mark.parametrize(
    "asked,gpus,address,settled",
    [
        ("auto", 16.0, "auto", "cuda"),  # `ray up`: a head without GPU, GPU workers
        ("auto", 0.0, "auto", "cpu"),  # (the log says --device cuda would wait for them)
        ("auto", 0.0, None, "cpu"),
        ("cpu", 16.0, "auto", "cpu"),
        ("cuda", 0.0, "auto", "cuda"),
    ],
)
def test_device_auto_is_settled_by_the_clusters_gpus_not_this_machines(
    monkeypatch, asked, gpus, address, settled
) -> None:
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": gpus})
    assert cluster_device(asked, address) == settled


def test_local_cluster_runs_without_auth(ray_init) -> None:
    connect_ray(None, num_cpus=2)
    assert [(call["address"], call["num_cpus"]) for call in ray_init] == [("local", 2)]
    assert os.environ.get("RAY_AUTH_MODE") == "disabled"


def test_local_cluster_keeps_an_auth_mode_already_set(ray_init, monkeypatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    connect_ray(None)
    assert len(ray_init) == 1
    assert os.environ["RAY_AUTH_MODE"] == "token"


@pytest.mark.parametrize("address", ["auto", "ray://head:10001", "10.0.0.5:6379"])
def test_joining_a_remote_cluster_leaves_auth_alone(ray_init, address) -> None:
    connect_ray(address)
    assert [call["address"] for call in ray_init] == [address]
    assert "RAY_AUTH_MODE" not in os.environ


def test_already_connected_does_nothing(ray_init, monkeypatch) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    connect_ray(None)
    assert ray_init == []
    assert "RAY_AUTH_MODE" not in os.environ


@pytest.mark.parametrize(
    ("cores", "deploy", "expected"),
    [
        # decode steps back to back, prefill in bursts: decode takes the cores prefill idles on
        (2, DeployConfig(num_prefill=1, num_decode=1), {"prefill": 1, "decode": 2}),
        (8, DeployConfig(num_prefill=2, num_decode=2), {"prefill": 2, "decode": 4}),
        (2, DeployConfig(num_prefill=1, num_decode=2), {"prefill": 1, "decode": 1}),
        (2, DeployConfig(mode="colocated", num_prefill=0, num_decode=1), {"colocated": 2}),
        (2, DeployConfig(num_decode=1, threads_per_worker=3), {"prefill": 3, "decode": 3}),
    ],
)  # fmt: skip
def test_torch_threads_per_pool(monkeypatch, cores, deploy, expected) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": float(cores)})
    spawner = WorkerSpawner(EngineConfig(model="unused"), deploy)
    assert {pool: spawner.threads[pool] for pool in expected} == expected


@pytest.mark.parametrize(
    ("device", "deploy", "shares"),
    [
        ("cpu", DeployConfig(num_prefill=1, num_decode=1), True),
        ("cpu", DeployConfig(num_prefill=1, num_decode=1, lend_cores=False), False),
        ("cpu", DeployConfig(num_prefill=1, num_decode=1, threads_per_worker=1), False),
        ("cpu", DeployConfig(num_prefill=1, num_decode=2), True),  # one thread each
        ("cpu", DeployConfig(mode="colocated", num_prefill=0, num_decode=1), False),  # all cores
        ("cpu", DeployConfig(mode="colocated", num_prefill=0, num_decode=2), True),
        # On a cluster joined with --address each node's workers pace by that node's cores:
        # this machine's count says nothing of theirs.
        ("cpu", DeployConfig(mode="colocated", num_prefill=0, num_decode=1, address="auto"), True),
        ("cuda", DeployConfig(num_prefill=1, num_decode=1), False),
    ],
)  # fmt: skip
def test_workers_that_split_a_hosts_cores_share_a_core_ledger(
    monkeypatch, device, deploy, shares
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "GPU": 2.0})
    spawner = WorkerSpawner(EngineConfig(model="unused", device=device), deploy)
    if not shares:
        assert spawner.core_share is None
        return
    path = spawner.core_share
    assert Path(path).name.startswith(f"tandem-cores-{os.getpid()}-")
    assert CoreLedger(path).busy() == 0  # made by the spawner, which removes it when it goes
    del spawner
    gc.collect()
    assert not Path(path).exists()


@pytest.mark.parametrize(
    ("device", "deploy", "num_gpus"),
    [
        ("cpu", DeployConfig(), None),
        ("cuda", DeployConfig(), 1.0),
        ("cuda", DeployConfig(gpus_per_worker=0.5), 0.5),
    ],
)  # fmt: skip
def test_each_worker_asks_for_its_share_of_a_gpu(monkeypatch, device, deploy, num_gpus) -> None:
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    spawner = WorkerSpawner(EngineConfig(model="unused", device=device), deploy)
    options = spawner._options("decode")
    assert options.get("num_gpus") == num_gpus


def test_a_pool_placed_by_its_resource_keeps_asking_for_it_once_its_nodes_are_gone(
    monkeypatch,
) -> None:
    """cluster.yaml's GPU nodes advertise `prefill` or `decode`: a replacement started after the
    pool's last node died must still ask for the pool's unit (the autoscaler then starts that
    node type; without it the worker lands on the other pool's GPUs)."""
    resources = {"CPU": 400.0, "GPU": 16.0, "prefill": 8.0, "decode": 8.0}
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(resources))
    spawner = WorkerSpawner(EngineConfig(model="unused", device="cuda"), DeployConfig())
    assert spawner._options("prefill")["resources"] == {"prefill": 1}
    del resources["prefill"]  # the prefill node died
    assert spawner._options("prefill")["resources"] == {"prefill": 1}
    assert spawner._options("decode")["resources"] == {"decode": 1}
    assert "resources" not in spawner._options("colocated")


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_gpu_share_outside_zero_to_one_is_refused(share: float) -> None:
    with pytest.raises(ConfigError, match="--gpus-per-worker must be in"):
        DeployConfig(gpus_per_worker=share)


def test_workers_sharing_a_gpu_fit_on_one(monkeypatch) -> None:
    """1P1D on one GPU: two halves fit, two wholes are refused naming the share flag."""
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    engine = EngineConfig(model="unused", device="cuda")
    WorkerSpawner(engine, DeployConfig(gpus_per_worker=0.5)).check_room()
    with pytest.raises(ConfigError, match=r"need 2 GPU .* has 1 GPU.*--gpus-per-worker"):
        WorkerSpawner(engine, DeployConfig()).check_room()


def test_growth_is_checked_against_this_machines_room(monkeypatch, tiny_llama) -> None:
    """The admin API's growth on a cluster tandem started: GPUs free, or memory available; a
    joined cluster may grow, so nothing is refused there."""
    import coordinator.builder as builder

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 2.0})
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 14.0, "GPU": 1.0})
    gpu = WorkerSpawner(EngineConfig(model=tiny_llama, device="cuda"), DeployConfig())
    assert gpu.room_for({"decode": 1}) is None
    assert gpu.room_for({"decode": 2}) == "2 more workers need 2 GPUs and 1 are free"
    cpu = WorkerSpawner(EngineConfig(model=tiny_llama), DeployConfig())
    one = builder.worker_bytes(cpu.engine)
    monkeypatch.setattr(builder, "_available_memory", lambda: int(2.5 * one))
    assert cpu.room_for({"decode": 2}) is None
    assert "3 more workers need about" in cpu.room_for({"decode": 2, "prefill": 1})
    joined = WorkerSpawner(EngineConfig(model=tiny_llama), DeployConfig(address="auto"))
    assert joined.room_for({"decode": 1000}) is None


def test_a_kv_budget_without_room_for_one_block_is_refused_before_ray(tiny_llama) -> None:
    from coordinator.builder import check_kv_budget
    from engine.config import ModelConfig

    model = ModelConfig.from_pretrained(tiny_llama)
    small = EngineConfig(model=tiny_llama, kv_cache_memory_bytes=1024, dtype="float32")
    with pytest.raises(ConfigError, match="--kv-cache-memory of 1024 bytes holds no KV block"):
        check_kv_budget(small, DeployConfig(), model)
    check_kv_budget(replace(small, kv_cache_memory_bytes=1 << 20), DeployConfig(), model)
    check_kv_budget(replace(small, num_kv_blocks=8), DeployConfig(), model)  # blocks, not bytes


def test_a_worker_ray_refuses_to_create_leaves_no_placement_group(monkeypatch) -> None:
    """A tensor-parallel worker's placement group is made before its actor; when Ray refused
    the actor (the failed start the supervisor retries), no worker id reached the supervisor,
    nothing released the group, and each retry held one more set of bundles for good."""
    import coordinator.builder as builder

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    made, removed = [], []
    monkeypatch.setattr(
        builder, "placement_group", lambda bundles, strategy: made.append(object()) or made[-1]
    )
    monkeypatch.setattr(builder, "remove_placement_group", removed.append)
    monkeypatch.setattr(
        builder,
        "PlacementGroupSchedulingStrategy",
        lambda group, placement_group_bundle_index: group,
    )

    class Refused:
        def options(self, **options):
            return self

        def remote(self, *args, **kwargs):
            raise RuntimeError("the GCS refused the actor")

    monkeypatch.setattr(ray, "remote", lambda cls: Refused())
    spawner = WorkerSpawner(EngineConfig(model="unused"), DeployConfig(decode_tp=2))
    for _ in range(3):
        with pytest.raises(RuntimeError, match="refused"):
            spawner.spawn("decode")
    assert len(made) == 3 and removed == made
    assert spawner._groups == {} and spawner.worker_ranks == {}
