"""build_client: turns a deployment config into a running backend (the one place that decides
where workers go).

    disaggregated: `num_prefill` PrefillActors + `num_decode` DecodeActors -> Coordinator
    colocated:     `num_prefill + num_decode` DecodeActors that prefill everything locally
                   (the same total resources, for comparisons)

Placement: on CUDA one GPU per worker; on CPU one Ray CPU each, with torch threads set to the
machine's cores divided among the workers. When the cluster advertises `prefill` / `decode`
resources (see cluster.yaml), each worker asks for one unit of its pool's resource.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from coordinator.coordinator import Coordinator, CoordinatorConfig
from coordinator.deploy import DeployConfig
from engine.config import EngineConfig, ModelConfig
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def connect_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Joins the Ray cluster at `address`, or starts a local one when it is None.

    Only the local cluster, which this process starts and owns, runs without token auth; joining
    a remote cluster keeps whatever auth mode that cluster and the environment ask for."""
    if ray.is_initialized():
        return
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(
            address="local",
            include_dashboard=False,
            num_cpus=num_cpus,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
    else:
        ray.init(address=address, log_to_driver=False)


def build_client(engine: EngineConfig, deploy: DeployConfig) -> Coordinator:
    """Starts (or joins) Ray, places the workers, returns the Coordinator (await its ready())."""
    connect_ray(deploy.address)
    model = ModelConfig.from_pretrained(engine.model)
    prefill, decode = place_workers(engine, deploy)
    return Coordinator(
        model_name=deploy.model_name or model.path.name,
        tokenizer=Tokenizer(model.path),
        max_model_len=engine.max_model_len or model.max_model_len,
        vocab_size=model.vocab_size,
        eos_ids=frozenset(model.eos_token_ids),
        prefill=prefill,
        decode=decode,
        config=CoordinatorConfig(
            block_size=engine.block_size,
            local_prefill_threshold=deploy.local_prefill_threshold,
        ),
    )


def place_workers(engine: EngineConfig, deploy: DeployConfig) -> tuple[dict, dict]:
    # The actor classes load torch and the model stack: imported here, where workers are
    # placed, so the coordinator process itself never loads them.
    from prefill.actor import PrefillActor

    total = deploy.num_prefill + deploy.num_decode
    threads = deploy.threads_per_worker or max(1, (os.cpu_count() or 1) // total)
    args = (engine, deploy.kv_transport, deploy.transfer_timeout, threads)
    if deploy.mode == "colocated":
        decode = {
            f"colocated-{i}": _decode_actor(f"colocated-{i}", args, engine, None)
            for i in range(total)
        }
        return {}, decode
    prefill = {
        f"prefill-{i}": ray.remote(PrefillActor)
        .options(**_placement(engine, "prefill"))
        .remote(f"prefill-{i}", *args)
        for i in range(deploy.num_prefill)
    }
    decode = {
        f"decode-{i}": _decode_actor(f"decode-{i}", args, engine, "decode")
        for i in range(deploy.num_decode)
    }
    log.info("placed %d prefill and %d decode workers", len(prefill), len(decode))
    return prefill, decode


def _decode_actor(worker_id: str, args: tuple, engine: EngineConfig, pool: str | None) -> Any:
    from decode.actor import DecodeActor

    return (
        ray.remote(DecodeActor)
        .options(**_placement(engine, pool))
        .remote(worker_id, *args, None)  # host None: the node's own address
    )


def _placement(engine: EngineConfig, pool: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {"max_restarts": 0, "num_cpus": 1}
    if engine.device.startswith("cuda"):
        options["num_gpus"] = 1
    if pool is not None and ray.cluster_resources().get(pool, 0) > 0:
        options["resources"] = {pool: 1}
    return options
