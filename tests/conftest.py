"""Shared fixtures: tiny offline checkpoints (built once per session) and the default model."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
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
EXIT_STATUS = pytest.StashKey[int]()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With TANDEM_FAILURE_LOG set, each failure's traceback is appended to that file as it
    happens: a run killed at its deadline (a GPU call) still says why its tests failed."""
    if FAILURE_LOG and report.failed:
        with open(FAILURE_LOG, "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int):  # noqa: ANN201
    """Around every other plugin's session end (the terminal summary among them): the status
    is kept only when all of them returned, so a hook that fails or calls pytest.exit keeps
    pytest's own way out (and its exit status)."""
    result = yield
    session.config.stash[EXIT_STATUS] = int(session.exitstatus)
    return result


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Ends the suite's process without interpreter finalization, every report written. The
    suite leaves daemon threads behind (Ray's, gloo's, UCX's, KV senders and receivers of the
    pools it ran in this process); finalization ends each at its next GIL request, which, when
    that is inside torch freeing a tensor, unwinds C++ frames that may not throw, and Ray's
    terminate handler aborts the process (exit 134 after every test had passed, seen on CI).
    Engine threads have their own exit hook (engine/engine_thread.py); this covers the rest."""
    status = config.stash.get(EXIT_STATUS, None)
    if status is None or os.environ.get("TANDEM_FINALIZE") == "1":
        return  # not a whole session (a plugin run, say), or asked to finalize as usual
    left = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    if left:
        print(f"\n{len(left)} threads still running at exit: {', '.join(left[:12])}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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
