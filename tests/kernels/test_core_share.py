"""Workers sharing a host's cores: the ledger they mark (protocol/core_ledger.py) and the pacer
that sets an engine thread's cores from it (kernels/core_share.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.engine_thread import EngineThread
from kernels.core_share import CorePacer
from protocol.core_ledger import (
    PREFIX,
    SLOTS,
    STALE_AFTER_S,
    CoreLedger,
    ledger_dir,
    new_ledger,
    sweep,
)


@pytest.fixture
def sleeper():
    """A live process that is not this one (its pid goes into the ledger)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait(10)


def on_a_thread(fn):
    """fn() on a fresh thread (torch thread counts are per thread); its result."""
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join(30)
    return out[0]


def test_the_ledger_counts_live_busy_processes(tmp_path, sleeper) -> None:
    ledger = CoreLedger(tmp_path / "ledger")
    assert ledger.busy() == 0
    ledger.mark(os.getpid(), True)
    ledger.mark(sleeper.pid, True)
    assert ledger.busy() == 2
    ledger.mark(os.getpid(), False)
    assert ledger.busy() == 1
    sleeper.kill()
    sleeper.wait(10)
    assert ledger.busy() == 0  # a dead process holds no cores, whatever its slot says


def test_processes_whose_pids_collide_modulo_the_slots_count_apart(tmp_path) -> None:
    """Each process claims a slot of its own: pids equal modulo SLOTS (one in 64 pairs) once
    shared a slot and counted as one busy worker."""
    twin, others = None, []
    try:
        for _ in range(1000):  # bounded: each spawn is a fresh pid, one in SLOTS collides
            child = subprocess.Popen(["sleep", "60"])
            if child.pid % SLOTS == os.getpid() % SLOTS:
                twin = child
                break
            others.append(child)
            if len(others) > 20:  # never hold many at once
                stop_all(others)
        assert twin is not None, "no colliding pid in 1000 spawns"
        ledger = CoreLedger(tmp_path / "ledger")
        ledger.mark(os.getpid(), True)
        ledger.mark(twin.pid, True)
        assert ledger.busy() == 2
        ledger.mark(twin.pid, False)
        assert ledger.busy() == 1
    finally:
        stop_all(others + ([twin] if twin else []))


def test_a_dead_processs_slot_is_taken_over(tmp_path, sleeper) -> None:
    ledger = CoreLedger(tmp_path / "ledger")
    ledger.mark(sleeper.pid, True)
    sleeper.kill()
    sleeper.wait(10)
    fresh = CoreLedger(tmp_path / "ledger")
    assert fresh.claim(os.getpid()) == ledger.claim(sleeper.pid)  # the only slot used so far
    fresh.mark(os.getpid(), True)
    assert fresh.busy() == 1


def stop_all(children: list[subprocess.Popen]) -> None:
    for child in children:
        child.kill()
        child.wait(10)
    children.clear()


def test_a_mark_in_one_process_is_seen_in_another(tmp_path) -> None:
    path = tmp_path / "ledger"
    ledger = CoreLedger(path)
    code = (
        "import os, sys; from protocol.core_ledger import CoreLedger; "
        f"CoreLedger({str(path)!r}).mark(os.getpid(), True); print('marked', flush=True); "
        "sys.stdin.readline()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "marked"
        assert ledger.busy() == 1
    finally:
        child.communicate("\n", timeout=30)
    assert ledger.busy() == 0


def test_sweep_removes_only_ledgers_nobody_here_uses() -> None:
    """A ledger is named after the serving process, whose pid means nothing on a worker's host:
    what keeps one is a live holder on this host (or its creator, alive here), and youth (its
    first worker may not have claimed a slot yet)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    gone = int(done.stdout)  # a pid no process of this host has now: a foreign or dead creator
    dead = ledger_dir() / f"{PREFIX}{gone}-deadbeef"  # old, no live holder
    held = ledger_dir() / f"{PREFIX}{gone}-0ccupied"  # old, this process holds a slot
    young = ledger_dir() / f"{PREFIX}{gone}-y0ung000"  # just made, nobody in it yet
    mine = new_ledger()  # its creator (this process) is alive
    paths = (dead, held, young, mine)
    try:
        for path in paths:
            CoreLedger(path)
        CoreLedger(held).mark(os.getpid(), False)
        long_ago = time.time() - 10 * STALE_AFTER_S
        for path in (dead, held, mine):
            os.utime(path, (long_ago, long_ago))
        removed = sweep()  # (other stale ledgers of this machine may go too)
        assert dead in removed and not {held, young, mine} & set(removed)
        assert [p.exists() for p in paths] == [False, True, True, True]
        os.utime(young, (long_ago, long_ago))
        assert young not in sweep(keep=young) and young.exists()
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


def test_the_pacer_steps_on_a_share_of_the_busy_workers(tmp_path, sleeper) -> None:
    pacer = CorePacer(tmp_path / "ledger", cores=4)

    def counts() -> list[int]:
        seen = []
        pacer(True)  # alone: every core
        seen.append(torch.get_num_threads())
        pacer.ledger.mark(sleeper.pid, True)  # another worker starts computing
        pacer(True)
        seen.append(torch.get_num_threads())
        pacer.ledger.mark(sleeper.pid, False)
        pacer(True)
        seen.append(torch.get_num_threads())
        pacer(False)  # idle: its mark goes
        return seen

    assert on_a_thread(counts) == [4, 2, 4]
    assert pacer.ledger.busy() == 0


def test_the_pacer_never_goes_below_one_core(tmp_path, sleeper) -> None:
    pacer = CorePacer(tmp_path / "ledger", cores=1)
    pacer.ledger.mark(sleeper.pid, True)
    assert on_a_thread(lambda: (pacer(True), torch.get_num_threads())[1]) == 1


def test_the_engine_thread_paces_each_step_and_clears_its_mark_when_it_ends(tmp_path) -> None:
    calls: list[bool] = []
    pacer = CorePacer(tmp_path / "ledger", cores=2)
    marked_while_stepping: list[int] = []

    def step() -> None:
        marked_while_stepping.append(pacer.ledger.busy())

    def pace(busy: bool) -> None:
        calls.append(busy)
        pacer(busy)

    engine = EngineThread(
        "paced",
        step,
        has_work=lambda: len(marked_while_stepping) < 3,
        on_crash=lambda err: None,
        pace=pace,
    )
    for _ in range(200):  # 10 s at most
        if len(marked_while_stepping) == 3:
            break
        time.sleep(0.05)
    engine.stop()
    assert marked_while_stepping == [1, 1, 1]
    assert calls[:3] == [True, True, True] and calls[-1] is False
    assert pacer.ledger.busy() == 0
