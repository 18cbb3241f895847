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
from dataclasses import dataclass
from typing import Any

import ray

from coordinator.coordinator import Coordinator, CoordinatorConfig
from decode.actor import DecodeActor
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.tokenizer import Tokenizer
from prefill.actor import PrefillActor

log = logging.getLogger(__name__)
MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class DeployConfig:
    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    address: str | None = None  # Ray cluster to join; None starts a local one
    kv_transport: str = "auto"  # auto | gloo | nccl | ucx
    transfer_timeout: float = 60.0  # seconds a reservation waits for its KV (a lease)
    local_prefill_threshold: int = 0  # tokens; shorter uncached prompts prefill on decode
    threads_per_worker: int | None = None  # CPU only; default: cores / workers
    model_name: str | None = None  # served id; default: the model folder's name

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.num_decode < 1 or self.num_prefill < (self.mode == "disaggregated"):
            raise ConfigError("disaggregated mode needs at least one prefill and one decode worker")


def connect_ray(address: str | None, num_cpus: int | None = None) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address is None:
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
