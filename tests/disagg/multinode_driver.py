"""Run by test_multinode in its own process: joins the cluster at argv[1], builds a 1P1D pool,
serves one request, prints JSON with where each worker landed and what it generated.

Every wait is bounded; past DEADLINE the process dumps every thread's stack and exits."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import sys
import time

import ray

from coordinator.builder import DeployConfig, build_client, connect_ray
from engine.config import EngineConfig
from protocol.sampling import SamplingParams

DEADLINE = 280  # seconds, below the test's timeout for this process
POOLS = ("prefill", "decode")


def wait_for_pools(timeout: float) -> None:
    """Until a live node advertises each pool's resource: placement reads the cluster's
    resources once, when the workers are created."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(ray.cluster_resources().get(pool, 0) > 0 for pool in POOLS):
            return
        time.sleep(0.5)
    raise TimeoutError(f"no node with the {POOLS} resources after {timeout} s: {ray.nodes()}")


async def main(address: str, checkpoint: str) -> dict:
    connect_ray(address)
    wait_for_pools(timeout=60)
    engine = EngineConfig(checkpoint, dtype="float32", block_size=4, num_kv_blocks=64)
    client = build_client(engine, DeployConfig(address=address, threads_per_worker=1))
    await asyncio.wait_for(client.ready(), timeout=120)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def generate():
        final = None
        async for output in client.generate(list(range(3, 30)), params, "multi"):
            final = output
        return final

    final = await asyncio.wait_for(generate(), timeout=90)
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    placed = {}
    for worker_id, handle in {**client.prefill, **client.decode}.items():
        node = await asyncio.wait_for(handle.node_id.remote(), timeout=10)
        placed[worker_id] = sorted(k for k in nodes[node] if k in POOLS)
    await asyncio.wait_for(client.shutdown(), timeout=20)
    return {"tokens": final.token_ids, "placed": placed}


if __name__ == "__main__":
    faulthandler.dump_traceback_later(DEADLINE, exit=True)
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
