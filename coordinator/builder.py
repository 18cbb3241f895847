"""build_client: turns a deployment config into a running backend (the one place that decides
where workers go).

    disaggregated: `num_prefill` + `num_decode` WorkerActors in those roles -> Coordinator
    colocated:     `num_prefill + num_decode` decode-role WorkerActors that prefill everything
                   locally
                   (the same total resources, for comparisons)

Placement: on CUDA one GPU per rank; on CPU one Ray CPU per rank (a share of one when the
cluster has fewer CPUs than ranks). Torch threads (CPU): a colocated or prefill rank gets the
machine's cores divided among all ranks; a decode rank the cores divided among the decode ranks
only. Decode steps run back to back while prefill comes in bursts, so decode takes the cores
prefill leaves idle (2 cores, SmolLM2, 1P1D: 436 vs 319 tok/s served with one thread each;
docs/performance.md). A worker keeps its count across role switches.

A worker of tensor parallel size N > 1 gets a placement group of N such bundles, STRICT_PACK
(one node): rank 0, the WorkerActor, on bundle 0 and its followers on the others
(worker/ranks.py); the group is removed when the worker is retired. When the cluster advertises
`prefill` / `decode` resources (see cluster.yaml), each worker asks for one unit of its pool's
resource.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from coordinator.coordinator import Coordinator, CoordinatorConfig
from coordinator.deploy import DeployConfig
from coordinator.planner_loop import LoopSettings, PlannerSetup
from coordinator.reaper import start_reaper
from coordinator.router import RouteCosts
from engine.config import ConfigError, EngineConfig, ModelConfig, check_splits
from engine.tokenizer import Tokenizer
from planning.cost_model import Calibrated, StepCostModel
from planning.model_file import PROFILE_FILE, CostModelError
from planning.planner import Planner, PlannerConfig
from planning.slo import SloError, parse_slo, planner_targets
from protocol.core_ledger import CoreLedger, new_ledger, sweep
from protocol.kv import DTYPE_BYTES, KVLayout

log = logging.getLogger(__name__)
LOCAL_LOGICAL_CPUS = 32  # placements a cluster tandem starts itself allows
WORKER_OVERHEAD_BYTES = 600 * 2**20  # a worker process beyond its weights and KV cache
PLANNER_LEAD_S = 60.0  # a rising load is planned this far ahead until a worker start is measured


def connect_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Joins the Ray cluster at `address`, or starts a local one when it is None.

    Only the local cluster, which this process starts and owns, runs without token auth; joining
    a remote cluster keeps whatever auth mode that cluster and the environment ask for."""
    if ray.is_initialized():
        return
    # ray.init replaces the SIGTERM handler with one that kills the process on the spot; a
    # caller that handles SIGTERM itself (tandem serve: stop cleanly) keeps its handler.
    previous = signal.getsignal(signal.SIGTERM)
    try:
        _init_ray(address, num_cpus)
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def _init_ray(address: str | None, num_cpus: int | None) -> None:
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Ray starts workers at niceness 15, where the engine threads lose the cores to the
        # HTTP server and the coordinator; tandem's workers are the service. (On a `ray up`
        # cluster, cluster.yaml sets the same for its nodes.)
        os.environ.setdefault("RAY_worker_niceness", "0")
        # Task events feed Ray's dashboard, which tandem's own cluster does not run; left on,
        # every poll and probe is recorded in the GCS, whose memory then grows for hours.
        os.environ.setdefault("RAY_task_events_report_interval_ms", "0")
        start_reaper()  # the cluster goes with this process, however it ends
        ray.init(
            address="local",
            include_dashboard=False,
            # Logical CPUs only count placements: every worker asks for one, sets its own torch
            # threads, and the pools share the cores. Memory is what limits a pool here
            # (WorkerSpawner.check_room), not Ray's count of cores.
            num_cpus=num_cpus or max(os.cpu_count() or 1, LOCAL_LOGICAL_CPUS),
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
        stop_log_monitor()
    else:
        ray.init(address=address, log_to_driver=False)


def stop_log_monitor() -> None:
    """Stops the log monitor of the Ray node this process started. It reads every worker's log
    files ten times a second to forward new lines to drivers, and with log_to_driver off no
    driver takes them (the files stay where they are): 0.7% of a core all day, taken from the
    engine threads on a small host. `ray.init` has no switch for it; `Node.kill_log_monitor`
    is how Ray's own tests stop it, so a Ray without it just keeps the monitor."""
    node = getattr(ray._private.worker, "_global_node", None)
    kill = getattr(node, "kill_log_monitor", None)
    if kill is None:
        return
    try:
        kill(check_alive=False)
    except Exception as err:  # a private API: never a reason not to serve
        log.debug("the log monitor keeps running: %s: %s", type(err).__name__, err)


def cluster_device(device: str, address: str | None) -> str:
    """`device`, with "auto" settled by the workers' machines, not this one: "cuda" when the
    Ray cluster has GPUs (on `ray up` the head has none, and its workers do). A cluster whose GPU
    nodes have not joined yet counts none: said in the log, with the flag that waits for them."""
    if device != "auto":
        return device
    if ray.cluster_resources().get("GPU", 0) > 0:
        return "cuda"
    if address is not None:
        log.warning(
            "--device auto: the Ray cluster has no GPU (yet), so the workers run on CPU; "
            "pass --device cuda to wait for GPU nodes instead"
        )
    return "cpu"


def build_client(engine: EngineConfig, deploy: DeployConfig) -> Coordinator:
    """Starts (or joins) Ray, places the workers, returns the Coordinator (await its ready())."""
    model = ModelConfig.from_pretrained(engine.model)
    check_kv_budget(engine, deploy, model)  # these errors before Ray starts, not in every worker
    planner = planner_setup(engine, deploy, model.path)
    late_after_s = None if planner is None else planner.planner.config.ttft_slo_s
    # Every queue knows the TTFT objective: the coordinator's line for decode room, and each
    # worker's waiting requests (past it, both serve the newest first).
    engine = replace(engine, late_after_s=late_after_s)
    connect_ray(deploy.address)
    engine = replace(engine, device=cluster_device(engine.device, deploy.address))
    if planner is not None:
        check_planner_profile(planner.model.model, engine.device, deploy, model.path)
        # The step budget the workers take, known once the device is (--device auto).
        planner.planner.config = replace(
            planner.planner.config, max_num_batched_tokens=engine.max_num_batched_tokens
        )
    spawner = WorkerSpawner(engine, deploy)
    for pool in spawner.pools():  # before any worker starts: a clear error, not a dead actor
        check_splits(model, spawner.tensor_parallel(pool))
    spawner.check_room()
    prefill, decode = spawner.initial_pools()
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
            routing=deploy.routing,
            route_costs=route_costs(deploy, model.path, engine.device),
            placement_timeout=deploy.placement_timeout,
            late_after_s=late_after_s,
            stream_interval=deploy.stream_interval,
            # Decode workers connect back to this process with their token updates.
            update_host="127.0.0.1" if deploy.address is None else ray.util.get_node_ip_address(),
        ),
        spawn=spawner.spawn,
        unplaced=spawner.unplaced,
        decode_pool="colocated" if deploy.mode == "colocated" else "decode",
        release=spawner.release,
        ranks=spawner.worker_ranks.__getitem__,
        planner=planner,
        request_capacity=spawner.request_capacity,
        room_for=spawner.room_for,
    )


