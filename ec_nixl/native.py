"""Native fast paths, each behind a Python fallback: pack items into the arena, device-side flags.

* ``pack(srcs, dst, dst_offsets)`` copies N contiguous tensors' bytes into one ``uint8`` tensor at
  byte offsets. With ``ec_nixl._C`` it is one kernel launch on the current stream (a memcpy loop
  on CPU); the fallback is one ``copy_`` per tensor. ``IMPL`` says which one ``pack`` uses;
  ``pack_native`` / ``pack_python`` are both exposed so benchmarks can compare them.
* ``DeviceFlag`` is a 32-bit word in pinned, host-mapped memory that a CUDA stream can wait on
  (``cuStreamWaitValue32``) and that a host thread releases with a store, so the thread that
  queues compute never blocks on a transfer. Backed by ``ec_nixl._C`` when it was built with CUDA,
  else by cuda-bindings from Python; ``DEVICE_WAIT_IMPL`` says which, ``None`` when neither.

Set ``EC_NIXL_NATIVE=0`` to ignore the extension. This module never initialises CUDA at import;
it never decides *whether* the device wait is used (that is the barrier's choice, and on a host
where the wait does not work — see design/device.md — it must not be).
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional, Sequence

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


# --------------------------------------------------------------------------------------------
# device flags


class _NativeFlags:
    """Flag primitives from ec_nixl._C (cudaHostAlloc mapped|portable, driver entry points)."""

    name = "native"
    GEQ, EQ = 0, 1

    def alloc(self, n: int, device: int) -> tuple[int, int]:
        return _C.flag_alloc(n, device)

    def free(self, host: int) -> None:
        _C.flag_free(host)

    def wait(self, stream: int, dev: int, value: int, flags: int, device: int) -> None:
        _C.stream_wait_value32(stream, dev, value, flags, device)

    def write(self, stream: int, dev: int, value: int, device: int) -> None:
        _C.stream_write_value32(stream, dev, value, device)

    def store(self, host: int, value: int) -> None:
        _C.flag_store(host, value)

    def load(self, host: int) -> int:
        return _C.flag_load(host)


class _DriverFlags:
    """The same primitives through cuda-bindings (cuMemHostAlloc DEVICEMAP|PORTABLE)."""

    name = "cuda-bindings"
    GEQ, EQ = 0, 1

    def __init__(self):
        from cuda.bindings import driver  # type: ignore

        self.d = driver
        self._ctx: dict[int, object] = {}

    def _ck(self, result, what: str):
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            _, msg = self.d.cuGetErrorString(err)
            raise RuntimeError(f"{what} failed: {err} ({msg.decode() if isinstance(msg, bytes) else msg})")
        return result[1] if isinstance(result, tuple) and len(result) == 2 else None

    def _ensure_context(self, device: int) -> None:
        # Driver calls need a current context; a thread that never ran a runtime call has none.
        ctx = self._ck(self.d.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if ctx is not None and int(ctx) != 0:
            return
        if device not in self._ctx:
            self._ck(self.d.cuInit(0), "cuInit")
            dev = self._ck(self.d.cuDeviceGet(device), "cuDeviceGet")
            self._ctx[device] = self._ck(self.d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._ck(self.d.cuCtxSetCurrent(self._ctx[device]), "cuCtxSetCurrent")

    def alloc(self, n: int, device: int) -> tuple[int, int]:
        self._ensure_context(device)
        flags = self.d.CU_MEMHOSTALLOC_DEVICEMAP | self.d.CU_MEMHOSTALLOC_PORTABLE
        host = int(self._ck(self.d.cuMemHostAlloc(4 * n, flags), "cuMemHostAlloc"))
        ctypes.memset(host, 0, 4 * n)
        try:
            dev = int(self._ck(self.d.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
        except Exception:
            self.d.cuMemFreeHost(host)
            raise
        return host, dev

    def free(self, host: int) -> None:
        self._ck(self.d.cuMemFreeHost(host), "cuMemFreeHost")

    def wait(self, stream: int, dev: int, value: int, flags: int, device: int) -> None:
        self._ensure_context(device)
        self._ck(self.d.cuStreamWaitValue32(self.d.CUstream(stream), self.d.CUdeviceptr(dev), value, flags),
                 "cuStreamWaitValue32")

    def write(self, stream: int, dev: int, value: int, device: int) -> None:
        self._ensure_context(device)
        self._ck(self.d.cuStreamWriteValue32(self.d.CUstream(stream), self.d.CUdeviceptr(dev), value, 0),
                 "cuStreamWriteValue32")

    def store(self, host: int, value: int) -> None:
        ctypes.c_uint32.from_address(host).value = value  # x86: a plain store is a release store

    def load(self, host: int) -> int:
        return ctypes.c_uint32.from_address(host).value


def _cuda_bindings_importable() -> bool:
    try:
        import cuda.bindings.driver  # type: ignore  # noqa: F401
    except Exception:
        return False
    return True


def _flag_backend(impl: Optional[str] = None):
    impl = impl or DEVICE_WAIT_IMPL
    if impl == "native" and NATIVE_WITH_CUDA:
        return _NativeFlags()
    if impl == "cuda-bindings" and torch.version.cuda is not None and _cuda_bindings_importable():
        return _DriverFlags()
    raise RuntimeError(f"device-side wait unavailable (impl {impl!r}): needs ec_nixl._C built with CUDA, "
                       "or cuda-bindings with a CUDA build of torch")


if torch.version.cuda is None:
    DEVICE_WAIT_IMPL: Optional[str] = None
elif NATIVE_WITH_CUDA:
    DEVICE_WAIT_IMPL = "native"
elif _cuda_bindings_importable():
    DEVICE_WAIT_IMPL = "cuda-bindings"
else:
    DEVICE_WAIT_IMPL = None
# The calls exist: not a promise that this host's GPU honours them (probe_waitvalue.py tells).
DEVICE_WAIT_AVAILABLE = DEVICE_WAIT_IMPL is not None


class DeviceFlag:
    """A 32-bit completion word in pinned, host-mapped memory that CUDA streams can wait on.

    ``wait_on(stream)`` enqueues "wait until word >= target" on the stream and returns at once:
    work queued after it runs only once the word is written. ``signal()`` is the host-side
    release store that lets it go (``signal_on(stream)`` the device-side one). Targets come from
    a counter (``arm()``) and the comparison is cyclic, so the word is never reset while a
    wait may still be pending; one flag serves many rounds.

    HAZARD: a wait on a flag that is never signalled stalls its stream forever, and with it
    everything ordered after it (kernels, events, ``synchronize()``, process exit). Therefore:

    * callers MUST signal on every path — success, failure, cancel, timeout, shutdown — and fail
      the request separately (e.g. the ticket goes FAILED and the barrier raises ``LoadFailed``),
      so that the released kernels' output is never used;
    * every pending wait needs a watchdog: a deadline after which the host signals anyway and
      fails the request;
    * ``close()`` only after every wait on the flag has passed.

    ``DEVICE_WAIT_AVAILABLE`` means the calls exist, not that the GPU honours them on this host:
    design/device.md records a host where the stream never resumed. Check with
    ``scripts/probe_waitvalue.py`` before relying on it.
    """

    def __init__(self, device: Optional[int | str | torch.device] = None, impl: Optional[str] = None):
        self._b = _flag_backend(impl)
        self.impl = self._b.name
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.init()
        self.host_ptr, self.dev_ptr = self._b.alloc(1, self.device.index)
        self.target = 0  # the last armed target; the word starts at 0

    def arm(self) -> int:
        """The next target value (the previous one + 1, modulo 2**32)."""
        self.target = (self.target + 1) & 0xFFFFFFFF
        return self.target

    def _stream(self, stream) -> int:
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        return stream if isinstance(stream, int) else stream.cuda_stream

    def wait_on(self, stream=None, target: Optional[int] = None, eq: bool = False) -> int:
        """Make ``stream`` (default: the current one) wait until the word >= ``target``.

        ``target`` defaults to a newly armed one; returns it. ``eq`` waits for equality instead.
        """
        if target is None:
            target = self.arm()
        self._b.wait(self._stream(stream), self.dev_ptr, target, self._b.EQ if eq else self._b.GEQ,
                     self.device.index)
        return target

    def signal(self, value: Optional[int] = None) -> None:
        """Host-side release: store ``value`` (default: the last armed target) into the word."""
        self._b.store(self.host_ptr, self.target if value is None else value)

    def signal_on(self, stream, value: Optional[int] = None) -> None:
        """Device-side release: ``stream`` writes ``value`` once its earlier work is done."""
        self._b.write(self._stream(stream), self.dev_ptr, self.target if value is None else value,
                      self.device.index)

    @property
    def value(self) -> int:
        """The word as the host sees it now."""
        return self._b.load(self.host_ptr)

    def close(self) -> None:
        """Free the word; only once no stream can still be waiting on it."""
        if self.host_ptr:
            self._b.free(self.host_ptr)
            self.host_ptr = self.dev_ptr = 0

    def __repr__(self) -> str:
        return f"DeviceFlag({self.device}, impl={self.impl}, target={self.target})"
