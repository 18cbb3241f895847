"""A `tandem serve` child process for tests and benchmarks: started in a session of its own, so
the server, its Ray cluster and its workers form one process group that can be killed whole;
ready when `/health` answers (the app takes requests only once its workers are up)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

HOST = "127.0.0.1"
POLL_S = 0.25


class ServeError(Exception):
    """The server exited or stayed silent while starting."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class ServeProcess:
    """`tandem serve ARGS --host 127.0.0.1 --port PORT`, all its output (stdout, and stderr where
    it logs) in `log_path`; `env` is added to this process's environment.

    The one way tests and benchmarks start a server process. Use it as a context manager:
    leaving the block kills the whole process group if anything is still running, whatever
    happened inside."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "cli.main", "serve", *args]
        command += ["--host", HOST, "--port", str(self.port)]
        environment = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,
            )

    def wait_healthy(self, timeout_s: float) -> None:
        """Returns once GET /health answers 200; ServeError when the process exits first or
        `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None:
                raise ServeError(f"tandem serve exited with {self.process.returncode}: {self.log}")
            if time.monotonic() > deadline:
                raise ServeError(f"tandem serve not healthy after {timeout_s:g} s: {self.log}")
            time.sleep(POLL_S)

    def send_signal(self, sig: signal.Signals) -> None:
        """`sig` to the server alone (it stops the Ray processes it started itself); nothing
        once it has exited."""
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None if the server still runs after `timeout_s`."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float, sig: signal.Signals = signal.SIGINT) -> int | None:
        """`sig` (SIGINT or SIGTERM: drain, then a clean exit), then wait(timeout_s); the
        context manager's exit kills a server that is still running."""
        self.send_signal(sig)
        return self.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL to the whole group: the server and the Ray processes it started."""
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    @property
    def output(self) -> str:
        """Everything the server has written so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    @property
    def log(self) -> str:
        """The end of output (its last 4000 characters), for error messages."""
        return self.output[-4000:]

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.kill()
