"""The bytes every path moves: the producer's source buffer, its pattern, and the checks on arrival.

The producer fills one *source* buffer (the encoder outputs, outside any pool) with a
non-repeating pattern once; every path copies regions of it, and the consumer checks the first and
last 8 bytes of each item it timed against the same region, so no path can be fast by moving
nothing. The source is shared with the consumer (CUDA IPC on a GPU, a /dev/shm mapping on CPU) so
that the reference copies read the very bytes the producer wrote.
"""

from __future__ import annotations

import mmap
import os


def fill_pattern(t) -> None:
    """Fill a uint8 tensor with a cheap non-repeating pattern (so head/tail probes identify a region)."""
    import torch

    n8 = t.numel() // 8
    if n8:
        v = t[: n8 * 8].view(torch.int64)
        v.copy_(torch.arange(n8, dtype=torch.int64, device=t.device).mul_(-7046029254386353131).add_(12345))
    if t.numel() % 8:
        t[n8 * 8 :].fill_(0x5A)


FULL_CHECK = False
"""``--check full`` (set from the plan in each peer): every probe also carries a digest of all the
item's bytes, so an arrival is checked byte for byte, not only at its ends. Untimed, but it costs
a hash per item on both sides: for tests, not for numbers."""


def probe(u8) -> tuple:
    """First and last 8 bytes of a uint8 view or array (what the other side checks), and with
    ``FULL_CHECK`` a digest of all of them."""
    ends = (tuple(u8[:8].tolist()), tuple(u8[-8:].tolist()))
    return ends + (_digest(u8),) if FULL_CHECK else ends


def check(got_u8, want: tuple, what: str) -> None:
    got = (tuple(got_u8[:8].tolist()), tuple(got_u8[-8:].tolist()))
    if len(want) > 2:  # the producer sent a digest: compare every byte
        got += (_digest(got_u8),)
    if got != want:
        raise AssertionError(f"{what}: bytes differ from what the producer wrote ({got} != {want})")


def _digest(u8) -> bytes:
    import hashlib

    import numpy as np

    if hasattr(u8, "detach"):
        u8 = u8.detach().cpu().numpy()
    return hashlib.blake2b(np.ascontiguousarray(u8), digest_size=16).digest()


def as_u8(t):
    import torch

    return t.reshape(-1).view(torch.uint8)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class Source:
    """The producer's source buffer and how the consumer maps it (``export()`` -> ``open_source``)."""

    def __init__(self, device: str, nbytes: int, tmpdir: str):
        import torch

        self.nbytes = nbytes
        self.cuda = device.startswith("cuda")
        self._shm = None
        if self.cuda:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        else:
            self.path = os.path.join(tmpdir, "reference-src")
            with open(self.path, "wb") as f:
                f.truncate(nbytes)
            self._shm = _map(self.path, nbytes, writable=True)
            self.tensor = torch.frombuffer(self._shm, dtype=torch.uint8)
        fill_pattern(self.tensor)
        sync(device)

    def export(self) -> tuple:
        if not self.cuda:
            return ("shm", self.path)
        try:
            from torch.multiprocessing.reductions import reduce_tensor

            return ("ipc", reduce_tensor(self.tensor))
        except Exception as e:  # e.g. expandable segments: not exportable through CUDA IPC
            return ("error", f"CUDA IPC export failed: {e!r}")


def open_source(ref: tuple, nbytes: int):
    """The consumer's read-only view of the producer's source: (tensor or numpy array, note)."""
    kind, what = ref
    if kind == "ipc":
        fn, args = what
        try:
            return fn(*args), ""
        except Exception as e:
            return None, f"CUDA IPC import failed: {e!r}"
    if kind == "shm":
        import numpy as np

        return np.frombuffer(_map(what, nbytes, writable=False), dtype=np.uint8), ""
    return None, what


def _map(path: str, nbytes: int, writable: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, nbytes, flags=flags, prot=prot)
    finally:
        os.close(fd)


# --- pinned host memory (host-bounce: ECCPUConnector pins its DRAM buffers) ----------------------


def pin(arena) -> bool:
    """cudaHostRegister a DRAM arena (D2H/H2D at full speed, as ECCPUConnector's pinned buffers)."""
    import torch

    try:
        rc = int(getattr(rc := torch.cuda.cudart().cudaHostRegister(arena.base, arena.size, 0), "value", rc))
    except Exception:
        return False
    if rc == 0:
        return True
    _clear_cuda_error()  # a failed call leaves a sticky error torch would raise at its next check
    return rc == 712  # cudaErrorHostMemoryAlreadyRegistered: UCX pinned it when NIXL registered it


def unpin(arena) -> None:
    import torch

    try:
        torch.cuda.cudart().cudaHostUnregister(arena.base)
    except Exception:
        pass


def _clear_cuda_error() -> None:
    import ctypes

    import torch

    fn = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if fn is None:
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                fn = ctypes.CDLL(name).cudaGetLastError  # the runtime torch already loaded
                break
            except OSError:
                continue
    if fn is not None:
        fn()
