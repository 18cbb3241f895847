"""tandem's C++ CPU ops (kernels/csrc), compiled on first use and cached per machine.

A CPU decode step of a small model dispatches over a thousand tiny torch ops and copies K/V out
of the paged cache for attention; these kernels replace op chains with one pass and read the
cache in place. Compilation takes about a minute once (the
build lands in torch's extension cache); where no compiler is available the torch references
are used instead, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in ("module.cpp", "decode_attention.cpp", "norm_rope.cpp", "cache_mlp.cpp")
]


# fast-math for vectorized exp (glibc's vector math); no FMA contraction, so element-wise ops
# round exactly as the torch references do. -fopenmp at compile time only: at::parallel_for then
# runs on the OpenMP runtime torch has loaded (linking a runtime of our own made the two spin
# against each other).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-ffp-contract=off"]


def build_name() -> str:
    """Named after the sources' content: two checkouts of the same code share one build, and
    checkouts of different code never rebuild over each other (and wait on each other's lock)."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    return f"tandem_cpu_ops_{digest.hexdigest()[:12]}"


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here."""
    if os.environ.get("TANDEM_KERNELS") == "reference":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        return build(name=build_name(), sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS)
    except Exception as err:  # no compiler, no ninja, a build error: fall back, loudly
        log.warning("tandem CPU kernels unavailable, using torch references: %s", err)
        return None
