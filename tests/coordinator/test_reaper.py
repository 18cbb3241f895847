"""The reaper ends what a process started once that process dies by SIGKILL (no Ray here: a
parent that starts the reaper and a grandchild of its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PARENT = """
import subprocess, sys, time
from coordinator.reaper import start_reaper
start_reaper()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_process_takes_its_children_with_it() -> None:
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=root
    )
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # the reaper has scanned the parent's descendants at least once
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)
        # Its work done, the reaper itself exits.
        deadline = time.monotonic() + 10
        while reapers_of(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reapers_of(parent.pid) == []
    finally:
        parent.kill()
        parent.wait(10)


def reapers_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"coordinator.reaper" in cmdline and str(pid).encode() in cmdline:
                found.append(int(entry.name))
    return found


def test_a_scan_that_overlaps_the_death_is_dropped_for_the_one_before() -> None:
    from coordinator.reaper import last_scan

    read_end, write_end = os.pipe()
    scans = [{101: "7", 102: "8"}, {101: "7", 102: "8"}]

    def scan(_pid: int) -> dict[int, str]:
        if len(scans) == 0:  # the serve process dies mid-scan: its children already gone
            os.close(write_end)
            return {}
        return scans.pop()

    try:
        assert last_scan(os.getpid(), read_end, scan) == {101: "7", 102: "8"}
    finally:
        os.close(read_end)


def test_scans_back_off_while_nothing_changes_and_return_to_the_start_on_a_change(
    monkeypatch,
) -> None:
    from coordinator import reaper

    scans = [{1: "a"}] * 5 + [{1: "a", 2: "b"}] * 2
    waits: list[float] = []

    def died(_pid: int, _pipe: int, wait_s: float) -> bool:
        if wait_s == 0:  # the check right after a scan
            return False
        waits.append(wait_s)
        return not scans

    monkeypatch.setattr(reaper, "_died", died)
    last = reaper.last_scan(1, -1, scan=lambda _pid: scans.pop(0))
    assert last == {1: "a", 2: "b"}
    assert waits == [0.5, 0.5, 1.0, 2.0, 4.0, 4.0, 0.5, 1.0]
