"""The cores a worker's engine thread steps on, paced by the host's core ledger
(protocol/core_ledger.py): its share among the workers computing right now."""

from __future__ import annotations

import os
from pathlib import Path

from kernels.threads import use_threads
from protocol.core_ledger import CoreLedger, sweep


class CorePacer:
    """An engine thread's `pace` (engine/engine_thread.py): called on that thread at every loop
    turn with whether it has work (and with False as the thread ends), before the step.

    While it has work, the worker is marked busy in the host's ledger, and each step runs on
    `cores` (default: the cores this process may run on) divided among the busy workers,
    never fewer than one."""

    def __init__(self, path: str | os.PathLike, cores: int | None = None) -> None:
        sweep(keep=Path(path))  # this host's ledgers left by deployments long gone
        self.ledger = CoreLedger(path)
        self.cores = cores or host_cores()
        self._pid = os.getpid()
        self._marked = False
        self.current: int | None = None  # the count this pacer set last

    def __call__(self, busy: bool) -> None:
        if busy != self._marked:
            self.ledger.mark(self._pid, busy)
            self._marked = busy
        if not busy:
            return
        wanted = max(1, self.cores // max(1, self.ledger.busy()))
        if wanted != self.current:
            use_threads(wanted)
            self.current = wanted


def host_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
