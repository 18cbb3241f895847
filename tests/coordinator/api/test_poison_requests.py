"""A bad request fails alone: every input that once took the engine down is refused with a 400
that names the field (or served, where the value is clamped), and the next request succeeds
with the same greedy tokens as before. Also: a request whose sampling raises inside the engine
thread fails by itself while the requests batched with it finish."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from coordinator.api.settings import ServerSettings
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.tokenizer import Tokenizer
from protocol.errors import RequestFailedError
from protocol.sampling import SamplingParams
from tests.support.servers import local_client

GREEDY = {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_llama):
    return local_client(tiny_llama)


@pytest.fixture(scope="module")
def http(serve, client):
    server = serve(client)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def poison_cases(vocab: int) -> list[tuple[str, dict, int, str | None]]:
    """(route, body, expected status, expected error param)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    completion = {"prompt": "hi", "max_tokens": 4}
    return [
        ("completions", {**completion, "min_tokens": 2, "stop_token_ids": [vocab]}, 400,
         "stop_token_ids"),
        ("chat/completions", {**chat, "min_tokens": 2, "stop_token_ids": [vocab]}, 400,
         "stop_token_ids"),
        ("completions", {**completion, "min_tokens": 2, "stop_token_ids": [10**18]}, 400,
         "stop_token_ids"),
        ("chat/completions", {**chat, "min_tokens": 2, "stop_token_ids": [2**64]}, 400,
         "stop_token_ids"),
        ("completions", {**completion, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
        ("completions", {**completion, "seed": 2**64}, 400, "seed"),
        ("completions", {**completion, "seed": -(2**63) - 1}, 400, "seed"),
        # Any signed 64-bit seed (OpenAI's and vLLM's range), read as torch reads it.
        ("completions", {**completion, "temperature": 0.7, "seed": -1, "n": 2}, 200, None),
        # null is "the default" for any field, implemented or not (clients send every field).
        ("completions", {**completion, "n": None, "stream": None, "echo": None,
                         "functions": None}, 200, None),
        ("chat/completions", {**chat, "logprobs": None, "n": None, "modalities": None}, 200,
         None),
        ("completions", {**completion, "prompt": None}, 400, "prompt"),
        ("completions", {**completion, "temperature": 1e-38}, 200, None),
        ("completions", {**completion, "prompt": [vocab]}, 400, "prompt"),
        ("completions", {**completion, "prompt": [[1, 2], [2**63]]}, 400, "prompt"),
        # top_k past the vocabulary means "every token": clamped, served.
        ("completions", {**completion, "temperature": 0.7, "top_k": 2**63}, 200, None),
        ("chat/completions", {**chat, "temperature": 0.7, "top_k": 10**30}, 200, None),
        ("completions", {**completion, "temperature": 0.7, "top_k": -1}, 200, None),
        # distinct stop token ids are capped (each step tests the token against them); the
        # same id repeated is one
        ("completions", {**completion, "stop_token_ids": list(range(1025))}, 400,
         "stop_token_ids"),
        ("completions", {**completion, "min_tokens": 2, "stop_token_ids": [7] * 100_000}, 200,
         None),
        # chat's names in chat's messages, not the engine's
        ("chat/completions", {"messages": chat["messages"], "max_completion_tokens": 0}, 400,
         "max_completion_tokens"),
    ]  # fmt: skip


def test_poison_requests_fail_alone(http, client) -> None:
    vocab = client.engine.model_config.vocab_size
    before = http.post("/v1/completions", json=GREEDY)
    assert before.status_code == 200, before.text
    for route, body, status, param in poison_cases(vocab):
        response = http.post(f"/v1/{route}", json=body)
        assert response.status_code == status, (route, body, response.text)
        if status == 400:
            error = response.json()["error"]
            assert error["param"] == param, (body, error)
            assert param in error["message"], (body, error)  # named as the request names it
            assert error["type"] == "invalid_request_error"
        after = http.post("/v1/completions", json=GREEDY)
        assert after.status_code == 200, (body, after.text)
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert http.get("/ready").status_code == 200


def test_too_many_prompts_are_refused_before_any_is_tokenized(http) -> None:
    """300,000 one-word prompts were tokenized (and given sampling parameters) before their
    count was checked: 12 s of the event loop, every stream on the server held meanwhile."""
    started = time.monotonic()
    reply = http.post("/v1/completions", json={"prompt": ["a"] * 300_000, "max_tokens": 3})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert "300000 prompts" in reply.json()["error"]["message"]
    assert time.monotonic() - started < 3.0


def test_sampling_fault_fails_only_its_request(tiny_llama, monkeypatch) -> None:
    """A test hook raises inside one request's sampling (the row seeded 666): that request
    gets RequestFailedError, the greedy requests in the same batches finish exactly."""
    import engine.engine as engine_module

    real_sample = engine_module.sample

    def faulty_sample(logits, rows):
        if any(row.params.seed == 666 for row in rows):
            raise RuntimeError("injected sampling fault")
        return real_sample(logits, rows)

    core = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", block_size=4))
    tokenizer = Tokenizer(tiny_llama)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    expected = asyncio.run(_run(AsyncEngine(core, tokenizer), prompts, greedy, None))
    monkeypatch.setattr(engine_module, "sample", faulty_sample)
    poisoned = SamplingParams(max_tokens=10, temperature=0.8, seed=666)
    outcomes = asyncio.run(_run(AsyncEngine(core, tokenizer), prompts, greedy, poisoned))
    assert isinstance(outcomes[-1], RequestFailedError)
    assert "injected sampling fault" in str(outcomes[-1])
    assert outcomes[:-1] == expected[:-1]
    assert core.blocks.num_free_blocks == core.num_blocks  # nothing leaked


async def _run(engine: AsyncEngine, prompts, params, poisoned) -> list:
    async def one(prompt, p):
        try:
            return [out async for out in engine.generate(prompt, p)][-1].token_ids
        except RequestFailedError as err:
            return err

    jobs = [one(p, params) for p in prompts]
    jobs.append(one([14, 15, 16], poisoned or params))
    try:
        return await asyncio.gather(*jobs)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def capped(serve, client):
    settings = ServerSettings(max_queue=8, max_prompts=4, max_n=2, max_body_bytes=4096)
    server = serve(client, settings)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def test_fan_out_counts_sequences_and_has_caps(capped) -> None:
    body = {"max_tokens": 2, "temperature": 0}
    too_many = capped.post("/v1/completions", json={**body, "prompt": ["hi"] * 5})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    big_n = capped.post("/v1/completions", json={**body, "prompt": "hi", "n": 3})
    assert big_n.status_code == 400 and big_n.json()["error"]["param"] == "n"
    # 4 prompts x 2 choices = 8 sequences: exactly the queue; one more prompt's worth is not.
    full = capped.post("/v1/completions", json={**body, "prompt": ["hi"] * 4, "n": 2})
    assert full.status_code == 200 and len(full.json()["choices"]) == 8
    assert capped.post("/v1/completions", json={**body, "prompt": "hi"}).status_code == 200


def test_body_size_limit(capped) -> None:
    huge = {"prompt": "a" * 5000, "max_tokens": 1}
    reply = capped.post("/v1/completions", json=huge)
    assert reply.status_code == 413, reply.text
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}

    def chunks():  # no Content-Length: the limit holds while the body streams in
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'", "max_tokens": 1}'

    streamed = capped.post(
        "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert streamed.status_code == 413, streamed.text
    assert capped.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_lone_surrogates_are_a_400(capped) -> None:
    raw = '{"prompt": "a\\ud800b", "max_tokens": 2}'
    headers = {"Content-Type": "application/json"}
    reply = capped.post("/v1/completions", content=raw, headers=headers)
    assert reply.status_code == 400, reply.text
    assert "surrogate" in reply.json()["error"]["message"]
    chat = '{"messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 2}'
    reply = capped.post("/v1/chat/completions", content=chat, headers=headers)
    assert reply.status_code == 400, reply.text
    for stop in ['"\\ud800"', '["ok", "a\\udc00"]']:
        raw = f'{{"prompt": "hi", "max_tokens": 2, "stop": {stop}}}'
        reply = capped.post("/v1/completions", content=raw, headers=headers)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "stop" and "surrogate" in error["message"]
    assert capped.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
