"""DeployConfig: where the workers run and how they talk. Plain data, no torch and no Ray, so the
command line can read its defaults without loading either; `coordinator.builder` acts on it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from coordinator.planner_loop import MODES as PLANNER_MODES
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
    threads_per_worker: int | None = None  # CPU only; default: coordinator/builder.py's split
    lend_cores: bool = True  # CPU workers sharing cores step on a share of the busy ones'
    gpus_per_worker: float = 1.0  # CUDA only: each rank's share of a GPU (0.5: two per GPU)
    placement_timeout: float = 30.0  # seconds Ray may take to place each worker's process
    model_name: str | None = None  # served id; default: the model folder's name
    prefill_tp: int | None = None  # ranks per prefill worker; default: the engine's
    decode_tp: int | None = None  # ranks per decode (or colocated) worker; default: the engine's
    planner: str = "off"  # the SLO planner: on | dry-run | off (coordinator/planner_loop.py)
    planner_slo: str | None = None  # "ttft_p99=2s,itl_p99=50ms"; none: no planner at all
    planner_profile: Path | None = None  # step cost model; default: <model>/tandem-profile.json
    planner_max_workers: int | None = None  # default: the workers launched
    planner_interval: float = 2.0  # seconds between decisions
    stream_interval: int = 1  # tokens per streamed chunk: more costs the server less per token

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(
                f"routing must be one of {', '.join(ROUTING_POLICIES)}, not {self.routing!r}"
            )
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.num_decode < 1 or self.num_prefill < (self.mode == "disaggregated"):
            raise ConfigError("disaggregated mode needs at least one prefill and one decode worker")
        if self.stream_interval < 1:
            raise ConfigError("--stream-interval must be at least 1")
        if self.planner not in PLANNER_MODES:
            raise ConfigError(f"planner must be one of {', '.join(PLANNER_MODES)}")
        if self.planner != "off" and self.planner_slo is None:
            raise ConfigError(
                f"--planner {self.planner} needs --planner-slo, e.g. ttft_p99=2s,itl_p99=50ms"
            )
        if self.planner_slo is not None and self.mode == "colocated":
            raise ConfigError(
                "the planner sizes prefill and decode pools: use --mode disaggregated"
            )
        if not 0 < self.gpus_per_worker <= 1:
            raise ConfigError(
                "--gpus-per-worker must be in (0, 1]: a rank's share of one GPU (0.5 puts two "
                "workers on each GPU)"
            )
        if not 0 < self.planner_interval < math.inf:  # (NaN fails too: the loop would spin)
            raise ConfigError("--planner-interval must be a finite number > 0")
        if self.planner_max_workers is not None and self.planner_max_workers < 2:
            raise ConfigError("--planner-max-workers must be at least 2 (a prefill and a decode)")
        launched = self.num_prefill + self.num_decode
        if self.planner_max_workers is not None and self.planner_max_workers < launched:
            raise ConfigError(
                f"--planner-max-workers {self.planner_max_workers} is below the {launched} "
                "workers launched: the planner never grows past it, and would only shrink"
            )
        for name in ("prefill_tp", "decode_tp"):
            if (getattr(self, name) or 1) < 1:
                raise ConfigError(f"{name} must be at least 1")

    def tensor_parallel(self, pool: str, engine_tp: int) -> int:
        """Ranks per worker of `pool` ("prefill", "decode" or "colocated")."""
        size = self.prefill_tp if pool == "prefill" else self.decode_tp
        return size or engine_tp
