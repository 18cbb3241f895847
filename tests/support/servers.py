"""An in-process server: uvicorn in a background thread on 127.0.0.1 serving an app built in the
test's own process, usually over the real colocated engine on a tiny random checkpoint (float32,
KV blocks of 4 tokens). A `tandem serve` child process is loadtest.serve_process.ServeProcess."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from engine.config import EngineConfig
from engine.local_client import LocalEngineClient

START_TIMEOUT_S = 30.0
POLL_S = 0.01
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
        # IPPROTO_TCP named explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets
        # whose proto says TCP, and with Nagle on every keep-alive response waits ~40 ms for
        # the client's delayed ACK.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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
    """The colocated engine on `model`, served as "tiny"; `engine_options` override the test
    defaults (float32, blocks of 4 tokens, NUM_KV_BLOCKS of them)."""
    options = {"dtype": "float32", "block_size": 4, "num_kv_blocks": NUM_KV_BLOCKS}
    options.update(engine_options)
    return LocalEngineClient.from_config(EngineConfig(model=model, **options), "tiny")


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Polls `condition` until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(POLL_S)
    return condition()


async def wait_until_async(condition: Callable[[], bool], timeout: float) -> bool:
    """wait_until for a coroutine: sleeps without blocking its event loop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(POLL_S)
    return condition()
