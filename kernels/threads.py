"""Per-thread torch thread counts that stay put.

OpenMP keeps a thread count per calling thread, and `torch.set_num_threads(n)` sets the caller's.
But `at::parallel_for` also initialises each thread lazily, on its first call, by re-applying
whichever count any thread set last (one process-wide value). So an engine thread that sets 2
and runs its first op after a KV receiver thread set 1 silently runs on one core for good. Each
library built apart from libtorch (our C++ kernels) keeps its own copy of that per-thread flag.
`use_threads` runs every copy's initialisation first, then sets the count, so nothing another
thread sets later overrides it.
"""

from __future__ import annotations

import torch

from kernels import cpu_extension


def use_threads(count: int) -> None:
    """The calling thread's ops use `count` threads from now on, whatever other threads set."""
    torch.get_num_threads()  # libtorch's lazy per-thread initialisation, done now
    native = cpu_extension.loaded()  # CPU workers load it before their engine thread starts
    if native is not None:
        native.init_threads()  # the C++ kernels' copy of it
    torch.set_num_threads(count)
