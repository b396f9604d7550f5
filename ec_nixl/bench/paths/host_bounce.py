"""``host-bounce``: ECCPUConnector's data path, for comparison (GPU runs only).

The producer copies the output D2H into pinned, NIXL-registered DRAM (its stage, timed on its
clock), the consumer READs it host to host with ec-nixl's own CPU endpoints and copies it H2D +
synchronize (timed on its clock); the sample is the sum, the two halves run back to back as on
the critical path of one item. On a CPU run it would be ours-read plus two host memcpys: skipped.
"""

from __future__ import annotations

import time

from ec_nixl.bench.memory import as_u8, check, probe
from ec_nixl.bench.paths.base import Skip
from ec_nixl.bench.paths.ours import OursRead


class HostBounce(OursRead):
    name = "host-bounce"
    ep_key, kind, hold, addr_key = "host", "bounce", True, "host_address"

    def __init__(self, c, spec, per_op):
        if not c.cuda:
            raise Skip("CPU run: degenerates to ours-read plus two host memcpys (run with --device cuda)")
        super().__init__(c, spec, per_op)

    def op(self, payload) -> float:
        import torch

        c, n = self.c, self.spec.nbytes
        refs, probes, stage = payload
        dsts = [c.dst_region(n) for _ in refs]
        t0 = time.perf_counter()
        tickets = c.eps["host"].load(refs)
        out = c.barriers["host"].wait(tickets, timeout=60)
        for r, do in zip(refs, dsts):
            c.dst[do : do + n].copy_(as_u8(out[r.mm_hash]), non_blocking=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        c.eps["host"].progress()  # the end of the step: settle (read-done frees the producer's copy), untimed
        for t in tickets:
            t.release()
        for r, do, p in zip(refs, dsts, probes):
            check(c.dst[do : do + n], p, f"host-bounce {r.mm_hash}")
        return dt + stage


def stage(prod, tag: str, nbytes: int, shape, tdt, per_op: int) -> tuple:
    """D2H into pinned, NIXL-registered DRAM slots of the producer's host endpoint (timed)."""
    import torch

    srcs = [(prod.new_hash(tag), prod.src_region(nbytes)) for _ in range(per_op)]
    slots = [prod.reserve(prod.host, nbytes, h) for h, _ in srcs]
    t0 = time.perf_counter()
    for slot, (_, s) in zip(slots, srcs):
        slot.bytes()[:nbytes].copy_(s, non_blocking=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    descs = [prod.host.publish_slot(h, slot, shape, tdt) for slot, (h, _) in zip(slots, srcs)]
    return descs, [probe(s) for _, s in srcs], dt
