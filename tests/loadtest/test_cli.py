"""`tandem bench` through the real `tandem` entry point: exit codes and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli import main as cli


@pytest.fixture
def tandem():
    """The real `tandem` entry point."""
    return cli.main


def test_successful_run_exits_zero(tandem, serve, tmp_path: Path, capsys) -> None:
    server = serve(ttft_s=0.01, itl_s=0.005)
    saved = tmp_path / "r.json"
    argv = ["bench", "--base-url", server.url, "--num-prompts", "3", "--random-input-len", "4"]
    argv += ["--random-output-len", "2", "--disable-tqdm", "--result-path", str(saved)]
    assert tandem(argv) == 0
    assert "Successful requests:" + " " * 20 + "3" in capsys.readouterr().out
    assert json.loads(saved.read_text())["completed"] == 3


def test_failure_is_one_line_and_exit_one(tandem, serve, capsys) -> None:
    server = serve()
    argv = ["bench", "--base-url", server.url, "--endpoint", "/v2/nothing", "--num-prompts", "1"]
    assert tandem(argv) == 1
    err = capsys.readouterr().err.strip()
    expected = f"the first request to {server.url}/v2/nothing failed: HTTP 404 Not Found"
    assert err.startswith(f"tandem bench: error: {expected}")
    assert "\n" not in err and "Traceback" not in err


def test_bench_flags_import_neither_cli_nor_coordinator() -> None:
    probe = "import sys, loadtest.cli; print(*sorted(m.split('.')[0] for m in sys.modules))"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=root
    )
    assert result.returncode == 0, result.stderr
    assert {"cli", "coordinator", "torch"}.isdisjoint(result.stdout.split())


def test_bench_error_is_one_line(tandem, capsys) -> None:
    assert tandem(["bench", "--dataset-name", "sharegpt", "--disable-tqdm"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "tandem bench: error: --dataset-name sharegpt needs --dataset-path"


def test_compare_missing_file(tandem, tmp_path: Path, capsys) -> None:
    assert tandem(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"tandem bench: error: result file {tmp_path / 'a.json'} does not exist"
