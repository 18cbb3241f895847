"""Per-thread torch thread counts that stay put, and one OpenMP team per process.

OpenMP keeps a thread count per calling thread, and `torch.set_num_threads(n)` sets the caller's.
But `at::parallel_for` also initialises each thread lazily, on its first call, by re-applying
whichever count any thread set last (one process-wide value). So an engine thread that sets 2
and runs its first op after a KV receiver thread set 1 silently runs on one core for good. Each
library built apart from libtorch (our C++ kernels) keeps its own copy of that per-thread flag.
`use_threads` runs every copy's initialisation first, then sets the count, so nothing another
thread sets later overrides it.

libgomp gives every thread that opens a parallel region a team of helper threads of its own.
When two threads hold teams at once and their threads outnumber the cores, every parallel region
pays for it: on 2 cores, a decode step of short ops ran 1.45x slower than with one team
(docs/performance.md, "One OpenMP team per process"). So the engine thread should be the only
thread that runs parallel ops: a worker loads its model on a thread kept at one, and after
`use_threads(n > 1)` every thread that never set a count starts on one.
"""

from __future__ import annotations

import threading

import torch

from kernels import cpu_extension


def use_threads(count: int) -> None:
    """The calling thread's ops use `count` threads from now on, whatever other threads set."""
    torch.get_num_threads()  # libtorch's lazy per-thread initialisation, done now
    native = cpu_extension.loaded()  # CPU workers load it before their engine thread starts
    if native is not None:
        native.init_threads()  # the C++ kernels' copy of it
    torch.set_num_threads(count)
    if count != 1:
        _others_start_on_one()


def _others_start_on_one() -> None:
    """Sets torch's process-wide count, the one a thread's first op adopts, back to one: a
    thread that never asked (a sender copying a tensor, an asyncio helper) then opens no
    OpenMP team of its own. Done on a throwaway thread, whose own count does not matter."""
    reset = threading.Thread(target=torch.set_num_threads, args=(1,), name="tandem-threads")
    reset.start()
    reset.join()