def check_kv_budget(engine: EngineConfig, deploy: DeployConfig, model: ModelConfig) -> None:
    """ConfigError when `--kv-cache-memory` holds not one block of the model's KV on a rank of
    any pool (a rank holds its share of the KV heads), before any worker finds out alone.
    (`--gpu-memory-utilization` is checked by each worker on its GPU.)"""
    if engine.num_kv_blocks is not None or engine.gpu_memory_utilization is not None:
        return
    for pool in ("prefill", "decode"):
        ranks = deploy.tensor_parallel(pool, engine.tensor_parallel_size)
        heads = -(-model.num_kv_heads // ranks)  # a rank's share, rounded up
        layout = KVLayout(model.num_layers, heads, model.head_dim, engine.dtype)
        per_block = layout.bytes_for(engine.block_size)
        if engine.kv_cache_memory_bytes < per_block:
            raise ConfigError(
                f"--kv-cache-memory of {engine.kv_cache_memory_bytes} bytes holds no KV block: "
                f"one block of {engine.block_size} tokens takes {per_block} bytes on a {pool} "
                "worker's rank"
            )


def profile_path(deploy: DeployConfig, model_path: Path) -> Path:
    """The step profile the planner and cost routing price with."""
    return deploy.planner_profile or model_path / PROFILE_FILE


def profile_mismatch(model: StepCostModel, device: str) -> str | None:
    """Why a step profile cannot price steps on `device`, or None. A profile fitted from
    telemetry names no device and is taken as it is."""
    measured = model.info.device.split(":")[0]
    if not measured or measured == device.split(":")[0]:
        return None
    return f"was measured on {measured} and the workers run on {device}"


def check_planner_profile(
    model: StepCostModel, device: str, deploy: DeployConfig, model_path: Path
) -> None:
    """A planner predicting GPU steps with CPU prices (or the reverse) would size the pools by
    orders of magnitude wrong: ConfigError, naming the command that measures the right ones."""
    reason = profile_mismatch(model, device)
    if reason is not None:
        raise ConfigError(
            f"the planner's step profile {profile_path(deploy, model_path)} {reason}: measure "
            f"the workers' steps with `tandem profile --device {device} --model {model_path}` "
            "on a worker's machine "
            "(on a `ray up` head: add --address auto, which sweeps on a GPU node and saves the "
            "profile here), or give --planner-profile"
        )


def route_costs(deploy: DeployConfig, model_path: Path, device: str) -> RouteCosts:
    """Cost routing's prices, from the model's step profile (`--planner-profile`, else
    <model>/tandem-profile.json) when there is one for the workers' device; the built-in
    defaults otherwise."""
    profile = profile_path(deploy, model_path)
    if deploy.routing != "cost" or not profile.is_file():
        return RouteCosts()
    try:
        model = StepCostModel.load(profile)
    except CostModelError as err:
        raise ConfigError(f"{profile}: {err}") from None
    reason = profile_mismatch(model, device)
    if reason is not None:
        log.warning("cost routing ignores %s: it %s; the built-in prices stay", profile, reason)
        return RouteCosts()
    costs = RouteCosts.from_step_model(model)
    log.info("cost routing priced from %s: %s", profile, costs)
    return costs


def planner_setup(
    engine: EngineConfig, deploy: DeployConfig, model_path: Path
) -> PlannerSetup | None:
    """The SLO planner `--planner-slo` asks for (None without one): its targets, the step cost
    model it predicts with, and its bounds. ConfigError, naming the fix, when it cannot run."""
    if deploy.planner_slo is None:
        return None
    try:
        targets = planner_targets(parse_slo(deploy.planner_slo))
    except SloError as err:
        raise ConfigError(f"--planner-slo: {err}") from None
    profile = profile_path(deploy, model_path)
    if profile.is_dir():
        raise ConfigError(f"--planner-profile {profile} is a folder: name the profile's file")
    if not profile.is_file():
        raise ConfigError(
            f"the planner predicts with a step cost model and {profile} does not exist: run "
            f"`tandem profile --model {model_path}` first (on a `ray up` head, with --address "
            "auto: the sweep runs on a GPU node), or give --planner-profile"
        )
    try:
        model = Calibrated(StepCostModel.load(profile))
    except CostModelError as err:
        raise ConfigError(f"--planner-profile: {err}") from None
    max_workers = deploy.planner_max_workers or deploy.num_prefill + deploy.num_decode
    config = PlannerConfig(
        ttft_slo_s=targets.ttft_s,
        itl_slo_s=targets.itl_s,
        max_workers=max_workers,
        max_num_seqs=engine.max_num_seqs,
        # (None until build_client settles --device auto, and sets it there)
        max_num_batched_tokens=engine.max_num_batched_tokens,
        lead_s=PLANNER_LEAD_S,
        decode_headroom_tokens=engine.decode_headroom_tokens,
        percentile=targets.percentile,
    )
    return PlannerSetup(
        Planner(model, config),
        model,
        LoopSettings(deploy.planner, deploy.planner_interval, targets.percentile),
    )


class WorkerSpawner:
    """Starts workers of a pool: the initial ones, and later replacements or additions (the
    coordinator calls `spawn`). Every worker of a deployment asks for the same resources."""

    def __init__(self, engine: EngineConfig, deploy: DeployConfig) -> None:
        self.engine = engine
        self.deploy = deploy
        self.total = deploy.num_prefill + deploy.num_decode
        prefill_ranks = 0
        if deploy.mode == "colocated":
            self.ranks = self.total * self.tensor_parallel("colocated")
        else:
            prefill_ranks = deploy.num_prefill * self.tensor_parallel("prefill")
            self.ranks = prefill_ranks + deploy.num_decode * self.tensor_parallel("decode")
        resources = ray.cluster_resources()
        cluster_cpus = resources.get("CPU", 1.0)
        # Ranks share cores when there are fewer than ranks (a laptop, a CI box); on a
        # cluster each takes a whole Ray CPU.
        self.num_cpus = min(1.0, cluster_cpus / self.ranks)
        cores = os.cpu_count() or 1
        self.threads = {pool: max(1, cores // self.ranks) for pool in ("colocated", "prefill")}
        self.threads["decode"] = max(1, cores // max(1, self.ranks - prefill_ranks))
        if deploy.threads_per_worker:
            self.threads = dict.fromkeys(self.threads, deploy.threads_per_worker)
        self.core_share = self._core_share()
        self._next_index: dict[str, int] = {}
        self._groups: dict[str, Any] = {}  # worker id -> its placement group (TP > 1)
        # Pools whose workers the cluster places by a resource of the pool's name (cluster.yaml:
        # each GPU node type advertises `prefill` or `decode`). Remembered once seen: when a
        # pool's last node is gone, its replacement must still ask for one (else it lands on
        # the other pool's GPUs, or the autoscaler starts the wrong node type).
        self._pool_resources = {p for p in ("prefill", "decode") if resources.get(p, 0) > 0}
        self.worker_ranks: dict[str, int] = {}  # worker id -> its tensor-parallel ranks

    def tensor_parallel(self, pool: str) -> int:
        return self.deploy.tensor_parallel(pool, self.engine.tensor_parallel_size)

    def _core_share(self) -> str | None:
        """Workers that each got fewer threads than the host has cores share a core ledger
        (protocol/core_ledger.py) and step on their share of the cores among those computing:
        a worker alone gets them all, and busy ones split them rather than preempt each
        other's threads. None where no worker shares: on GPUs, one worker on every core, with
        --threads-per-worker or --no-lend-cores."""
        cores = os.cpu_count() or 1
        # This machine's cores say nothing of another node's: on a cluster joined with
        # --address, workers always pace by a ledger on their own node (each counts that node's
        # cores, kernels/core_share.py), alone on it or not.
        alone = self.deploy.address is None and all(
            self.threads[pool] >= cores for pool in self.pools()
        )
        if (
            self.engine.device.startswith("cuda")
            or not self.deploy.lend_cores
            or self.deploy.threads_per_worker
            or alone
        ):
            return None
        sweep()  # ledgers that servers killed with SIGKILL left behind
        path = new_ledger()
        try:
            CoreLedger(path)  # made here, so that a host without shared memory says so now
        except OSError as err:
            log.warning("workers keep a fixed thread split: no core ledger at %s: %s", path, err)
            return None
        weakref.finalize(self, _remove, path)  # once the coordinator lets the spawner go
        return str(path)  # a worker on another host opens (and makes) one of its own there

    def pools(self) -> list[str]:
        return ["colocated"] if self.deploy.mode == "colocated" else ["prefill", "decode"]

    def initial_pools(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.deploy.mode == "colocated":
            return {}, dict(self.spawn("colocated") for _ in range(self.total))
        prefill = dict(self.spawn("prefill") for _ in range(self.deploy.num_prefill))
        decode = dict(self.spawn("decode") for _ in range(self.deploy.num_decode))
        log.info("placed %d prefill and %d decode workers", len(prefill), len(decode))
        return prefill, decode

    def spawn(self, pool: str) -> tuple[str, Any]:
        """A new worker of `pool` ("prefill", "decode" or "colocated"): (id, actor handle).
        The handle answers once the worker has loaded its model."""
        # The actor classes load torch and the model stack: imported here, where workers are
        # placed, so the coordinator process itself never loads them.
        from worker.actor import WorkerActor

        index = self._next_index.get(pool, 0)
        self._next_index[pool] = index + 1
        worker_id = f"{pool}-{index}"
        engine = replace(
            self.engine,
            tensor_parallel_size=self.tensor_parallel(pool),
            # a prefill worker's steps run layer hooks, which graphs do not hold
            cuda_graphs=self.engine.cuda_graphs and pool != "prefill",
        )
        self.worker_ranks[worker_id] = engine.tensor_parallel_size
        args = (worker_id, engine, self.deploy.kv_transport, self.deploy.transfer_timeout)
        options = self._options(None if pool == "colocated" else pool)
        placement = self._place_ranks(worker_id, engine.tensor_parallel_size, options)
        role = "prefill" if pool == "prefill" else "decode"
        try:
            handle = (
                ray.remote(WorkerActor)
                .options(**options)
                .remote(
                    *args,
                    self.threads[pool],
                    role,
                    verify_kv=self.deploy.kv_checksum,
                    kv_fault=self.deploy.kv_fault,
                    placement=placement,
                    core_share=self.core_share,
                )
            )
        except BaseException:
            # No worker id reaches the supervisor, so nothing would ever release the group:
            # each retried start would hold one more set of bundles for good.
            self.release(worker_id)
            self.worker_ranks.pop(worker_id, None)
            raise
        return worker_id, handle

    def _place_ranks(
        self, worker_id: str, size: int, options: dict[str, Any]
    ) -> tuple[Any, dict[str, float]] | None:
        """A placement group of one bundle per rank on one node; the worker's `options` are
        pointed at bundle 0. None for a single-rank worker."""
        if size == 1:
            return None
        bundle = {"CPU": options["num_cpus"]}
        if "num_gpus" in options:
            bundle["GPU"] = float(options["num_gpus"])
        first = {**bundle, **options.get("resources", {})}  # the pool's unit goes to rank 0
        group = placement_group([first] + [bundle] * (size - 1), strategy="STRICT_PACK")
        self._groups[worker_id] = group
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0
        )
        return group, bundle

    def request_capacity(self, workers: int) -> None:
        """Asks Ray's autoscaler for room for `workers` workers in all, at once (the planner's
        whole deficit, not one node at a time); the request replaces the previous one, so a
        smaller layout lets idle nodes go. Only on a cluster joined with --address: one tandem
        started itself cannot grow."""
        if self.deploy.address is None:
            return
        from ray.autoscaler.sdk import request_resources

        bundle = {"CPU": self.num_cpus}
        if self.engine.device.startswith("cuda"):
            bundle["GPU"] = self.deploy.gpus_per_worker
        ranks = max(self.tensor_parallel(pool) for pool in self.pools())
        request_resources(bundles=[bundle] * (workers * ranks))

    def release(self, worker_id: str) -> None:
        """Frees a retired worker's placement group (its ranks end with it)."""
        group = self._groups.pop(worker_id, None)
        if group is not None:
            remove_placement_group(group)

    def check_room(self) -> None:
        """Fails at once, naming what is missing, when the cluster cannot hold the pools (a
        worker Ray cannot place would otherwise wait forever)."""
        if self.deploy.address is None and not self.engine.device.startswith("cuda"):
            self._check_memory()
        needs = {"CPU": self.num_cpus * self.ranks}
        if self.engine.device.startswith("cuda"):
            needs["GPU"] = self.ranks * self.deploy.gpus_per_worker
        have = ray.cluster_resources()
        missing = {k: v for k, v in needs.items() if have.get(k, 0.0) + 1e-9 < v}
        if missing and self.deploy.address is None:  # a cluster we started cannot grow
            wanted = ", ".join(f"{v:g} {k}" for k, v in missing.items())
            owned = ", ".join(f"{have.get(k, 0):g} {k}" for k in missing)
            share = " or --gpus-per-worker" if "GPU" in missing else ""
            raise ConfigError(
                f"the pools need {wanted} but this machine has {owned}: lower "
                f"--prefill-workers / --decode-workers{share} (or use --device cpu)"
            )

    def room_for(self, more: dict[str, int]) -> str | None:
        """Why `more` workers per pool cannot start on a cluster tandem started itself (not
        enough memory or GPUs left on this machine), or None. A joined cluster may grow (its
        autoscaler): there, workers Ray cannot place fail their start at the deadline."""
        if self.deploy.address is not None:
            return None
        count = sum(more.values())
        if self.engine.device.startswith("cuda"):
            ranks = sum(n * self.tensor_parallel(pool) for pool, n in more.items())
            wanted = ranks * self.deploy.gpus_per_worker
            free = ray.available_resources().get("GPU", 0.0)
            if wanted > free + 1e-9:
                return f"{count} more workers need {wanted:g} GPUs and {free:g} are free"
            return None
        needed = self._workers_bytes(more)
        available = _available_memory()
        if available is not None and needed > available:
            return (
                f"{count} more workers need about {needed / 2**30:.1f} GiB (weights, KV cache, "
                f"runtime) and this machine has {available / 2**30:.1f} GiB available"
            )
        return None

    def unplaced(self, workers: dict[str, Any]) -> str | None:
        """Which workers Ray has not placed yet, and what they ask for; None when all are
        placed or Ray cannot say (its state API needs the dashboard)."""
        try:
            from ray.util.state import list_actors

            pending = {
                a.actor_id for a in list_actors(filters=[("state", "=", "PENDING_CREATION")])
            }
        except Exception:  # no state API on this cluster: the start timeout still holds
            return None
        names = sorted(w for w, h in workers.items() if h._actor_id.hex() in pending)
        if not names:
            return None
        asks = {k: v for k, v in self._options(None).items() if k in ("num_cpus", "num_gpus")}
        have = {k: v for k, v in ray.available_resources().items() if "node:" not in k}
        return (
            f"Ray placed no process for {', '.join(names)} within "
            f"{self.deploy.placement_timeout:g}s: each worker asks for {asks} (plus one unit "
            f"of its pool's resource where the cluster has one) and the cluster has {have} "
            "free. Add nodes, lower --prefill-workers / --decode-workers, or raise "
            "--placement-timeout while an autoscaler adds nodes"
        )

    def _check_memory(self) -> None:
        """On this machine every worker holds its own weights (twice on CPUs with AMX: the
        packed copy) and KV cache: the pools must fit in the memory available now."""
        counts = {"prefill": self.deploy.num_prefill, "decode": self.deploy.num_decode}
        if self.deploy.mode == "colocated":
            counts = {"colocated": self.total}
        needed = self._workers_bytes(counts)
        available = _available_memory()
        if available is not None and needed > available:
            raise ConfigError(
                f"{self.total} workers need about {needed / 2**30:.1f} GiB (weights, KV cache, "
                f"runtime) but this machine has {available / 2**30:.1f} GiB available: lower "
                "--prefill-workers / --decode-workers or --kv-cache-memory"
            )

    def _workers_bytes(self, counts: dict[str, int]) -> int:
        """Memory `counts` workers per pool take on this machine (`worker_bytes` each)."""
        return sum(
            n * worker_bytes(replace(self.engine, tensor_parallel_size=self.tensor_parallel(pool)))
            for pool, n in counts.items()
        )

    def _options(self, pool: str | None) -> dict[str, Any]:
        options: dict[str, Any] = {"max_restarts": 0, "num_cpus": self.num_cpus}
        if self.engine.device.startswith("cuda"):
            options["num_gpus"] = self.deploy.gpus_per_worker
        if pool is not None and ray.cluster_resources().get(pool, 0) > 0:
            self._pool_resources.add(pool)
        if pool in self._pool_resources:
            options["resources"] = {pool: 1}
        return options


def worker_bytes(engine: EngineConfig) -> int:
    """A rough upper bound of one CPU worker's memory: weights at the serving dtype (twice,
    for the packed copy, split across its ranks), each rank's KV cache and process."""
    model = ModelConfig.from_pretrained(engine.model)
    on_disk = sum(f.stat().st_size for f in model.path.glob("*.safetensors"))
    weights = on_disk * DTYPE_BYTES[engine.dtype] // 2  # checkpoints are 16-bit as a rule
    kv = engine.kv_cache_memory_bytes
    if engine.num_kv_blocks is not None:
        kv = (
            engine.num_kv_blocks
            * engine.block_size
            * model.num_layers
            * 2
            * (model.num_kv_heads * model.head_dim * DTYPE_BYTES[engine.dtype])
        )
    return 2 * weights + engine.tensor_parallel_size * (kv + WORKER_OVERHEAD_BYTES)


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
