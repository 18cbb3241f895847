"""`tandem profile --address`: the step sweep on a worker node of a Ray cluster, the profile
saved on the machine that asked.

On a `ray up` cluster `tandem serve` runs on a head without GPUs and reads the step profile (the
planner's and cost routing's prices) from the head's model folder, while the steps it prices
run on the GPU nodes. So the sweep runs in one Ray actor placed as a worker of the pool would be
(the GPUs of one worker, one unit of the pool's resource), finds the model at the same path
there (`worker.actor.local_model`), and hands its measurements back; the fit and the file are
made here. Finding the node and the sweep each have a deadline: a node the autoscaler must
start first takes minutes, and a sweep on a large model many more.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from cli.errors import CliError
from cli.profile_sweep import StepSweep, SweepSettings, measure_steps

logger = logging.getLogger(__name__)


class Placement(NamedTuple):
    address: str  # the Ray cluster ("auto" on its head)
    pool: str | None  # "prefill" or "decode": a node offering that Ray resource; None: any
    placement_timeout: float  # seconds to find (or start) such a node
    sweep_timeout: float  # seconds the sweep may take once placed


class SweepActor:
    """Lives on the chosen node for one sweep."""

    def where(self) -> str:
        return socket.gethostname()

    def sweep(self, folder: str, settings: SweepSettings) -> StepSweep:
        from worker.actor import local_model

        path = local_model(folder, socket.gethostname())
        return measure_steps(path, settings, log=lambda line: logger.info("profile: %s", line))


def sweep(
    placement: Placement, folder: Path, settings: SweepSettings, log: Callable[[str], None]
) -> StepSweep:
    """Runs the sweep on a node of the cluster at `placement.address` and returns it."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    from coordinator.builder import cluster_device, connect_ray

    connect_ray(placement.address)
    settings = settings._replace(device=cluster_device(settings.device, placement.address))
    options = actor_options(placement.pool, settings)
    wanted = {"GPU": options["num_gpus"], **options.get("resources", {})}
    asks = ", ".join(f"{amount:g} {name}" for name, amount in wanted.items() if amount > 0)
    actor = ray.remote(SweepActor).options(**options).remote()
    try:
        try:
            host = ray.get(actor.where.remote(), timeout=placement.placement_timeout)
        except RayActorError as err:
            raise CliError(f"the sweep's process could not start: {err}") from None
        except GetTimeoutError:
            raise CliError(
                f"no node of the cluster could take the sweep ({asks or 'nothing asked'}) within "
                f"{placement.placement_timeout:g} s: check `ray status`, or raise "
                "--placement-timeout while the autoscaler adds a node"
            ) from None
        log(f"sweeping on {host} ({settings.device}, tensor parallel {settings.tensor_parallel})")
        try:
            return ray.get(
                actor.sweep.remote(str(folder), settings), timeout=placement.sweep_timeout
            )
        except GetTimeoutError:
            raise CliError(
                f"the sweep on {host} took over {placement.sweep_timeout:g} s "
                "(--sweep-timeout); its node's Ray logs say how far it got"
            ) from None
        except RayTaskError as err:
            raise CliError(f"the sweep on {host} failed: {_cause(err)}") from None
        except RayActorError as err:
            raise CliError(f"the sweep's process on {host} died: {err}") from None
    finally:
        ray.kill(actor)


def actor_options(pool: str | None, settings: SweepSettings) -> dict[str, Any]:
    """What the sweep asks of the cluster: one worker's share of it, in `pool` if named."""
    gpus = settings.tensor_parallel if settings.device.startswith("cuda") else 0
    options: dict[str, Any] = {"num_cpus": 1, "num_gpus": gpus, "max_restarts": 0}
    if pool is not None:
        options["resources"] = {pool: 1}  # as a worker of the pool asks (on its first rank)
    return options


def _cause(err: Exception) -> str:
    """The exception raised inside the actor, not Ray's wrapping of it with a traceback."""
    cause = getattr(err, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(err)
