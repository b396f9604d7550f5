"""The raw memory behind a pool: one contiguous region per rank, allocated once at start.

* DRAM: an anonymous ``mmap`` pre-faulted with ``MADV_POPULATE_WRITE`` (or touched page by
  page on older kernels), so that registration and the first transfer never pay first-touch
  page faults on the hot path. It is 2 MiB-aligned and asks for transparent huge pages
  (``MADV_HUGEPAGE``): same-host transfers go through CMA (``process_vm_readv``), which pins the
  other process's pages one by one, and over 4 KiB pages a 16 MiB READ ran at 2-3 GB/s against
  6-10 GB/s over huge pages (two processes, this 2-core host).
* VRAM: a plain ``cudaMalloc`` through cuda-bindings (or CuPy), never PyTorch's caching
  allocator: an allocation from expandable segments (VMM) cannot be exported through legacy
  CUDA IPC, which UCX's ``cuda_ipc`` transport needs to reach it from another process.

This module owns allocation and the byte view (a ``torch.uint8`` tensor); it never carves the
region (see ``pool``) and never talks to NIXL (see ``transport``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from typing import Optional

import torch

from ec_nixl.errors import ConfigError

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_HUGE_PAGE = 2 << 20


def _map_dram(size: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping holding ``size`` bytes at a 2 MiB-aligned offset, backed by huge
    pages where the kernel has them (a hint: 4 KiB pages otherwise), pre-faulted."""
    buf = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    libc = ctypes.CDLL(None, use_errno=True)
    anchor = ctypes.c_char.from_buffer(buf)
    base = ctypes.addressof(anchor)
    del anchor  # no export may outlive this function (the mmap could not be closed)
    offset = -base % _HUGE_PAGE
    addr, length = ctypes.c_void_p(base + offset), ctypes.c_size_t(size)
    libc.madvise(addr, length, _MADV_HUGEPAGE)  # EINVAL without THP support: keep 4 KiB pages
    if libc.madvise(addr, length, _MADV_POPULATE_WRITE) != 0:  # older kernel: touch every page
        view = memoryview(buf)
        for off in range(offset, offset + size, mmap.PAGESIZE):
            view[off] = 0
        view.release()
    return buf, offset


LANDING_VIEWS = 4096
"""At most this many cached landing views per arena (a view costs ~200 B of host memory)."""


class Arena:
    """A contiguous, never-moving region of DRAM or VRAM with a ``uint8`` tensor view."""

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        if size <= 0:
            raise ConfigError(f"arena size must be positive, got {size}")
        self.device = torch.device(device)
        self.size = int(size)
        self._owner = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # whole-arena views per dtype (typed_view)
        self._landing: dict[tuple, torch.Tensor] = {}  # landing_view's views, by place, shape and dtype
        if self.device.type == "cpu":
            self.mem_type = "DRAM"
            self.device_id = 0
            self._owner, offset = _map_dram(self.size)
            self.bytes = torch.frombuffer(self._owner, dtype=torch.uint8, count=self.size, offset=offset)
        elif self.device.type == "cuda":
            self.mem_type = "VRAM"
            self.device_id = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", self.device_id)
            self._owner = _CudaMalloc(self.size, self.device_id)
            self.bytes = torch.as_tensor(self._owner, device=self.device)
        else:
            raise ConfigError(f"unsupported arena device {device!r}: use 'cpu' or 'cuda[:N]'")
        self.base = self.bytes.data_ptr()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.bytes[offset : offset + nbytes]

    def typed_view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape``/``dtype`` tensor at byte ``offset`` (a multiple of the dtype's
        size): one ``as_strided`` over a cached typed view of the arena, not three view calls
        (it is on the load path)."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.bytes[: self.size - self.size % dtype.itemsize].view(dtype)
        if len(shape) == 2:  # [num_embeds, width]: the encoder outputs' shape
            return typed.as_strided(tuple(shape), (shape[1], 1), offset // dtype.itemsize)
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        return typed.as_strided(tuple(shape), tuple(reversed(strides)), offset // dtype.itemsize)

    def landing_view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """``typed_view``, built once per place, shape and dtype: a consumer's slots are reused
        for items of the same shape, and building a tensor costs a few microseconds of the
        load -> barrier path (an ``as_strided`` and a tensor's allocation). Two items that
        occupy the same place one after the other get the same view object: same bytes either
        way; only a caller that changed a view's metadata in place (``resize_``, ``set_``) would
        see it, and the gather only reads and slices. Bounded: the cache is dropped whole when
        it reaches ``LANDING_VIEWS``."""
        key = (offset, tuple(shape), dtype)
        v = self._landing.get(key)
        if v is None:
            if len(self._landing) >= LANDING_VIEWS:
                self._landing.clear()
            v = self._landing[key] = self.typed_view(offset, shape, dtype)
        return v

    def contains(self, t: torch.Tensor) -> bool:
        """True when ``t``'s bytes lie entirely inside this arena (so it needs no copy)."""
        if t.device != self.device:
            return False
        start = t.data_ptr()
        return self.base <= start and start + t.numel() * t.element_size() <= self.base + self.size

    def close(self) -> None:
        self._typed.clear()
        self._landing.clear()
        self.bytes = None  # type: ignore[assignment]
        owner, self._owner = self._owner, None
        if isinstance(owner, _CudaMalloc):
            owner.free()
        elif owner is not None:
            try:
                owner.close()
            except BufferError:
                # A view still exists somewhere; the mapping goes when the last view does.
                logger.debug("arena mmap still exported; leaving it to the garbage collector")


class _CudaMalloc:
    """cudaMalloc'd device memory exposed through ``__cuda_array_interface__``."""

    def __init__(self, size: int, device_id: int):
        self.size = size
        self.device_id = device_id
        self.ptr: Optional[int] = None
        self._free = None
        with torch.cuda.device(device_id):
            torch.cuda.init()
            self.ptr, self._free = _cuda_malloc(size)

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": None}

    def free(self) -> None:
        if self.ptr is not None and self._free is not None:
            with torch.cuda.device(self.device_id):
                torch.cuda.synchronize()
                self._free(self.ptr)
            self.ptr = None


def _cuda_malloc(size: int):
    """Return (ptr, free_fn) from a real cudaMalloc: cuda-bindings, else CuPy, else torch.

    The torch fallback is accepted only when expandable segments are off (then a large block is
    its own cudaMalloc segment and exports through CUDA IPC).
    """
    try:
        from cuda.bindings import runtime as cudart  # type: ignore

        err, ptr = cudart.cudaMalloc(size)
        if int(err) != 0:
            raise MemoryError(f"cudaMalloc({size}) failed: {err}")

        def free(p, _rt=cudart):
            _rt.cudaFree(p)

        return int(ptr), free
    except ImportError:
        pass
    try:
        import cupy  # type: ignore

        mem = cupy.cuda.runtime.malloc(size)

        def free(p, _cp=cupy):
            _cp.cuda.runtime.free(p)

        return int(mem), free
    except ImportError:
        pass
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:True" in conf.replace(" ", ""):
        raise ConfigError(
            "cannot allocate an IPC-exportable VRAM pool: install cuda-bindings or cupy, or turn "
            "off PyTorch expandable segments (PYTORCH_CUDA_ALLOC_CONF)"
        )
    t = torch.empty(size, dtype=torch.uint8, device="cuda")
    keep = {t.data_ptr(): t}

    def free(p, _keep=keep):
        _keep.pop(p, None)

    return t.data_ptr(), free
