"""Per-thread torch thread counts that stay put.

OpenMP keeps a thread count per calling thread, and `torch.set_num_threads(n)` sets the caller's.
But ATen also initialises each thread lazily, on its first parallel op, by re-applying whichever
count any thread set last (one process-wide value). So an engine thread that sets 2 and then
runs its first op after a KV receiver thread set 1 silently runs on one core for good.
`use_threads` does that first-use initialisation before setting the count, so nothing set
elsewhere later overrides it.
"""

from __future__ import annotations

import torch


def use_threads(count: int) -> None:
    """The calling thread's ops use `count` threads from now on, whatever other threads set."""
    torch.get_num_threads()  # ATen's lazy per-thread initialisation, done now
    torch.set_num_threads(count)
