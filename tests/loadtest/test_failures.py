"""Bad input and failing servers: one clear line each, partial results saved, and a run with
failed requests raises after saving them."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from loadtest.errors import BenchError
from tests.support.bench import bench
from tests.support.fake_server import Failure

SHORT = ("--random-input-len", "4", "--random-output-len", "4", "--num-prompts", "2")


@pytest.fixture
def closed_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def bench_error(url: str, *argv: str) -> str:
    with pytest.raises(BenchError) as err:
        bench(url, *SHORT, *argv)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unreachable_server(closed_url: str) -> None:
    assert bench_error(closed_url).startswith(f"cannot reach {closed_url}/v1/models: ")


def test_a_server_that_accepts_and_never_answers_fails_in_seconds(monkeypatch) -> None:
    """A hung server, or a port another service holds: the setup calls have their own short
    deadline (they waited --request-timeout, 600 s, printing nothing)."""
    import time

    import loadtest.bench

    monkeypatch.setattr(loadtest.bench, "SETUP_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens; never accepts or reads
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        message = bench_error(url)
    assert message.startswith(f"cannot reach {url}/v1/models: ") and "timed out" in message
    assert time.monotonic() - started < 10


def test_unreachable_server_with_model_given(closed_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "no-such-tokenizer"
    message = bench_error(closed_url, "--model", "m", "--tokenizer", str(folder))
    assert message == f"tokenizer folder {folder} does not exist"
    message = bench_error(closed_url, "--model", "m")
    assert message.startswith(f"cannot reach {closed_url}/tokenize")


def test_unloadable_tokenizer_folder(closed_url: str, tmp_path: Path) -> None:
    message = bench_error(closed_url, "--model", "m", "--tokenizer", str(tmp_path))
    assert message.startswith(f"cannot load a tokenizer from {tmp_path}: ")


def test_wrong_endpoint(serve) -> None:
    server = serve()
    message = bench_error(server.url, "--endpoint", "/v1/complete")
    assert (
        message
        == f"the first request to {server.url}/v1/complete failed: HTTP 404 Not Found: Not Found"
    )


def test_wrong_base_path(serve) -> None:
    server = serve()
    message = bench_error(server.url + "/api")
    assert (
        message
        == f"GET {server.url}/api/v1/models returned HTTP 404 Not Found: Not Found; pass --model"
    )


def test_server_without_tokenize(serve) -> None:
    server = serve(serve_tokenize=False)
    message = bench_error(server.url)
    assert message == f"{server.url}/tokenize not found (HTTP 404); pass --tokenizer DIR"


def test_request_timeout(serve) -> None:
    server = serve(ttft_s=0.3)
    message = bench_error(server.url, "--request-timeout", "0.05")
    assert (
        message
        == f"the first request to {server.url}/v1/completions failed: timed out after 0.05 s"
    )


def test_malformed_dataset(serve, tmp_path: Path) -> None:
    server = serve()
    path = tmp_path / "sharegpt.json"
    path.write_text('[{"conversations": [}]')
    message = bench_error(server.url, "--dataset-name", "sharegpt", "--dataset-path", str(path))
    assert message.startswith(f"dataset {path} is not valid JSON: ")


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (Failure.HTTP_500, "HTTP 500 Internal Server Error: scripted failure"),
        (Failure.ERROR_EVENT, "error in the stream: scripted failure"),
        (Failure.CUT_STREAM, "the response was cut off: "),
    ],
)
def test_errors_mid_run_save_partial_results(serve, tmp_path: Path, failure, reason) -> None:
    server = serve(ttft_s=0.01, itl_s=0.005, failure=failure, fail_from=4)  # the probe is 0
    saved = tmp_path / "out" / "result.json"
    argv = ("--num-prompts", "6", "--max-concurrency", "1", "--save-result")
    argv += ("--result-dir", str(saved.parent), "--result-filename", saved.name)
    message = bench_error(server.url, *argv)  # the later --num-prompts wins
    assert message.startswith(f"3 of 6 requests failed (first: {reason}")
    assert message.endswith(f"; results saved to {saved}")
    record = json.loads(saved.read_text())
    assert (record["completed"], record["failed"]) == (3, 3)
    assert record["errors"][:3] == ["", "", ""]
    assert all(error.startswith(reason) for error in record["errors"][3:])
    assert record["output_lens"] == [4, 4, 4, 0, 0, 0]
    assert record["total_output_tokens"] == 12


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--goodput", "ttft=5"),
            "--goodput 'ttft=5': expected KEY:MS with KEY one of ttft, tpot, e2el",
        ),
        (("--goodput", "tpot:fast"), "--goodput 'tpot:fast': 'fast' is not a number"),
        (
            ("--metric-percentiles", "50,0"),
            "--metric-percentiles '50,0': '0' must be a positive number",
        ),
        (
            ("--sweep", "rate=1,2"),
            "--sweep 'rate=1,2': expected NAME=V1,V2,... with NAME one of request-rate, "
            "max-concurrency",
        ),
        (
            ("--sweep", "max-concurrency=1.5"),
            "--sweep 'max-concurrency=1.5': concurrencies must be whole numbers",
        ),
        (("--request-rate", "0"), "--request-rate must be > 0"),
        (("--random-range-ratio", "1"), "--random-range-ratio must be in [0, 1)"),
        (("--dataset-name", "sharegpt"), "--dataset-name sharegpt needs --dataset-path"),
        (("--endpoint", "v1/completions"), "--endpoint must start with '/', got 'v1/completions'"),
    ],
)
def test_bad_flags(closed_url: str, argv: tuple[str, ...], message: str) -> None:
    assert bench_error(closed_url, *argv) == message
