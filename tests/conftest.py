"""Shared fixtures: tiny offline checkpoints (built once per session) and the default model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernel tests run in Triton's interpreter. The flag is read when a kernel
# is decorated, including triton's own library functions on its first import, and transformers
# imports triton (through torch._dynamo) below: so it is set here, first. Only Triton code reads
# it, and the CPU tests run none but ours.
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.checkpoints import build_checkpoint  # noqa: E402

FAILURE_LOG = os.environ.get("TANDEM_FAILURE_LOG")  # deploy/gpu_run.sh sets it


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With TANDEM_FAILURE_LOG set, each failure's traceback is appended to that file as it
    happens: a run killed at its deadline (a GPU call) still says why its tests failed."""
    if FAILURE_LOG and report.failed:
        with open(FAILURE_LOG, "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Path] = {}

    def get(family: str, **overrides: object) -> Path:
        key = family + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
        if key not in built:
            folder = tmp_path_factory.mktemp(key.replace("=", "_"))
            built[key] = build_checkpoint(folder, family, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama(checkpoints) -> Path:
    return checkpoints("llama")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from engine.fetch import fetch_default_model

    return fetch_default_model()
