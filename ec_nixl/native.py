"""Native fast paths, each behind a Python fallback: pack a step's items into the arena.

* ``pack(srcs, dst, dst_offsets)`` copies N contiguous tensors' bytes into one ``uint8`` tensor at
  byte offsets. With ``ec_nixl._C`` it is one kernel launch on the current stream (a memcpy loop
  on CPU); the fallback is one ``copy_`` per tensor. ``IMPL`` says which one ``pack`` uses;
  ``pack_native`` / ``pack_python`` are both exposed so benchmarks can compare them.
A device-side load barrier was tried and dropped (bench/RESULTS.md); its probe lives outside
the package, in ``bench/probes/``.

Set ``EC_NIXL_NATIVE=0`` to ignore the extension. This module never initialises CUDA at import.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

_C = None
if os.environ.get("EC_NIXL_NATIVE", "1") != "0":
    try:
        from ec_nixl import _C  # type: ignore[no-redef]
    except ImportError:  # not built (no compiler, no torch at build time): the fallbacks below
        _C = None

IMPL = "native" if _C is not None else "python"
NATIVE_WITH_CUDA = bool(_C is not None and getattr(_C, "WITH_CUDA", False))

# --------------------------------------------------------------------------------------------
# pack


def _check_pack(srcs: Sequence[torch.Tensor], dst: torch.Tensor, dst_offsets: Sequence[int]):
    """The extension's checks, same messages; returns [(src, offset, nbytes)]."""
    if dst.dtype != torch.uint8:
        raise ValueError(f"pack: dst must be uint8, got {dst.dtype}")
    if not dst.is_contiguous():
        raise ValueError("pack: dst must be contiguous")
    if len(srcs) != len(dst_offsets):
        raise ValueError(f"pack: got {len(srcs)} tensors but {len(dst_offsets)} offsets")
    cap = dst.numel()
    segs = []
    for i, (s, off) in enumerate(zip(srcs, dst_offsets)):
        if s.device != dst.device:
            raise ValueError(f"pack: srcs[{i}] is on {s.device} but dst is on {dst.device}")
        if not s.is_contiguous():
            raise ValueError(f"pack: srcs[{i}] is not contiguous")
        off = int(off)
        n = s.numel() * s.element_size()
        if off < 0 or off > cap or n > cap - off:
            raise ValueError(f"pack: srcs[{i}] ({n} bytes at offset {off}) does not fit in dst ({cap} bytes)")
        segs.append((s, off, n))
    end, last = None, 0
    for i in sorted(range(len(segs)), key=lambda j: segs[j][1]):
        _, off, n = segs[i]
        if n == 0:
            continue
        if end is not None and off < end:
            raise ValueError(f"pack: destination ranges of srcs[{last}] and srcs[{i}] overlap")
        end, last = off + n, i
    return segs


def pack_python(srcs: Sequence[torch.Tensor], dst: torch.Tensor, dst_offsets: Sequence[int]) -> None:
    """The fallback: one ``copy_`` per tensor into a byte view of ``dst`` (N launches on CUDA)."""
    segs = _check_pack(srcs, dst, dst_offsets)
    flat = dst.view(-1)
    base = flat.data_ptr()
    with torch.no_grad():
        for s, off, n in segs:
            if n == 0 or s.data_ptr() == base + off:  # empty, or already in place (adopted)
                continue
            flat[off : off + n].copy_(s.reshape(-1).view(torch.uint8))


pack_native = _C.pack if _C is not None else None


def pack(srcs: Sequence[torch.Tensor], dst: torch.Tensor, dst_offsets: Sequence[int]) -> None:
    """Copy ``srcs[i]``'s bytes to ``dst[dst_offsets[i]:]`` (``dst``: contiguous ``uint8``).

    All tensors must be contiguous and on ``dst``'s device; destination ranges must not overlap;
    a source already at its destination is skipped. On CUDA the copies are queued on the current
    stream (asynchronous, like ``copy_``); the caller keeps ``srcs`` alive until they ran.
    Raises ``ValueError`` on bad input.
    """
    if pack_native is not None:
        pack_native(list(srcs), dst, [int(o) for o in dst_offsets])
    else:
        pack_python(srcs, dst, dst_offsets)
