"""A host's core ledger: which worker processes sharing its cores are computing right now.

On a host with fewer cores than its workers would each like (a laptop, a CI box, one CPU server
running 1P1D), a prefill worker and a decode worker that both step on every core preempt each
other: every parallel region then waits for a descheduled thread. Split the cores for good and
each idles half of them while the other waits for work. So each worker marks itself busy in
this ledger while it has work, and steps on its share of the cores among the busy ones
(kernels/core_share.py): all of them while the other is idle, half while both compute.

The ledger is a file of SLOTS 64-bit slots (under /dev/shm where there is one). A worker
claims a slot of its own once, under a file lock (`claim`), and from then on stores its pid
there while busy and minus its pid while idle: aligned 64-bit stores and loads are single
instructions, so a reader never sees half a slot and the hot path takes no lock. A slot whose
process has died counts as idle, and a later claim may take it over. Past SLOTS live workers a
worker gets no slot and counts as idle, which costs speed, never correctness.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
import time
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


STALE_AFTER_S = 60.0  # a ledger younger than this may be waiting for its first worker's claim


def sweep(keep: Path | None = None) -> list[Path]:
    """Removes this host's ledgers that nobody uses any more (a server or worker killed with
    SIGKILL leaves its ledger behind); returns them. Run by the serving process and by each
    worker as it starts, on its own host: a ledger is named after the serving process, whose
    pid means nothing on another host, so what counts is who holds its slots here. One goes
    when no live process of this host holds a slot, its creator is not alive here, and it is
    older than STALE_AFTER_S. `keep`: a ledger about to be used, never removed."""
    removed = []
    for path in ledger_dir().glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("-")[0]
        if path == keep or not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError, ValueError, OSError):
            if time.time() - path.stat().st_mtime < STALE_AFTER_S or _held(path):
                continue
            path.unlink()  # (gone already, or not ours: suppressed)
            removed.append(path)
    return removed


def _held(path: Path) -> bool:
    """Some live process of this host holds a slot of the ledger at `path`."""
    data = path.read_bytes()[: SLOTS * 8]
    slots = memoryview(data.ljust(SLOTS * 8, b"\0")).cast("q")
    return any(held and _alive(abs(held)) for held in slots.tolist())


class CoreLedger:
    def __init__(self, path: str | os.PathLike) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size < SLOTS * 8:
            os.ftruncate(self._fd, SLOTS * 8)  # new bytes read as zeros: every slot free
        self._map = mmap.mmap(self._fd, SLOTS * 8)
        self._slots = memoryview(self._map).cast("q")
        self._claimed: dict[int, int | None] = {}  # pid -> its slot (None: the ledger was full)

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self._fd)

    def claim(self, pid: int) -> int | None:
        """A slot for process `pid` alone (idle to start with): one that is free, already its
        own, or left by a dead process. None when SLOTS live processes hold them all."""
        if pid in self._claimed:
            return self._claimed[pid]
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # claims are rare; marks never lock
        try:
            holders = [abs(held) for held in self._slots.tolist()]
            if pid in holders:
                slot: int | None = holders.index(pid)
            else:  # liveness checked lazily: a syscall per held slot passed over
                slot = next((i for i, h in enumerate(holders) if not h or not _alive(h)), None)
            if slot is not None:
                self._slots[slot] = -pid
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._claimed[pid] = slot
        return slot

    def mark(self, pid: int, busy: bool) -> None:
        """Process `pid` computes (or not) until it says otherwise."""
        slot = self.claim(pid)
        if slot is not None:
            self._slots[slot] = pid if busy else -pid

    def busy(self) -> int:
        """How many live processes are marked busy."""
        return sum(1 for pid in self._slots.tolist() if pid > 0 and _alive(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
