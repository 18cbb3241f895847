"""Tensor-parallel follower ranks as Ray actors, one per bundle of the worker's placement group.

The WorkerActor (rank 0) owns them: Ray ends an actor's children when it dies, so a worker's
ranks never outlive it, and the builder removes the placement group when the worker is retired.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.tensor_parallel import FollowerSpec, Launcher, follow
from worker.rank_roles import RankRoles

log = logging.getLogger(__name__)


class RankActor:
    """Runs `follow` on a thread; the process exits once it returns or fails, so a broken
    rank is a dead actor, never a silent one."""

    def __init__(self, spec: FollowerSpec) -> None:
        threading.Thread(target=self._run, args=(spec,), daemon=True, name="tandem-rank").start()

    def _run(self, spec: FollowerSpec) -> None:
        try:
            follow(spec)
        except BaseException:
            log.exception("tensor-parallel rank %d failed", spec.rank)
        os._exit(0)


def ray_launcher(
    placement_group: Any, bundle_resources: dict[str, float], num_threads: int
) -> Launcher:
    """Places rank r on bundle r of `placement_group` (bundle 0 holds rank 0, the caller),
    its ops on `num_threads` cores. The launch returns the actor's handle: Ray ends an actor
    whose handles are all dropped."""

    def launch(spec: FollowerSpec) -> Any:
        return (
            ray.remote(RankActor)
            .options(
                max_restarts=0,
                num_cpus=bundle_resources.get("CPU", 0.0),
                num_gpus=bundle_resources.get("GPU", 0.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=spec.rank
                ),
            )
            .remote(spec._replace(hooks=RankRoles, num_threads=num_threads))
        )

    return launch
