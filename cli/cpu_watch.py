"""How much CPU other processes took while we measured: the noise `tandem profile` reports.

Step timings on a CPU host are only as good as the cores are free. Linux counts every core's busy
time (/proc/stat) and this process's own (/proc/self/stat), so the difference over a window is
what everything else ran. Elsewhere (no /proc) nothing is known and the watch reports None.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal, after the "cpu" label
SELF_TIME_FIELDS = (13, 14)  # utime stime of /proc/self/stat (0-based, fields 14 and 15)


class CpuSample(NamedTuple):
    wall: float  # seconds
    busy_ticks: int  # every core's
    own_ticks: int  # this process's, all threads


def sample() -> CpuSample | None:
    try:
        cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # Fields after the ")" that ends the command name start at field 3, hence the offset 2.
    own_ticks = sum(int(own[i - 2]) for i in SELF_TIME_FIELDS)
    return CpuSample(time.monotonic(), sum(int(cpu[i]) for i in BUSY_FIELDS), own_ticks)


def others_cores(start: CpuSample | None, end: CpuSample | None) -> float | None:
    """Cores' worth of CPU other processes used between two samples, on average."""
    if start is None or end is None or end.wall <= start.wall:
        return None
    ticks_per_second = os.sysconf("SC_CLK_TCK")
    others = (end.busy_ticks - start.busy_ticks) - (end.own_ticks - start.own_ticks)
    return max(others, 0) / ticks_per_second / (end.wall - start.wall)
