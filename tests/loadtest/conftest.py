"""Fixtures for the load-test tests: scripted fake servers, stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.fake_server import FakeServer, Script


@pytest.fixture
def serve() -> Iterator[Callable[..., FakeServer]]:
    servers: list[FakeServer] = []

    def start(**script: object) -> FakeServer:
        server = FakeServer(Script(**script)).start()  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
