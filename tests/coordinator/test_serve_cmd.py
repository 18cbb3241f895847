"""`tandem serve`: its flags, the backend they build, and a real process that drains and exits 0
on SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from coordinator.cli import build_parser
from coordinator.serve_cmd import deploy_config, engine_config, parse_size

FLAGS = [
    "--model", "--served-model-name", "--host", "--port", "--address", "--mode",
    "--prefill-workers", "--decode-workers", "--dtype", "--device", "--block-size",
    "--kv-cache-memory", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
    "--local-prefill-threshold", "--kv-transport", "--api-key", "--max-queue",
    "--shutdown-grace", "--prefix-caching", "--seed", "--log-level",
]  # fmt: skip
START_TIMEOUT_S = 120


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_help_lists_every_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        serve_args("--help")
    text = capsys.readouterr().out
    assert [flag for flag in FLAGS if flag not in text] == []


def test_defaults() -> None:
    args = serve_args()
    assert (args.host, args.port, args.mode) == ("127.0.0.1", 8000, "disaggregated")
    assert (args.prefill_workers, args.decode_workers) == (1, 1)
    assert args.kv_cache_memory == 2**30


@pytest.mark.parametrize(
    "text,size",
    [
        ("1GiB", 2**30),
        ("512MiB", 512 * 2**20),
        ("2G", 2 * 10**9),
        ("1000", 1000),
        ("1.5Gi", 3 * 2**29),
    ],  # fmt: skip
)
def test_sizes(text, size) -> None:
    assert parse_size(text) == size


def test_bad_size_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit):
        serve_args("--kv-cache-memory", "lots")
    assert "512MiB" in capsys.readouterr().err


def test_flags_become_the_engine_and_deploy_configs(tiny_llama) -> None:
    args = serve_args(
        "--model", str(tiny_llama), "--served-model-name", "mine", "--dtype", "float32",
        "--block-size", "8", "--kv-cache-memory", "1MiB", "--max-num-seqs", "3",
        "--max-model-len", "256", "--no-prefix-caching", "--mode", "colocated",
        "--prefill-workers", "2", "--decode-workers", "3", "--kv-transport", "gloo",
        "--kv-transfer-timeout", "9", "--local-prefill-threshold", "64",
    )  # fmt: skip
    config = engine_config(args)
    assert (config.block_size, config.max_num_seqs, config.dtype) == (8, 3, "float32")
    assert config.kv_cache_memory_bytes == 2**20 and not config.enable_prefix_caching
    assert config.max_model_len == 256
    deploy = deploy_config(args)
    assert (deploy.mode, deploy.num_prefill, deploy.num_decode) == ("colocated", 2, 3)
    assert (deploy.kv_transport, deploy.transfer_timeout) == ("gloo", 9.0)
    assert (deploy.local_prefill_threshold, deploy.model_name) == (64, "mine")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_process_serves_then_exits_0_on_signal(tiny_llama, sig) -> None:
    port = free_port()
    command = [
        sys.executable, "-m", "coordinator.cli", "serve", "--model", str(tiny_llama),
        "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "16MiB",
        "--mode", "colocated", "--log-level", "warning",
    ]  # fmt: skip
    # Its own session: if the test fails, the server and the Ray cluster it started go together.
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(url + "/health"):
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        usage = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["usage"]
        assert usage["completion_tokens"] == 3
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
