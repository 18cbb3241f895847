"""An in-process server per test module: uvicorn in a background thread on 127.0.0.1, serving
the real colocated engine on a tiny random checkpoint (float32, KV blocks of 4 tokens)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from coordinator.api.app import create_app
from coordinator.api.context import ServerSettings
from engine.config import EngineConfig
from engine.local_client import LocalEngineClient

START_TIMEOUT_S = 30.0
NUM_KV_BLOCKS = 256
# A request of LONG_TOKENS takes seconds on the long-context model: long enough that it is still
# running whenever a test looks.
LONG_TOKENS = 4000
LONG_NUM_KV_BLOCKS = 1100  # of 4 tokens: room for one LONG_TOKENS request


class ServerThread:
    """Serves `app` on an OS-assigned port until stop()."""

    def __init__(
        self,
        app: FastAPI,
        server_class: Callable[[uvicorn.Config], uvicorn.Server] = uvicorn.Server,
        **config_options: object,
    ) -> None:
        self.app = app
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", **config_options)
        self.server = server_class(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self._sock.close()


def local_client(model: Path, **engine_options: object) -> LocalEngineClient:
    options = {"dtype": "float32", "block_size": 4, "num_kv_blocks": NUM_KV_BLOCKS}
    options.update(engine_options)
    return LocalEngineClient.from_config(EngineConfig(model=model, **options), "tiny")


@pytest.fixture(scope="session")
def long_llama(checkpoints) -> Path:
    return checkpoints("llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., ServerThread]]:
    """serve(client, settings) starts a server for this module; all stop at its end."""
    servers: list[ServerThread] = []

    def start(client: LocalEngineClient, settings: ServerSettings | None = None) -> ServerThread:
        servers.append(ServerThread(create_app(client, settings)).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()
