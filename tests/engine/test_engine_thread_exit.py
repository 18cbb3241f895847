"""A process that exits while an engine thread steps exits cleanly (engine/engine_thread.py's
exit hook): without it, the interpreter ends the daemon thread inside torch's C++ code as it
frees a tensor, and Ray's terminate handler turns that into an abort (exit 134: six runs of six
with the hook unregistered, the child's "without-hook" mode)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys, time
import ray  # its C++ terminate handler is what turns the unwinding exit into an abort
import torch
import engine.engine_thread as engine_thread
if sys.argv[1] == "without-hook":
    import atexit
    atexit.unregister(engine_thread._stop_at_exit)

class Batch:
    def __init__(self):
        self.tensors = [torch.ones(256) for _ in range(200)]

steps = []
def step():
    steps.append(Batch())
    steps.pop()

engine_thread.EngineThread("busy", step, has_work=lambda: True, on_crash=print)
time.sleep(0.3)
"""


def exit_code(mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=ROOT, env=env,
                          capture_output=True, timeout=120, check=False)  # fmt: skip
    return done.returncode


def test_exiting_while_an_engine_thread_steps_is_clean() -> None:
    assert exit_code("with-hook") == 0


def test_stop_says_so_when_a_step_outlasts_its_deadline() -> None:
    """A worker switching roles stops its engine thread and hands the engine to another: with
    the step still running, that would be two threads on one block manager. So stop raises."""
    import threading
    import time

    from engine.engine_thread import EngineThread

    in_step, release = threading.Event(), threading.Event()

    def step() -> None:
        in_step.set()
        release.wait(5)

    thread = EngineThread("slow", step, has_work=lambda: not release.is_set(), on_crash=print)
    assert in_step.wait(5)
    started = time.monotonic()
    try:
        thread.stop(timeout=0.2)
    except TimeoutError as err:
        assert "still in a step after 0.2s" in str(err)
    else:
        raise AssertionError("stop returned while the step ran")
    assert 0.2 <= time.monotonic() - started < 2
    assert thread.submit(lambda: None).exception() is not None  # stopped for callers anyway
    release.set()
    thread.stop(timeout=5)  # the step ended: it stops
