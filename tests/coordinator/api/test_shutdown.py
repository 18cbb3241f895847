"""Draining on SIGINT/SIGTERM: new requests get 503 while requests in flight finish (or are
cancelled when the grace period ends); then the backend is shut down. And a request that fails
after its stream began ends with an error chunk and [DONE]."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from coordinator.api.app import create_app
from coordinator.api.server import (
    CANCEL_AFTER_DRAIN_S,
    DrainingServer,
    StartupInterrupted,
    interrupt,
)
from tests.support.servers import ServerThread, local_client, wait_until
from tests.support.wrapped_clients import FailingClient, GatedClient, SlowClient

STREAM = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
          "stream": True}  # fmt: skip


def draining_server(client, grace_s: float) -> ServerThread:
    app = create_app(client)
    admission = app.state.tandem.admission
    return ServerThread(
        app,
        lambda config: DrainingServer(config, admission, grace_s),
        timeout_graceful_shutdown=CANCEL_AFTER_DRAIN_S,
    ).start()


def data_of(body: str) -> list[str]:
    return [frame.removeprefix("data: ") for frame in body.split("\n\n") if frame]


def test_drain_finishes_requests_in_flight_and_refuses_new_ones(tiny_llama) -> None:
    client = GatedClient(local_client(tiny_llama))
    server = draining_server(client, grace_s=30)
    http = httpx.Client(base_url=server.url, timeout=30)
    with http, http.stream("POST", "/v1/completions", json=STREAM) as in_flight:
        assert in_flight.status_code == 200
        server.server.handle_exit(signal.SIGTERM, None)
        refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert http.get("/ready").status_code == 503
        assert http.get("/health").status_code == 200
        assert server.thread.is_alive()  # still draining
        client.gate.set()
        frames = data_of(in_flight.read().decode())
    assert frames[-1] == "[DONE]"
    assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "length"
    server.thread.join(timeout=10)
    assert not server.thread.is_alive()
    assert client.shut_down.is_set()


def test_grace_period_end_cancels_what_is_left(tiny_llama) -> None:
    client = GatedClient(local_client(tiny_llama))
    server = draining_server(client, grace_s=0.3)
    http = httpx.Client(base_url=server.url, timeout=30)
    with http, http.stream("POST", "/v1/completions", json=STREAM) as stuck:
        server.server.handle_exit(signal.SIGINT, None)
        with pytest.raises(httpx.HTTPError):  # the connection closes mid-stream
            stuck.read()
    server.thread.join(timeout=10)
    assert not server.thread.is_alive() and client.shut_down.is_set()


def test_grace_period_end_ends_streams_with_an_error_event(tiny_llama) -> None:
    """A stream still producing when the grace ends gets an error event saying why, then
    [DONE], instead of a connection cut mid-body; its engine request is aborted."""
    client = SlowClient(local_client(tiny_llama), delay_s=0.25)
    server = draining_server(client, grace_s=0.3)
    http = httpx.Client(base_url=server.url, timeout=30)
    long = {**STREAM, "max_tokens": 200}
    with http, http.stream("POST", "/v1/completions", json=long) as running:
        assert running.status_code == 200
        server.server.handle_exit(signal.SIGTERM, None)
        frames = data_of(running.read().decode())
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "engine_unavailable" and "grace period ended" in error["message"]
    assert len(frames) - 2 < 200  # not every token
    server.thread.join(timeout=10)
    assert not server.thread.is_alive() and client.shut_down.is_set()


@pytest.fixture(scope="module")
def failing(serve, tiny_llama):
    return serve(FailingClient(local_client(tiny_llama), fail_after=2))


def test_failure_mid_stream_ends_with_an_error_chunk_then_done(failing) -> None:
    with httpx.stream("POST", failing.url + "/v1/completions", json=STREAM) as response:
        assert response.status_code == 200
        frames = data_of(response.read().decode())
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "service_unavailable" and "decode worker lost" in error["message"]
    assert all("choices" in json.loads(frame) for frame in frames[:-2])
    assert wait_until(lambda: failing.app.state.tandem.client.stats()[0].num_running == 0, 1.0)


def test_failure_without_streaming_is_a_plain_503(failing) -> None:
    body = {key: value for key, value in STREAM.items() if key != "stream"}
    response = httpx.post(failing.url + "/v1/completions", json=body)
    assert response.status_code == 503
    assert "decode worker lost" in response.json()["error"]["message"]


def test_a_started_server_freezes_its_startup_objects(tiny_llama) -> None:
    import gc

    gc.unfreeze()  # an earlier server in this process may have frozen some already
    server = draining_server(local_client(tiny_llama), grace_s=0.3)
    try:
        # right after `started`: the tokenizer, the app's models, the engine
        assert wait_until(lambda: gc.get_freeze_count() > 10_000, timeout=10)
    finally:
        server.server.handle_exit(signal.SIGTERM, None)
        server.thread.join(timeout=10)


def test_a_signal_while_starting_is_not_swallowed_by_a_library() -> None:
    """Ray's actor creation runs inspect.getfullargspec, which turns any Exception raised
    inside it into TypeError('unsupported callable'): a SIGTERM landing there must still stop
    the start, not fail it as an error."""
    import inspect

    class ActorMethod:
        def __call__(self) -> None: ...

        @property
        def __signature__(self) -> inspect.Signature:
            interrupt(signal.SIGTERM, None)  # the signal arrives while Ray inspects it
            return inspect.Signature()

    with pytest.raises(StartupInterrupted, match="SIGTERM"):
        inspect.getfullargspec(ActorMethod())
