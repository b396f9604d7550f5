"""Every path the bench times, one module per family, and the producer-side stage of each.

=================  ==========================================================================
``ours``           ours-read, ours-write, staged-write, publish-landed, expect-landed, expect-write
                   (ec-nixl's API),
                   landed barrier
``raw_nixl``       raw-nixl-read, raw-nixl-write: plain NIXL between the same processes (floor)
``reference``      reference-copy (CUDA-IPC copy / cross-process memcpy), copy bandwidth
``host_bounce``    ECCPUConnector-style D2H + NIXL DRAM READ + H2D (GPU runs only)
``file``           ECExampleConnector-style safetensors save/load (needs safetensors)
``ucx``            raw UCX tag send/recv through ucxx (needs ucxx)
=================  ==========================================================================

Modules import only the standard library at the top, so listing the paths is cheap.
"""

from __future__ import annotations

from ec_nixl.bench.paths import file, host_bounce, ours, raw_nixl, reference, ucx
from ec_nixl.bench.paths.base import Path, Skip

PATHS: dict[str, type[Path]] = {
    p.name: p
    for p in (ours.OursRead, ours.OursWrite, raw_nixl.RawNixlRead, raw_nixl.RawNixlWrite, reference.ReferenceCopy,
              host_bounce.HostBounce, file.File, ours.StagedWrite, ours.PublishLanded,
              ours.ExpectLanded, ours.ExpectWrite, ucx.Ucx)
}
ALL_PATHS = tuple(PATHS)  # also the order of rows within a size in the report

# Paths outside ec-nixl (third-party, or plain NIXL) whose failure at run time, not only a missing
# import, never sinks the run: reported as skipped with the error, the other paths go on.
FRAGILE = ("ucx", "raw-nixl-read", "raw-nixl-write")

# How the producer makes the items of each kind: (prod, tag, nbytes, shape, dtype, per_op)
#   -> (descriptors or file paths, head/tail probes, producer-side stage seconds).
STAGERS = {
    "ours": ours.stage_in_place,
    "staged": ours.stage_copy,
    "bounce": host_bounce.stage,
    "file": file.stage,
}

__all__ = ["ALL_PATHS", "FRAGILE", "PATHS", "STAGERS", "Path", "Skip"]
