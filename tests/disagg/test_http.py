"""The HTTP app over the disaggregated pools: the official openai client gets the same text as
offline generation, streams, and /metrics shows the KV that moved."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.app import create_app
from coordinator.builder import DeployConfig, build_client
from engine.config import EngineConfig
from engine.llm import LLM
from protocol.sampling import SamplingParams
from tests.support.servers import ServerThread

PROMPT = "tandem moves the KV cache"


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_llama):
    engine = EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=128)
    client = build_client(engine, DeployConfig(threads_per_worker=1, model_name="tiny"))
    thread = ServerThread(create_app(client)).start()  # the app's startup awaits ready()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="float32", block_size=4)


def test_completion_and_stream_match_offline(server, offline) -> None:
    api = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = offline.generate(PROMPT, params)[0].text
    done = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in done.choices] == [expected, expected]
    assert done.usage.completion_tokens == 24
    stream = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected


def transfer_bytes(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        sample.labels["pool"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem:kv_transfer_bytes_total"
    }


def test_metrics_count_the_kv_moved(server, offline) -> None:
    prompt_tokens = len(offline.tokenizer.encode(PROMPT))
    deadline = time.monotonic() + 10  # worker stats refresh every second
    while not (moved := transfer_bytes(server)).get("decode") and time.monotonic() < deadline:
        time.sleep(0.2)
    cfg = offline.engine.model_config
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    # Three requests of the same prompt; the decode worker's prefix cache holds its full blocks
    # after the first, so later requests move only the tokens past them.
    assert moved["prefill"] == moved["decode"] >= prompt_tokens * per_token
    text = httpx.get(server.url + "/metrics", timeout=10).text
    transports = {
        sample.labels["worker"]: sample.labels["transport"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem:kv_transport_info"
    }
    assert transports == {"prefill-0": "gloo", "decode-0": "gloo"}
