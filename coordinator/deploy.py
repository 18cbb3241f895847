"""DeployConfig: where the workers run and how they talk. Plain data, no torch and no Ray, so the
command line can read its defaults without loading either; `coordinator.builder` acts on it."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.router import POLICIES as ROUTING_POLICIES
from engine.config import ConfigError

MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class DeployConfig:
    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    address: str | None = None  # Ray cluster to join; None starts a local one
    kv_transport: str = "auto"  # auto, or one of kvtransfer.names.TRANSPORT_NAMES
    transfer_timeout: float = 60.0  # seconds a reservation waits for its KV (a lease)
    kv_checksum: bool = True  # decode workers check a digest of every transfer's KV
    kv_fault: str | None = None  # tests only: every worker's KV sends misbehave (kvtransfer/faults)
    local_prefill_threshold: int = 0  # tokens; shorter uncached prompts prefill on decode
    routing: str = "load"  # coordinator/router.py POLICIES
    threads_per_worker: int | None = None  # CPU only; default: cores / workers
    placement_timeout: float = 30.0  # seconds Ray may take to place each worker's process
    model_name: str | None = None  # served id; default: the model folder's name
    prefill_tp: int | None = None  # ranks per prefill worker; default: the engine's
    decode_tp: int | None = None  # ranks per decode (or colocated) worker; default: the engine's

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(
                f"routing must be one of {', '.join(ROUTING_POLICIES)}, not {self.routing!r}"
            )
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.num_decode < 1 or self.num_prefill < (self.mode == "disaggregated"):
            raise ConfigError("disaggregated mode needs at least one prefill and one decode worker")
        for name in ("prefill_tp", "decode_tp"):
            if (getattr(self, name) or 1) < 1:
                raise ConfigError(f"{name} must be at least 1")

    def tensor_parallel(self, pool: str, engine_tp: int) -> int:
        """Ranks per worker of `pool` ("prefill", "decode" or "colocated")."""
        size = self.prefill_tp if pool == "prefill" else self.decode_tp
        return size or engine_tp
