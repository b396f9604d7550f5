"""``file``: ECExampleConnector's data path, for comparison.

The producer saves the output with safetensors to /dev/shm (``tensor.cpu()`` + ``save_file``;
its stage, timed on its clock), the consumer ``load_file``s it onto its device (timed on its
clock); the sample is the sum. Without safetensors the path is skipped: any other format would
time something ECExampleConnector does not do.
"""

from __future__ import annotations

import os
import time

from ec_nixl.bench import optional
from ec_nixl.bench.memory import as_u8, check, probe, sync
from ec_nixl.bench.paths.base import Path, Skip


class File(Path):
    name = "file"

    def __init__(self, c, spec, per_op):
        self.st, why = optional.load("safetensors.torch")
        if self.st is None:
            raise Skip(why)
        super().__init__(c, spec, per_op)

    def prepare(self, k: int) -> list:
        return self.c.rpc("items", "file", self.tag, self.spec_tuple(), k, self.per_op)

    def op(self, payload) -> float:
        paths, probes, stage = payload
        dev = "cuda:0" if self.c.cuda else "cpu"
        t0 = time.perf_counter()
        outs = [self.st.load_file(p, device=dev)["ec_cache"] for p in paths]
        sync(dev)
        dt = time.perf_counter() - t0
        for p, t, pr in zip(paths, outs, probes):
            check(as_u8(t), pr, f"file {os.path.basename(p)}")
            os.unlink(p)
        return dt + stage


def stage(prod, tag: str, nbytes: int, shape, tdt, per_op: int) -> tuple:
    """``tensor.cpu()`` -> ``safetensors.save_file`` into the bench's /dev/shm folder (timed)."""
    st, why = optional.load("safetensors.torch")
    if st is None:
        raise Skip(why)
    srcs = [(prod.new_hash(tag), prod.src_region(nbytes)) for _ in range(per_op)]
    paths = [os.path.join(prod.tmpdir, f"{h}.safetensors") for h, _ in srcs]
    t0 = time.perf_counter()
    for p, (_, s) in zip(paths, srcs):
        st.save_file({"ec_cache": s.view(tdt).view(shape).detach().cpu()}, p)
    dt = time.perf_counter() - t0
    prod.files.extend(paths)
    return paths, [probe(s) for _, s in srcs], dt
