"""A host's core ledger: which worker processes sharing its cores are computing right now.

On a host with fewer cores than its workers would each like (a laptop, a CI box, one CPU server
running 1P1D), a prefill worker and a decode worker that both step on every core preempt each
other: every parallel region then waits for a descheduled thread. Split the cores for good and
each idles half of them while the other waits for work. So each worker marks itself busy in
this ledger while it has work, and steps on its share of the cores among the busy ones
(kernels/core_share.py): all of them while the other is idle, half while both compute.

The ledger is a file of SLOTS 64-bit slots (under /dev/shm where there is one), one per worker
process (its pid modulo SLOTS), holding the pid while busy and 0 while idle. Aligned 64-bit
stores and loads are single instructions, so a reader never sees half a slot; a slot whose
process has died counts as idle. Two workers whose pids collide modulo SLOTS share a slot and
count as one, which costs speed, never correctness.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import uuid
from pathlib import Path

SLOTS = 64
PREFIX = "tandem-cores-"


def ledger_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def new_ledger() -> Path:
    """A fresh ledger's path, named after this process so that a later one can tell whether
    its creator is still alive (`sweep`). The workers create the file when they first open it."""
    return ledger_dir() / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def sweep() -> list[Path]:
    """Removes ledgers whose creating process has died (a server killed with SIGKILL leaves
    its ledger behind); returns them."""
    removed = []
    for path in ledger_dir().glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError, PermissionError):  # gone, or not ours
                path.unlink()
                removed.append(path)
    return removed


class CoreLedger:
    def __init__(self, path: str | os.PathLike) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < SLOTS * 8:
                os.ftruncate(fd, SLOTS * 8)  # new bytes read as zeros: every slot idle
            self._map = mmap.mmap(fd, SLOTS * 8)
        finally:
            os.close(fd)
        self._slots = memoryview(self._map).cast("q")

    def mark(self, pid: int, busy: bool) -> None:
        """Process `pid` computes (or not) until it says otherwise."""
        self._slots[pid % SLOTS] = pid if busy else 0

    def busy(self) -> int:
        """How many live processes are marked busy."""
        return sum(1 for pid in self._slots.tolist() if pid and _alive(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
