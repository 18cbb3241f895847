"""The reaper: a watchdog process that ends every process `tandem serve` started (its Ray
cluster: gcs, raylet, agents, workers) if `tandem serve` itself dies without stopping them, by
SIGKILL for instance. Ray's gcs and raylet share the driver's fate, but its agents outlive it.

    serve ──pipe──> reaper (own session)      every 0.5-4 s: the serve process's descendants
    serve dies -> pipe closes -> reaper SIGKILLs the last descendants it saw (same start times);
    a scan that overlapped the death is dropped for the one before it

Run as `python -m coordinator.reaper PID` with stdin the read end of a pipe the serve process
holds open; `start_reaper()` does that. Linux only (/proc); elsewhere it is not started.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

SCAN_S = 0.5
# Each scan reads every process's stat on the host (~1.7 ms). The set changes when workers start
# or leave, and the agents that would outlive the serve process are there from Ray's start, so
# a scan that finds what the last one found doubles the wait for the next, up to this.
MAX_SCAN_S = 4.0


def start_reaper() -> subprocess.Popen | None:
    """Starts the reaper for this process; None where /proc is missing."""
    if not Path("/proc/self/stat").exists():
        return None
    read_end, write_end = os.pipe()
    reaper = subprocess.Popen(
        [sys.executable, "-m", "coordinator.reaper", str(os.getpid())],
        stdin=read_end,
        start_new_session=True,  # a signal to the serve process group does not reach it
    )
    os.close(read_end)
    os.set_inheritable(write_end, False)  # only this process holds it: its death closes it
    _held.append(write_end)
    return reaper


_held: list[int] = []  # the write end, open for the life of the process


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of `root`: pid -> its start time (from /proc/PID/stat). Plain
    os calls and bytes: a scan reads every process's stat twice a second beside a busy engine
    (pathlib and text decoding made it 4 ms, ~1% of a core)."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            pid = int(name)
            children.setdefault(int(fields[1]), []).append(pid)
            started[pid] = fields[19].decode()
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid == os.getpid():  # the reaper itself
            continue
        found[pid] = started[pid]
        todo.extend(children.get(pid, []))
    return found


def reap(seen: dict[int, str]) -> None:
    """SIGKILL to each process still running with the start time it had when seen."""
    alive = {}
    for pid in seen:
        with contextlib.suppress(OSError, IndexError):
            alive[pid] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    for pid, start in seen.items():
        if alive.get(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def last_scan(
    serve_pid: int, pipe: int, scan: Callable[[int], dict[int, str]] = descendants
) -> dict[int, str]:
    """Scans `serve_pid`'s descendants every SCAN_S (backing off to MAX_SCAN_S while nothing
    changes) until it dies; returns the last scan taken while it was surely alive. A scan that
    overlaps the death may have missed children already handed to init, so it is dropped: the
    kernel closes a dying process's files (our pipe) before it hands its children on, so a pipe
    at end of file after the scan says so."""
    seen: dict[int, str] = {}
    wait_s = SCAN_S
    while not _died(serve_pid, pipe, wait_s):
        current = scan(serve_pid)
        if _died(serve_pid, pipe, 0):
            break
        wait_s = min(2 * wait_s, MAX_SCAN_S) if current == seen else SCAN_S
        seen = current
    return seen


def _died(serve_pid: int, pipe: int, wait_s: float) -> bool:
    """True once the pipe is at end of file or the serve process is gone or a zombie (gone
    without closing the pipe: a forked child could still hold it)."""
    ready, _, _ = select.select([pipe], [], [], wait_s)
    if ready and not os.read(pipe, 1):
        return True
    try:
        state = Path(f"/proc/{serve_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the server, not for us
    reap(last_scan(int(sys.argv[1]), sys.stdin.fileno()))
