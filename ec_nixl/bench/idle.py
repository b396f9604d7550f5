"""What the endpoint pair costs in CPU: idle after the handshake, and under load (issue 12).

CPU seconds per wall second of each bench process, all its threads (ec-nixl's I/O thread, NIXL's
progress thread, UCX's, Python's), read from psutil when installed, else from /proc/<pid>/stat.
1.0 = one core busy all the time. Idle is a window after both sides handshook and moved their
first item, with nothing published, held or in flight; under load is the ours-* cases.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from ec_nixl.bench import optional


def cpu_reader() -> tuple[Optional[Callable[[int], float]], str]:
    """(function pid -> CPU seconds of the process so far, its source), or (None, why not)."""
    psutil, _ = optional.load("psutil")
    if psutil is not None:
        def read(pid: int) -> float:
            t = psutil.Process(pid).cpu_times()
            return t.user + t.system

        return read, "psutil"
    if os.path.exists(f"/proc/{os.getpid()}/stat"):
        tick = os.sysconf("SC_CLK_TCK")

        def read_proc(pid: int) -> float:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces: cut after it
            return (int(fields[11]) + int(fields[12])) / tick  # utime + stime, all threads

        return read_proc, "/proc"
    return None, "no psutil and no /proc on this host"


class CpuMeter:
    """Accumulates CPU and wall seconds of some processes over one or more measured stretches."""

    def __init__(self, pids: dict[str, int], read: Callable[[int], float]):
        self.pids, self.read = pids, read
        self.cpu = {k: 0.0 for k in pids}
        self.wall = 0.0
        self._start: Optional[tuple[float, dict]] = None

    def start(self) -> None:
        self._start = (time.monotonic(), {k: self.read(p) for k, p in self.pids.items()})

    def stop(self) -> None:
        t0, c0 = self._start
        c1 = {k: self.read(p) for k, p in self.pids.items()}
        self.wall += time.monotonic() - t0
        for k in self.pids:
            self.cpu[k] += c1[k] - c0[k]
        self._start = None

    def cores(self) -> dict[str, float]:
        """CPU seconds per wall second of each process over everything measured so far."""
        return {k: (v / self.wall if self.wall > 0 else float("nan")) for k, v in self.cpu.items()}


def idle_window(pids: dict[str, int], seconds: float, read: Callable[[int], float]) -> dict:
    """Sleep ``seconds`` (the caller's own thread costs nothing) and measure the processes meanwhile."""
    meter = CpuMeter(pids, read)
    meter.start()
    time.sleep(seconds)
    meter.stop()
    return {"wall_s": meter.wall, "cores": meter.cores()}
