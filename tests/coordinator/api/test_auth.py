"""--api-key: every route but health, readiness and metrics needs the bearer token, and a caller
without it learns nothing else about its request."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from coordinator.api.context import ServerSettings
from tests.support.servers import local_client

KEY = "s3cret-key"
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(serve, tiny_llama):
    return serve(local_client(tiny_llama), ServerSettings(api_key=KEY))


def assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert response.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_missing_or_wrong_key_is_401(server, headers) -> None:
    with httpx.Client(base_url=server.url, headers=headers) as http:
        assert_unauthorized(http.post("/v1/completions", json=COMPLETION))
        assert_unauthorized(http.post("/v1/chat/completions", json={"messages": []}))
        assert_unauthorized(http.get("/v1/models"))
        assert_unauthorized(http.post("/tokenize", json={"prompt": "hi"}))
        # Checked before the body is read: malformed JSON is still a 401.
        json_type = {"content-type": "application/json"}
        assert_unauthorized(http.post("/v1/completions", content=b"{", headers=json_type))


def test_right_key_is_served(server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(server.url + "/v1/completions", json=COMPLETION, headers=headers)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    api = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert api.models.list().data[0].id == "tiny"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_probes_and_metrics_need_no_key(server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


PREFLIGHT = {
    "Origin": "http://localhost:3000",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_a_browsers_preflight_needs_no_key_and_is_allowed(server) -> None:
    # A web UI on another origin: the browser asks first (OPTIONS, no credentials), then sends
    # the request with the key; both answers carry the CORS headers (vLLM allows any origin).
    with httpx.Client(base_url=server.url) as http:
        preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] in ("*", PREFLIGHT["Origin"])
        assert "POST" in preflight.headers["access-control-allow-methods"]
        headers = {"Origin": PREFLIGHT["Origin"], "Authorization": f"Bearer {KEY}"}
        answer = http.post("/v1/completions", json=COMPLETION, headers=headers)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "*"
        assert http.get("/v1/models/tiny", headers=headers).json()["id"] == "tiny"
        assert http.get("/v1/models/gpt-4", headers=headers).status_code == 404


def test_no_origins_means_no_cors(serve, tiny_llama) -> None:
    closed = serve(local_client(tiny_llama), ServerSettings(allowed_origins=()))
    with httpx.Client(base_url=closed.url) as http:
        assert http.options("/v1/chat/completions", headers=PREFLIGHT).status_code == 405
        answer = http.get("/v1/models", headers={"Origin": PREFLIGHT["Origin"]})
        assert "access-control-allow-origin" not in answer.headers


def test_a_streamed_answer_carries_the_cors_headers_and_its_whole_body(server) -> None:
    # The start of an event stream passes the middlewares; its chunks go to the server directly.
    headers = {"Origin": PREFLIGHT["Origin"], "Authorization": f"Bearer {KEY}"}
    body = {**COMPLETION, "stream": True, "max_tokens": 5, "ignore_eos": True}
    url = server.url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers) as answer:
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "*"
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
