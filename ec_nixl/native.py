"""Native fast paths, each behind a Python fallback: pack a step's items into the arena.

* ``pack(srcs, dst, dst_offsets)`` copies N contiguous tensors' bytes into one ``uint8`` tensor at
  byte offsets. With ``ec_nixl._C`` it is one kernel launch on the current stream (a memcpy loop
  on CPU); the fallback is one ``copy_`` per tensor. ``IMPL`` says which one ``pack`` uses;
  ``pack_native`` / ``pack_python`` are both exposed so benchmarks can compare them.
A device-side load barrier was tried and dropped (bench/RESULTS.md); its probe lives outside
the package, in ``bench/probes/``.

Set ``EC_NIXL_NATIVE=0`` to ignore the extension; one built for another torch is ignored too
(``WHY_PYTHON`` says why the fallbacks are used). This module never initialises CUDA at import.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch


def _load():
    """(the extension, '') or (None, why the Python fallbacks are used).

    The extension is used only under the torch it was built against: a venv with another torch
    that imports this checkout (scripts/test.sh's official-vLLM venvs, a guard run with their
    Python) would run it against another ABI, undefined behaviour. setup.py writes the version
    beside the binary (checked before loading it) and into it (checked after)."""
    if os.environ.get("EC_NIXL_NATIVE", "1") == "0":
        return None, "disabled (EC_NIXL_NATIVE=0)"
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_C.torch")) as f:
            built_for = f.read().strip()
    except OSError:
        built_for = None
    if built_for is not None and built_for != torch.__version__:
        return None, f"ec_nixl._C was built for torch {built_for}, this is torch {torch.__version__} (rebuild it)"
    try:
        from ec_nixl import _C as ext  # type: ignore[attr-defined]
    except ImportError as e:  # not built (no compiler, no torch at build time)
        return None, f"ec_nixl._C not built ({e})"
    got = getattr(ext, "BUILT_FOR_TORCH", None)
    if got != torch.__version__:
        return None, (f"ec_nixl._C was built for torch {got or 'unknown'}, this is torch {torch.__version__} "
                      "(rebuild it)")
    return ext, ""


_C, WHY_PYTHON = _load()
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
