"""The HTTP API's fixtures: in-process servers per test module (tests.support.servers), and the
long-context checkpoint whose requests run long enough to be watched."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator.api.app import create_app
from coordinator.api.settings import ServerSettings
from engine.local_client import LocalEngineClient
from tests.support.servers import ServerThread


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
