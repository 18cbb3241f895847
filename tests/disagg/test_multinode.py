"""Three Ray nodes on one machine (`ray start`): workers land on the nodes advertising their
pool's resource, and a request crosses them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from engine.llm import LLM
from protocol.sampling import SamplingParams

RAY = Path(sys.executable).with_name("ray")
pytestmark = pytest.mark.skipif(not RAY.exists(), reason="the ray CLI is not installed")
STARTED = b"Ray runtime started."  # what `ray start` prints once its node is up
DRIVER_TIMEOUT = 320  # seconds; the driver gives up on its own (with a stack dump) before this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayNodes:
    """`ray start --block` nodes in their own process groups, so stopping them cannot touch
    any other Ray cluster on the machine (unlike `ray stop`). Each node's output goes to a log
    file in `logs`, quoted when something fails."""

    def __init__(self, env: dict, logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, name: str, *args: str) -> None:
        command = [str(RAY), "start", "--block", "--disable-usage-stats", *args]
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(command, env=self.env, start_new_session=True,
                                    stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        self.procs.append((proc, log))
        self.wait_started(proc, log, timeout=90)

    def wait_started(self, proc: subprocess.Popen, log: Path, timeout: float) -> None:
        """Until `ray start` reports its node up. Nodes start one after another: on a busy
        machine, nodes starting together (or before the head is done) can run past the 30 s Ray
        gives a raylet to register, and joining a cluster whose head is not up retries forever."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if STARTED in log.read_bytes():
                return
            if proc.poll() is not None:
                raise AssertionError(f"{log.stem} exited ({proc.returncode}):\n{self.tail()}")
            time.sleep(0.5)
        raise AssertionError(f"{log.stem} not started after {timeout} s:\n{self.tail()}")

    def tail(self, chars: int = 2000) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}"
                         for _, log in self.procs)  # fmt: skip

    def stop(self) -> None:
        for proc, _ in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)


def test_workers_land_on_their_pool_nodes(tiny_llama, tmp_path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    # On SIGTERM a node first asks the GCS to drain it, for up to 30 s; stopping all three at
    # once, the GCS is gone and each would wait out the 30 s: no draining.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_ADDRESS", None)
    # Ray's sockets live under the temp dir, and an AF_UNIX path may not exceed 107 bytes:
    # pytest's tmp_path is too long (the head would fail to start), so a short one in /tmp.
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    nodes = RayNodes(env, tmp_path)
    try:
        # Ray resolves 127.0.0.1 to the machine's address, so all three nodes share that IP.
        nodes.start("head", "--head", f"--port={port}", "--num-cpus=1",
                    "--include-dashboard=false", "--node-ip-address=127.0.0.1",
                    f"--temp-dir={temp_dir}")  # fmt: skip
        for pool in ("prefill", "decode"):
            nodes.start(pool, f"--address={address}", "--num-cpus=2",
                        f"--resources={json.dumps({pool: 1})}")  # fmt: skip
        driver = Path(__file__).with_name("multinode_driver.py")
        try:
            done = subprocess.run(
                [sys.executable, str(driver), address, str(tiny_llama)],
                env={**env, "PYTHONPATH": str(Path(__file__).parents[2])},
                capture_output=True, text=True, timeout=DRIVER_TIMEOUT,
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
            message = f"driver timed out:\n{(stderr or '')[-3000:]}\n{nodes.tail()}"
            raise AssertionError(message) from e
        assert done.returncode == 0, f"{done.stderr[-3000:]}\n{nodes.tail()}"
        report = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        nodes.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert report["placed"] == {"prefill-0": ["prefill"], "decode-0": ["decode"]}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(tiny_llama, dtype="float32", block_size=4)
    assert report["tokens"] == llm.generate_ids([list(range(3, 30))], params)[0].token_ids
