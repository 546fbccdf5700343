"""How busy the machine is while a bench times: the load average and ``others_share``, the cores
processes outside the bench's job kept busy (``bench layer`` and ``bench step`` report both)."""
from __future__ import annotations

import os
import time
from typing import Optional


def loadavg() -> Optional[list[float]]:
    try:
        with open("/proc/loadavg") as f:
            return [float(v) for v in f.read().split()[:3]]
    except OSError:
        return None


def cpu_seconds() -> Optional[tuple[float, float, float]]:
    """(CPU seconds busy on the machine, CPU seconds of this process, wall seconds)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.perf_counter()


def others_share(before, after, ranks) -> Optional[float]:
    """Mean number of cores processes outside this job kept busy while we were timing (0: a
    quiet machine), from two ``cpu_seconds()``. The job's CPU time is summed over its ranks (all
    on this machine) by ``ranks.reduce(values, "sum")``."""
    if before is None or after is None:
        return None
    wall = after[2] - before[2]
    job = ranks.reduce([after[1] - before[1]], "sum")[0]
    return round(max(0.0, (after[0] - before[0]) - job) / wall, 2) if wall > 0 else None
