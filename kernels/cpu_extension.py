"""tandem's C++ CPU ops (kernels/csrc), compiled on first use and cached per machine.

A CPU decode step of a small model dispatches over a thousand tiny torch ops and copies K/V out
of the paged cache for attention; these kernels replace op chains with one pass and read the
cache in place. Compilation takes about a minute once (the
build lands in torch's extension cache); where no compiler is available the torch references
are used instead, with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "module.cpp",
        "decode_attention.cpp",
        "norm_rope.cpp",
        "cache_mlp.cpp",
        "linear_amx.cpp",
        "linear_bf16.cpp",
        "argmax.cpp",
    )
]
HEADERS = [Path(__file__).parent / "csrc" / "shared_queue.h"]  # copied beside the sources


# fast-math for vectorized exp (glibc's vector math); no FMA contraction, so element-wise ops
# round exactly as the torch references do. -fopenmp at compile time only: at::parallel_for then
# runs on the OpenMP runtime torch has loaded (linking a runtime of our own made the two spin
# against each other).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-ffp-contract=off"]


def build_name() -> str:
    """Named after the sources' content and the environment: checkouts of the same code in one
    environment share a build, and different code never rebuilds over another's build."""
    # The environment counts too: another venv compiles against other torch headers, and
    # another CPU model gets other instructions from -march=native (a home folder shared over
    # NFS by nodes of two CPU generations must not load one's build on the other: SIGILL).
    digest = hashlib.sha256(" ".join([*CFLAGS, sys.prefix, cpu_identity()]).encode())
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    return f"tandem_cpu_ops_{digest.hexdigest()[:12]}"


@functools.cache
def cpu_identity() -> str:
    """What -march=native compiles for: the machine type and the CPU's feature flags."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, Arm
                flags = line.partition(":")[2].strip()
                break
    return f"{platform.machine()} {flags}"


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here."""
    if os.environ.get("TANDEM_KERNELS") == "reference":
        return None
    try:
        return _build()
    except Exception as err:  # no compiler, no ninja, a build error: fall back, loudly
        log.warning("tandem CPU kernels unavailable, using torch references: %s", err)
        return None


def loaded() -> ModuleType | None:
    """The module if `load()` has already run and succeeded; never starts a build."""
    return load() if load.cache_info().currsize else None


def _build() -> ModuleType:
    """Builds (or loads the cached build) from copies of the sources in the build directory,
    so every checkout of the same code uses the same paths and shares one build.

    torch's builder guards a build with a lock file that a killed build leaves behind, and
    every later load then waits for it forever. Our own flock goes first: the kernel drops it
    when its holder dies, and whoever holds it knows a leftover lock file is stale."""
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as build

    name = build_name()
    folder = Path(_get_build_directory(name, verbose=False))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "tandem.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        sources = []
        for source in [*SOURCES, *HEADERS]:
            copy = folder / "src" / source.name
            if not copy.exists() or copy.read_bytes() != source.read_bytes():
                copy.parent.mkdir(exist_ok=True)
                shutil.copyfile(source, copy)
            if source in SOURCES:
                sources.append(str(copy))
        return build(name=name, sources=sources, extra_cflags=CFLAGS, build_directory=str(folder))
