"""One Ray cluster for the whole session (starting one costs seconds), and pools built on it."""

from __future__ import annotations

import os

import pytest

from engine.llm import LLM
from protocol.sampling import SamplingParams
from tests.support.loop import LoopThread
from tests.support.prompts import mixed_prompts


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    from coordinator.builder import connect_ray

    if ray.is_initialized():  # started by an earlier test (ray.kill auto-starts one): too small
        ray.shutdown()
    connect_ray(None, num_cpus=32)  # logical CPUs: room for several pools at once
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def build_pool(ray_cluster, loop):
    """build_pool(checkpoint, mode=..., num_prefill=..., num_decode=..., **engine options)."""
    from coordinator.builder import DeployConfig, build_client
    from engine.config import EngineConfig

    built = []

    def build(checkpoint, engine_options=None, **deploy_options):
        engine_options = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 256,
                          **(engine_options or {})}  # fmt: skip
        deploy = DeployConfig(**{"threads_per_worker": 1, **deploy_options})
        client = build_client(EngineConfig(checkpoint, **engine_options), deploy)
        loop.run(client.ready(), timeout=300)
        built.append(client)
        return client

    def stop_all() -> None:
        """Stops every pool built so far: frees the cluster's room for a test that needs it."""
        while built:
            client = built.pop()
            loop.run(client.shutdown())
            for worker in (*client.prefill.values(), *client.decode.values()):
                ray_cluster.kill(worker)

    build.stop_all = stop_all
    yield build
    stop_all()


@pytest.fixture(autouse=True)
def _pools_end_with_their_test(request):
    """Each test's pools stop when it ends: left running, they filled the session cluster's 32
    CPUs (and ~15 GiB of worker processes), and a later test's workers waited for room."""
    yield
    if "build_pool" in request.fixturenames:
        request.getfixturevalue("build_pool").stop_all()


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_llama) -> list[list[int]]:
    vocab = LLM(tiny_llama, dtype="float32").engine.model_config.vocab_size
    return mixed_prompts(vocab, count=6, seed=5)


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts) -> list[list[int]]:
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    return [out.token_ids for out in llm.generate_ids(prompts, GREEDY)]
