"""The physical references every ratio is taken against, measured in the same run.

``reference-copy``  the same bytes copied once by the consumer from the producer's own memory: a
                    CUDA-IPC device copy + ``synchronize`` (GPU), or a single-threaded memcpy
                    (``numpy.copyto``) from the /dev/shm mapping the producer wrote (CPU).
``copy_bandwidth``  an in-process D2D copy (GPU, CUDA events) or single-threaded memcpy (CPU) of a
                    whole batch step: the ceiling the batch goal is a fraction of.
"""

from __future__ import annotations

import statistics
import time

from ec_nixl.bench.memory import check, probe
from ec_nixl.bench.paths.base import Path, Skip


class ReferenceCopy(Path):
    name = "reference-copy"

    def __init__(self, c, spec, per_op):
        super().__init__(c, spec, per_op)
        self.chunk = 16
        if c.src is None:
            raise Skip(c.src_note or "no shared source")

    def op(self, payload) -> float:
        c, n = self.c, self.spec.nbytes
        regions = [(c.src_off(n), c.dst_region(n)) for _ in range(self.per_op)]
        if c.cuda:
            import torch

            t0 = time.perf_counter()
            for so, do in regions:
                c.dst[do : do + n].copy_(c.src[so : so + n], non_blocking=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        else:
            import numpy as np

            t0 = time.perf_counter()
            for so, do in regions:
                np.copyto(c.dst_np[do : do + n], c.src[so : so + n])
            dt = time.perf_counter() - t0
        so, do = regions[-1]
        check(c.dst[do : do + n], probe(c.src[so : so + n]), "reference-copy")
        return dt


def copy_bandwidth(cuda: bool, nbytes: int, reps: int = 10) -> dict:
    """In-process device-to-device copy bandwidth (GPU) or single-threaded memcpy (CPU)."""
    ts = []
    if cuda:
        import torch

        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        for i in range(reps + 2):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            b.copy_(a)
            e.record()
            e.synchronize()
            if i >= 2:
                ts.append(s.elapsed_time(e) * 1e-3)
        kind = "torch D2D copy, CUDA events"
    else:
        import numpy as np

        a = np.ones(nbytes, dtype=np.uint8)
        b = np.zeros(nbytes, dtype=np.uint8)
        for i in range(reps + 1):
            t0 = time.perf_counter()
            np.copyto(b, a)
            if i >= 1:
                ts.append(time.perf_counter() - t0)
        kind = "numpy memcpy, one thread"
    del a, b
    med = statistics.median(ts)
    return {"bytes": nbytes, "us": med * 1e6, "gbps": nbytes / med / 1e9, "kind": kind}
