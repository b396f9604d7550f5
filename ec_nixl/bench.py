"""``ec-nixl bench``: end-to-end transfer benchmark of the ec-nixl data plane against its peers.

Two spawned processes, a *producer* (the Encode side) and a *consumer* (the Prefill/Decode side),
move encoder outputs (an ``[num_embeds, width]`` tensor per image) between them. For each size,
in one run and between the same two processes, the consumer times (its own clock, medians and p99
over repeats, warm-up excluded):

``ours-read``       ``Endpoint.load()`` -> ``LoadBarrier.wait()`` returned; the consumer READs the
                    item (hold-provided place, no grant round trip) from the producer's pool.
``ours-write``      the same with a write-mode link: the producer WRITEs into the consumer's slot.
                    Producer items are written in place through ``reserve()`` (zero-copy).
``reference-copy``  the physical reference: a CUDA-IPC device copy of the same bytes from the
                    producer's memory + ``synchronize`` (GPU), or a single-threaded memcpy from a
                    shared-memory region the producer wrote (CPU).
``host-bounce``     ECCPUConnector-style: producer D2H into pinned NIXL-registered DRAM, NIXL DRAM
                    READ (ec-nixl CPU endpoints), consumer H2D + synchronize. GPU runs only.
``file``            ECExampleConnector-style: safetensors ``save_file`` to /dev/shm by the
                    producer, ``load_file`` onto the device by the consumer.
``staged-write``    ECMooncakeConnector-style: ``publish()`` of a tensor outside the pool (a
                    staging copy into the registered pool, + synchronize) then a NIXL WRITE.
``ucx``             raw UCX tag send/recv through ucxx, when ucxx is importable.

Paths with a producer-side stage (host-bounce's D2H, file's save, staged-write's staging copy)
report, per sample, the producer's stage time (its clock) plus the consumer's time (its clock):
the two halves run back to back, never overlapped, exactly as on the critical path of one item.

Sizes are per item; the batch case moves ``--items`` items per step in one ``load()`` and one
barrier wait. Goals are printed as ratios at the end; they are reported, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import mmap
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

SCHEMA = "ec-nixl-bench/1"
QWEN_ROWS, QWEN_WIDTH = 1369, 3584  # Qwen2.5-VL-7B, one 1024x1024 image: 9.8 MB in bf16
BLOCK = 64 << 10
PROBE_BYTES = 1 << 20
ALL_PATHS = ("ours-read", "ours-write", "reference-copy", "host-bounce", "file", "staged-write", "ucx")
DEFAULT_SIZES = "64K,1M,9.8M,64M"
CPU_GOAL_SIZE = "16M"


# ================================================================================================
# sizes and formatting


@dataclass(frozen=True)
class ItemSpec:
    nbytes: int
    shape: tuple
    dtype: str  # torch dtype name; every item is bf16 (an encoder output)
    label: str


def parse_size(tok: str) -> ItemSpec:
    """'64K' / '1M' / '64M' (binary units), '9.8M' or 'qwen' (1369x3584 bf16), 'RxW' (bf16), '4096'."""
    t = tok.strip()
    low = t.lower().removesuffix("b")
    if low in ("9.8m", "qwen"):
        n = QWEN_ROWS * QWEN_WIDTH * 2
        return ItemSpec(n, (QWEN_ROWS, QWEN_WIDTH), "bfloat16", "9.8MB")
    if "x" in low:
        r, _, w = low.partition("x")
        rows, width = int(r), int(w)
        if rows <= 0 or width <= 0:
            raise ValueError(f"bad size {tok!r}")
        return ItemSpec(rows * width * 2, (rows, width), "bfloat16", f"{rows}x{width}")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(low[-1:], 1)
    num = low[:-1] if mult != 1 else low
    try:
        n = int(round(float(num) * mult))
    except ValueError:
        raise ValueError(f"bad size {tok!r}: use e.g. 64K, 1M, 9.8M, 64M, 1369x3584 or a byte count") from None
    if n < 2 or n % 2:
        raise ValueError(f"bad size {tok!r}: need an even number of bytes >= 2 (bf16 items)")
    return ItemSpec(n, (n // 2,), "bfloat16", human(n))


def human(n: float) -> str:
    n = int(n)
    if n >= 1 << 30 and n % (1 << 30) == 0:
        return f"{n >> 30}GiB"
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}MiB"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10}KiB"
    if n >= 1e9:
        return f"{n / 1e9:.2f}GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f}MB"
    return f"{n}B"


def blocks(n: int, block: int = BLOCK) -> int:
    return max(1, -(-n // block))


def pctl(xs: list, q: float) -> float:
    """Percentile with linear interpolation (numpy's default), without numpy."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def fmt_us(us: float) -> str:
    if us != us:
        return "-"
    if us >= 100_000:
        return f"{us / 1000:.0f} ms"
    if us >= 10_000:
        return f"{us / 1000:.1f} ms"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.1f} us"


# ================================================================================================
# shared helpers for both roles


def _watch_parent(parent_pid: int, tmpdir: Optional[str] = None) -> None:
    """Exit this child if the orchestrator dies (no orphans even after a SIGKILL of the parent)."""

    def loop():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                if tmpdir:
                    shutil.rmtree(tmpdir, ignore_errors=True)
                os._exit(3)

    threading.Thread(target=loop, name="ec-nixl-bench-watchdog", daemon=True).start()


def _quiet_logs() -> None:
    import logging

    logging.getLogger("ec_nixl").setLevel(logging.WARNING)
    logging.getLogger("nixl").setLevel(logging.WARNING)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _fill_pattern(t) -> None:
    """Fill a uint8 tensor with a cheap non-repeating pattern (so head/tail probes identify a region)."""
    import torch

    n8 = t.numel() // 8
    if n8:
        v = t[: n8 * 8].view(torch.int64)
        v.copy_(torch.arange(n8, dtype=torch.int64, device=t.device).mul_(-7046029254386353131).add_(12345))
    if t.numel() % 8:
        t[n8 * 8 :].fill_(0x5A)


def _probe(u8) -> tuple:
    """First and last 8 bytes of a uint8 view (what the other side checks)."""
    return tuple(u8[:8].tolist()), tuple(u8[-8:].tolist())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _pin(arena) -> bool:
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


def _unpin(arena) -> None:
    import torch

    try:
        torch.cuda.cudart().cudaHostUnregister(arena.base)
    except Exception:
        pass


def _safetensors():
    try:
        import safetensors.torch as st  # type: ignore

        return st
    except ImportError:
        return None


def _ucxx():
    try:
        import ucxx  # type: ignore

        return ucxx
    except Exception:
        return None


# ================================================================================================
# producer role


class _Producer:
    """The Encode side: a device endpoint (ours, staged-write), a DRAM endpoint (host-bounce),
    a source buffer (the 'encoder output' outside the pool; shared for reference-copy)."""

    def __init__(self, cfg: dict):
        import torch

        self.cfg = cfg
        self.device = cfg["device"]
        self.cuda = self.device.startswith("cuda")
        if self.cuda:
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(1)
        from ec_nixl.config import EndpointConfig
        from ec_nixl.endpoint import Endpoint

        pid = os.getpid()
        common = dict(pool_bytes=cfg["pool_bytes"], block_bytes=BLOCK, listen="127.0.0.1:0", threaded=True,
                      announce_lease_s=600.0, grant_lease_s=600.0, evict_unclaimed=False, load_timeout_s=60.0,
                      backend_params=cfg.get("backend_params") or {},
                      nixl_progress_thread=cfg.get("nixl_progress_thread"))
        self.ep = Endpoint(EndpointConfig(name=f"ecb-prod-{pid}", device=self.device, **common))
        self.host = None
        self.pinned = False
        if self.cuda and "host-bounce" in cfg["paths"]:
            self.host = Endpoint(EndpointConfig(name=f"ecb-prodh-{pid}", device="cpu", **common))
            self.pinned = _pin(self.host.pool.arena)
        # The source: what the encoder produced, outside any pool.
        self.src_bytes = cfg["src_bytes"]
        self._shm = None
        if self.cuda:
            self.src = torch.empty(self.src_bytes, dtype=torch.uint8, device="cuda")
        else:
            path = os.path.join(cfg["tmpdir"], "reference-src")
            with open(path, "wb") as f:
                f.truncate(self.src_bytes)
            fd = os.open(path, os.O_RDWR)
            try:
                self._shm = mmap.mmap(fd, self.src_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            self.src = torch.frombuffer(self._shm, dtype=torch.uint8)
            self.src_path = path
        _fill_pattern(self.src)
        _sync(self.device)
        self._cursor = 0
        self._n = 0
        self.files: list[str] = []

    # --- helpers ------------------------------------------------------------------------

    def _src_region(self, nbytes: int):
        """The next region of the source buffer (rotating, so repeats do not re-read one hot range)."""
        span = self.src_bytes - nbytes
        off = self._cursor if self._cursor <= span else 0
        self._cursor = off + ((nbytes + 4095) // 4096) * 4096
        return self.src[off : off + nbytes]

    def _reserve(self, ep, nbytes: int, tag: str):
        """A slot, waiting (bounded) for items the consumer just read to be freed."""
        from ec_nixl.errors import PoolExhausted

        deadline = time.monotonic() + 20.0
        while True:
            try:
                return ep.reserve(nbytes, tag=tag)
            except PoolExhausted:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.0005)

    def _hash(self, tag: str) -> str:
        self._n += 1
        return f"{tag}-{self._n}"

    # --- commands -----------------------------------------------------------------------

    def info(self) -> dict:
        import torch

        ref = None
        if self.cuda:
            try:
                from torch.multiprocessing.reductions import reduce_tensor

                ref = ("ipc", reduce_tensor(self.src))
            except Exception as e:
                ref = ("error", f"CUDA IPC export failed: {e!r}")
        else:
            ref = ("shm", self.src_path)
        return {
            "address": self.ep.address,
            "host_address": self.host.address if self.host else None,
            "pinned": self.pinned,
            "ref": ref,
            "src_bytes": self.src_bytes,
            "capacity": self.ep.pool.capacity,
            "host_capacity": self.host.pool.capacity if self.host else 0,
            "torch": torch.__version__,
        }

    def items(self, kind: str, tag: str, spec: tuple, n_ops: int, per_op: int) -> list:
        """Prepare ``n_ops`` operations of ``per_op`` items each. Returns, per op,
        (descs or file paths, probes, stage_s): stage_s is the producer-side cost of the path."""
        import torch

        nbytes, shape, dtype = spec
        tdt = _torch_dtype(dtype)
        out = []
        for _ in range(n_ops):
            descs, probes, stage = [], [], 0.0
            if kind == "ours":  # the encoder writes its output straight into a reserved slot
                slots = []
                for _ in range(per_op):
                    h = self._hash(tag)
                    slot = self._reserve(self.ep, nbytes, h)
                    slot.bytes()[:nbytes].copy_(self._src_region(nbytes))
                    slots.append((h, slot))
                _sync(self.device)
                for h, slot in slots:
                    descs.append(self.ep.publish_slot(h, slot, shape, tdt))
                    probes.append(_probe(slot.bytes()[:nbytes]))
            elif kind == "staged":  # the output lives outside the pool: publish() stages a copy
                srcs = [(self._hash(tag), self._src_region(nbytes)) for _ in range(per_op)]
                t0 = time.perf_counter()
                for h, s in srcs:
                    descs.append(self.ep.publish(h, s.view(tdt).view(shape)))
                _sync(self.device)
                stage = time.perf_counter() - t0
                probes = [_probe(s) for _, s in srcs]
            elif kind == "bounce":  # D2H into pinned, NIXL-registered DRAM
                srcs = [(self._hash(tag), self._src_region(nbytes)) for _ in range(per_op)]
                slots = [self._reserve(self.host, nbytes, h) for h, _ in srcs]
                t0 = time.perf_counter()
                for slot, (_, s) in zip(slots, srcs):
                    slot.bytes()[:nbytes].copy_(s, non_blocking=True)
                _sync(self.device)
                stage = time.perf_counter() - t0
                for slot, (h, s) in zip(slots, srcs):
                    descs.append(self.host.publish_slot(h, slot, shape, tdt))
                    probes.append(_probe(s))
            elif kind == "file":  # ECExampleConnector: tensor.cpu() -> safetensors -> /dev/shm
                st = _safetensors()
                srcs = [(self._hash(tag), self._src_region(nbytes)) for _ in range(per_op)]
                paths = [os.path.join(self.cfg["tmpdir"], f"{h}.safetensors") for h, _ in srcs]
                t0 = time.perf_counter()
                for p, (_, s) in zip(paths, srcs):
                    t = s.view(tdt).view(shape)
                    if st is not None:
                        st.save_file({"ec_cache": t.detach().cpu()}, p)
                    else:
                        torch.save({"ec_cache": t.detach().cpu()}, p)
                stage = time.perf_counter() - t0
                self.files.extend(paths)
                descs = paths
                probes = [_probe(s) for _, s in srcs]
            else:
                raise ValueError(f"unknown item kind {kind!r}")
            out.append((descs, probes, stage))
        return out

    def stats(self) -> dict:
        out = {"dev": self.ep.stats()}
        if self.host is not None:
            out["host"] = self.host.stats()
        for v in out.values():
            for k in ("xfer_s", "post_s", "sizes", "wait_s"):
                v.pop(k, None)
        return out

    def drain(self, timeout: float = 10.0) -> int:
        """Wait until every published item was consumed and freed; returns bytes still used."""
        deadline = time.monotonic() + timeout
        eps = [e for e in (self.ep, self.host) if e is not None]
        while time.monotonic() < deadline:
            if all(e.pool.stats().used == 0 for e in eps):
                return 0
            time.sleep(0.002)
        return sum(e.pool.stats().used for e in eps)

    def ucx_start(self) -> int:
        return _ucx_serve(self)

    def close(self) -> None:
        for p in self.files:
            try:
                os.unlink(p)
            except OSError:
                pass
        if self.host is not None:
            if self.pinned:
                _unpin(self.host.pool.arena)
            self.host.close()
        self.ep.close()


def _producer_main(cfg: dict, conn, ctl) -> None:
    _watch_parent(cfg["parent_pid"], cfg.get("tmpdir"))
    _quiet_logs()
    prod = None
    try:
        prod = _Producer(cfg)
        ctl.send(("ready", None))
        while True:
            if not conn.poll(cfg["idle_timeout_s"]):
                raise TimeoutError(f"producer: no command from the consumer for {cfg['idle_timeout_s']} s")
            try:
                cmd, args = conn.recv()
            except EOFError:
                break
            if cmd == "close":
                conn.send(("ok", None))
                break
            try:
                conn.send(("ok", getattr(prod, cmd)(*args)))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    except BaseException as e:
        try:
            ctl.send(("error", f"producer: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
    finally:
        if prod is not None:
            try:
                prod.close()
            except Exception:
                pass


class ProducerProcess:
    """A bench producer in its own (spawned) process, driven over a pipe: ``rpc(cmd, *args)``.

    For harnesses that time a consumer in their own process (the micro suite's handshake): a
    producer in-process would share the GIL with the timed consumer thread and add up to a switch
    interval (5 ms) to every control-plane hop.
    """

    def __init__(self, device: str = "cpu", pool_bytes: int = 64 << 20, start_timeout: float = 120.0):
        self._tmp = tempfile.mkdtemp(prefix="ec-nixl-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        cfg = {"device": device, "paths": ["ours-read"], "pool_bytes": pool_bytes, "src_bytes": pool_bytes,
               "tmpdir": self._tmp, "parent_pid": os.getpid(), "idle_timeout_s": 600.0}
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        ctl_r, ctl_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_producer_main, args=(cfg, child, ctl_w), daemon=True)
        self.proc.start()
        child.close()
        ctl_w.close()
        try:
            if not ctl_r.poll(start_timeout):
                raise TimeoutError(f"bench producer did not start within {start_timeout} s")
            status, detail = ctl_r.recv()
            if status != "ready":
                raise RuntimeError(detail)
            self.info = self.rpc("info")
        except BaseException:
            self.close()
            raise
        finally:
            ctl_r.close()
        self.address = self.info["address"]

    def rpc(self, cmd: str, *args, timeout: float = 120.0):
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"bench producer did not answer {cmd!r} within {timeout} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"bench producer command {cmd!r} failed: {value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("close", ()))
                self._conn.poll(20)
            except Exception:
                pass
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


# ================================================================================================
# consumer role


class _Consumer:
    """The Prefill/Decode side: runs every case and reports rows to the orchestrator."""

    def __init__(self, cfg: dict, prod, ctl):
        import torch

        self.cfg = cfg
        self.prod = prod
        self.ctl = ctl
        self.device = cfg["device"]
        self.cuda = self.device.startswith("cuda")
        if self.cuda:
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(1)
        self.info = self.rpc("info", timeout=180)
        from ec_nixl.barrier import LoadBarrier
        from ec_nixl.config import EndpointConfig
        from ec_nixl.endpoint import Endpoint

        pid = os.getpid()
        paths = cfg["paths"]
        common = dict(pool_bytes=cfg["pool_bytes"], block_bytes=BLOCK, threaded=False, load_timeout_s=60.0,
                      peer_timeout_s=30.0, backend_params=cfg.get("backend_params") or {},
                      nixl_progress_thread=cfg.get("nixl_progress_thread"))
        self.eps: dict[str, Any] = {}
        if "ours-read" in paths or cfg["barrier"]:
            self.eps["read"] = Endpoint(EndpointConfig(name=f"ecb-cons-r-{pid}", device=self.device, mode="read",
                                                       **common))
        if "ours-write" in paths or "staged-write" in paths:
            self.eps["write"] = Endpoint(EndpointConfig(name=f"ecb-cons-w-{pid}", device=self.device,
                                                        mode="write", **common))
        self.pinned = False
        if self.cuda and "host-bounce" in paths:
            self.eps["host"] = Endpoint(EndpointConfig(name=f"ecb-cons-h-{pid}", device="cpu", mode="read",
                                                       **common))
            self.pinned = _pin(self.eps["host"].pool.arena)
        self.barriers = {k: LoadBarrier(ep) for k, ep in self.eps.items()}
        # Handshakes and the first, wire-up-paying transfer of each link happen here, untimed.
        tiny = (BLOCK, (BLOCK // 2,), "bfloat16")
        for k, ep in self.eps.items():
            addr = self.info["host_address"] if k == "host" else self.info["address"]
            (descs, probes, _), = self.rpc("items", "bounce" if k == "host" else "ours", f"warm-{k}", tiny, 1, 1)
            tickets = ep.load(_refs(ep, addr, descs, hold=(k != "write")))
            out = self.barriers[k].wait(tickets, timeout=60)
            _check(out[descs[0].mm_hash].reshape(-1).view(torch.uint8), probes[0], f"warm-up over link {k}")
            for t in tickets:
                t.release()
        # Destination buffer for the reference copy / host-bounce H2D / file loads (pre-touched).
        self.dst_bytes = cfg["pool_bytes"]
        if self.cuda:
            self.dst = torch.zeros(self.dst_bytes, dtype=torch.uint8, device="cuda")
        else:
            import numpy as np

            self.dst = torch.from_numpy(np.ones(self.dst_bytes, dtype=np.uint8))
        self._dcur = 0
        self._scur = 0
        self.src = None
        self._shm = None
        self.ref_note = ""
        ref = self.info["ref"]
        if ref[0] == "ipc":
            fn, args = ref[1]
            try:
                self.src = fn(*args)
            except Exception as e:  # e.g. expandable segments: not exportable through CUDA IPC
                self.ref_note = f"CUDA IPC import failed: {e!r}"
        elif ref[0] == "shm":
            fd = os.open(ref[1], os.O_RDONLY)
            try:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._shm = mmap.mmap(fd, self.info["src_bytes"], flags=flags, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            import numpy as np

            self.src_np = np.frombuffer(self._shm, dtype=np.uint8)
            self.dst_np = self.dst.numpy()
        else:
            self.ref_note = ref[1]
        self.rows: list[dict] = []
        self.skipped: dict[str, str] = {}
        self.extra: dict[str, Any] = {}

    # --- plumbing -----------------------------------------------------------------------

    def rpc(self, cmd: str, *args, timeout: float = 120.0):
        self.prod.send((cmd, args))
        if not self.prod.poll(timeout):
            raise TimeoutError(f"producer did not answer {cmd!r} within {timeout} s")
        status, value = self.prod.recv()
        if status != "ok":
            raise RuntimeError(f"producer command {cmd!r} failed: {value}")
        return value

    def send(self, *msg) -> None:
        self.ctl.send(msg)

    def _dst_region(self, nbytes: int):
        span = self.dst_bytes - nbytes
        off = self._dcur if self._dcur <= span else 0
        self._dcur = off + ((nbytes + 4095) // 4096) * 4096
        return off

    def _src_off(self, nbytes: int) -> int:
        span = self.info["src_bytes"] - nbytes
        off = self._scur if self._scur <= span else 0
        self._scur = off + ((nbytes + 4095) // 4096) * 4096
        return off

    # --- the case loop --------------------------------------------------------------------

    def run_case(self, path: str, spec: ItemSpec, per_op: int) -> None:
        impl = _PATHS[path](self, spec, per_op)
        cfg = self.cfg
        warm = max(1, cfg["warmup"])
        samples: list[float] = []
        done, target = 0, None
        t_case = time.perf_counter()
        try:
            while True:
                want = warm - done if target is None else warm + target - done
                if want <= 0:
                    break
                k = min(want, impl.chunk)
                for payload in impl.prepare(k):
                    dt = impl.op(payload)
                    if done >= warm:
                        samples.append(dt)
                    done += 1
                impl.after_chunk()
                if target is None:
                    per = (time.perf_counter() - t_case) / max(1, done)
                    target = int(min(cfg["repeats"], max(cfg["min_repeats"], cfg["budget_s"] / max(per, 1e-9))))
        finally:
            impl.finish()
        self._row(path, spec.nbytes * per_op, per_op, samples, spec.label)

    def _row(self, path: str, nbytes: int, items: int, samples: list[float], label: str) -> None:
        us = [s * 1e6 for s in samples]
        p50 = pctl(us, 50)
        row = {"path": path, "bytes": int(nbytes), "items": int(items), "p50_us": p50, "p99_us": pctl(us, 99),
               "gbps": (nbytes / (p50 * 1e-6) / 1e9) if p50 > 0 else 0.0, "n": len(us), "label": label}
        self.rows.append(row)
        self.send("row", row)

    # --- extra measurements -----------------------------------------------------------

    def measure_copy_bw(self, nbytes: int) -> dict:
        """In-process device-to-device copy bandwidth (GPU) or single-threaded memcpy (CPU)."""
        import torch

        reps = 10
        ts = []
        if self.cuda:
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
            del a, b
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

    def measure_barrier_landed(self, spec: ItemSpec, items: int, reps: int = 300) -> None:
        """``LoadBarrier.wait`` on tickets that already landed (host time), for 1 and ``items`` items."""
        ep, barrier = self.eps["read"], self.barriers["read"]
        (descs, probes, _), = self.rpc("items", "ours", "barrier", (spec.nbytes, spec.shape, spec.dtype), 1, items)
        refs = _refs(ep, self.info["address"], descs)
        tickets = ep.load(refs)
        barrier.wait(tickets, timeout=60)
        try:
            for n in sorted({1, items}):
                sub = tickets[:n]
                ts = []
                for _ in range(reps + 10):
                    t0 = time.perf_counter()
                    out = barrier.wait(sub)
                    ts.append(time.perf_counter() - t0)
                assert len(out) == n
                self._row("barrier-landed", spec.nbytes * n, n, ts[10:], spec.label)
        finally:
            for t in tickets:
                t.release()

    def close(self) -> None:
        for k, ep in self.eps.items():
            if k == "host" and self.pinned:
                _unpin(ep.pool.arena)
            try:
                ep.close()
            except Exception:
                pass


def _refs(ep, addr: str, descs: list, hold: bool = True) -> list:
    """ItemRefs for ``descs``; with ``hold``, one Hold round trip gives their place (direct READ)."""
    from ec_nixl.tickets import ItemRef

    if not hold:
        return [ItemRef(desc=d, producer=addr) for d in descs]
    states = ep.hold(addr, [d.mm_hash for d in descs], timeout=30)
    now = time.time()
    refs = []
    for d in descs:
        s = states[d.mm_hash]
        if s.status != "ready":
            raise RuntimeError(f"hold of {d.mm_hash} at {addr}: {s.status} {s.detail}")
        refs.append(ItemRef(desc=d, producer=addr, block=s.block, valid_until=now + s.lease_s - 1))
    return refs


def _check(got_u8, probe: tuple, what: str) -> None:
    if _probe(got_u8) != probe:
        raise AssertionError(f"{what}: bytes differ from what the producer wrote ({_probe(got_u8)} != {probe})")


# --- paths -----------------------------------------------------------------------------------


class _Path:
    chunk = 1

    def __init__(self, c: _Consumer, spec: ItemSpec, per_op: int):
        self.c, self.spec, self.per_op = c, spec, per_op
        self.op_bytes = spec.nbytes * per_op
        cap = c.cfg["pool_bytes"] - PROBE_BYTES - BLOCK
        fit = max(1, cap // (blocks(spec.nbytes) * BLOCK * per_op))
        self.chunk = max(1, min(16, fit))
        self.ring_depth = max(0, min(16, fit - 1))  # landed steps kept before release: distinct slots
        self.ring: deque = deque()
        self.tag = f"{self.name}-{spec.label}-{per_op}"

    name = "?"

    def spec_tuple(self):
        return (self.spec.nbytes, self.spec.shape, self.spec.dtype)

    def prepare(self, k: int) -> list:
        return [None] * k

    def op(self, payload) -> float:
        raise NotImplementedError

    def after_chunk(self) -> None:
        pass

    def finish(self) -> None:
        while self.ring:
            for t in self.ring.popleft():
                t.release()

    def keep(self, tickets) -> None:
        self.ring.append(tickets)
        while len(self.ring) > self.ring_depth:
            for t in self.ring.popleft():
                t.release()


class _Ours(_Path):
    """Items written in place in the producer's pool; ours-read pulls, ours-write is pushed."""

    name = "ours-read"
    ep_key, kind, hold = "read", "ours", True

    def prepare(self, k: int) -> list:
        c = self.c
        ep = c.eps[self.ep_key]
        groups = c.rpc("items", self.kind, self.tag, self.spec_tuple(), k, self.per_op)
        alld = [d for descs, _, _ in groups for d in descs]
        refs = _refs(ep, c.info["address"], alld, hold=self.hold)
        out, i = [], 0
        for descs, probes, stage in groups:
            out.append((refs[i : i + len(descs)], probes, stage))
            i += len(descs)
        return out

    def op(self, payload) -> float:
        refs, probes, stage = payload
        ep, barrier = self.c.eps[self.ep_key], self.c.barriers[self.ep_key]
        t0 = time.perf_counter()
        tickets = ep.load(refs)
        out = barrier.wait(tickets, timeout=60)
        dt = time.perf_counter() - t0
        for r, p in zip(refs, probes):
            _check(out[r.mm_hash].reshape(-1).view(_u8()), p, f"{self.name} {r.mm_hash}")
        self.keep(tickets)
        return dt + stage


class _OursWrite(_Ours):
    name = "ours-write"
    ep_key, kind, hold = "write", "ours", False


class _StagedWrite(_Ours):
    name = "staged-write"
    ep_key, kind, hold = "write", "staged", False


def _u8():
    import torch

    return torch.uint8


class _Reference(_Path):
    name = "reference-copy"

    def __init__(self, c, spec, per_op):
        super().__init__(c, spec, per_op)
        self.chunk = 16
        if c.src is None and not hasattr(c, "src_np"):
            raise _Skip(c.ref_note or "no shared source")

    def op(self, payload) -> float:
        c, n = self.c, self.spec.nbytes
        regions = [(c._src_off(n), c._dst_region(n)) for _ in range(self.per_op)]
        if c.cuda:
            import torch

            t0 = time.perf_counter()
            for so, do in regions:
                c.dst[do : do + n].copy_(c.src[so : so + n], non_blocking=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            src = c.src
        else:
            import numpy as np

            t0 = time.perf_counter()
            for so, do in regions:
                np.copyto(c.dst_np[do : do + n], c.src_np[so : so + n])
            dt = time.perf_counter() - t0
            src = c.src_np
        so, do = regions[-1]
        want = (tuple(src[so : so + 8].tolist()), tuple(src[so + n - 8 : so + n].tolist()))
        _check(c.dst[do : do + n], want, "reference-copy")
        return dt


class _HostBounce(_Path):
    name = "host-bounce"

    def __init__(self, c, spec, per_op):
        if not c.cuda:
            raise _Skip("CPU run: degenerates to ours-read plus two host memcpys (run with --device cuda)")
        super().__init__(c, spec, per_op)

    def prepare(self, k: int) -> list:
        c = self.c
        groups = c.rpc("items", "bounce", self.tag, self.spec_tuple(), k, self.per_op)
        alld = [d for descs, _, _ in groups for d in descs]
        refs = _refs(c.eps["host"], c.info["host_address"], alld)
        out, i = [], 0
        for descs, probes, stage in groups:
            out.append((refs[i : i + len(descs)], probes, stage))
            i += len(descs)
        return out

    def op(self, payload) -> float:
        import torch

        c, n = self.c, self.spec.nbytes
        refs, probes, stage = payload
        dsts = [c._dst_region(n) for _ in refs]
        t0 = time.perf_counter()
        tickets = c.eps["host"].load(refs)
        out = c.barriers["host"].wait(tickets, timeout=60)
        for r, do in zip(refs, dsts):
            c.dst[do : do + n].copy_(out[r.mm_hash].reshape(-1).view(torch.uint8), non_blocking=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        for t in tickets:
            t.release()
        for r, do, p in zip(refs, dsts, probes):
            _check(c.dst[do : do + n], p, f"host-bounce {r.mm_hash}")
        return dt + stage


class _File(_Path):
    name = "file"

    def __init__(self, c, spec, per_op):
        super().__init__(c, spec, per_op)
        self.st = _safetensors()

    def prepare(self, k: int) -> list:
        return self.c.rpc("items", "file", self.tag, self.spec_tuple(), k, self.per_op)

    def op(self, payload) -> float:
        import torch

        paths, probes, stage = payload
        dev = "cuda:0" if self.c.cuda else "cpu"
        t0 = time.perf_counter()
        if self.st is not None:
            outs = [self.st.load_file(p, device=dev)["ec_cache"] for p in paths]
        else:
            outs = [torch.load(p, map_location=dev)["ec_cache"] for p in paths]
        _sync(dev)
        dt = time.perf_counter() - t0
        for p, t, pr in zip(paths, outs, probes):
            _check(t.reshape(-1).view(torch.uint8), pr, f"file {os.path.basename(p)}")
            os.unlink(p)
        return dt + stage


class _Ucx(_Path):
    name = "ucx"

    def __init__(self, c, spec, per_op):
        if _ucxx() is None:
            raise _Skip("ucxx not installed")
        super().__init__(c, spec, per_op)
        self.chunk = 16
        if getattr(c, "_ucx", None) is None:
            c._ucx = _UcxClient(c)

    def op(self, payload) -> float:
        return self.c._ucx.fetch(self.spec.nbytes, self.per_op)


class _Skip(Exception):
    pass


_PATHS = {
    "ours-read": _Ours,
    "ours-write": _OursWrite,
    "reference-copy": _Reference,
    "host-bounce": _HostBounce,
    "file": _File,
    "staged-write": _StagedWrite,
    "ucx": _Ucx,
}


# --- raw UCX through ucxx (optional) ----------------------------------------------------------


def _ucx_serve(prod: _Producer) -> int:
    """Start a ucxx listener in a thread of the producer; each request (16 B: nbytes, count) is
    answered with ``count`` tag sends of ``nbytes`` from the source buffer. Returns the port."""
    import asyncio

    import numpy as np

    ucxx = _ucxx()
    box: dict = {}
    ready = threading.Event()

    def run():
        async def handler(ep):
            head = np.empty(2, dtype=np.int64)
            while True:
                try:
                    await ep.recv(head)
                    n, count = int(head[0]), int(head[1])
                    if n <= 0 or count <= 0:
                        return
                    offs = np.empty(count, dtype=np.int64)
                    await ep.recv(offs)
                    for off in offs.tolist():
                        buf = prod.src[off : off + n]
                        await ep.send(buf if prod.cuda else buf.numpy())
                except Exception:
                    return

        async def main():
            lf = ucxx.create_listener(handler)
            box["port"] = lf.port
            ready.set()
            while True:
                await asyncio.sleep(3600)

        try:
            asyncio.run(main())
        except Exception as e:  # pragma: no cover
            box["error"] = repr(e)
            ready.set()

    threading.Thread(target=run, name="ucxx-server", daemon=True).start()
    ready.wait(60)
    if "port" not in box:
        raise RuntimeError(f"ucxx listener failed: {box.get('error', 'timeout')}")
    return box["port"]


class _UcxClient:
    def __init__(self, c: _Consumer):
        import asyncio

        self.c = c
        self.ucxx = _ucxx()
        self.loop = asyncio.new_event_loop()
        port = c.rpc("ucx_start")
        self.ep = self.loop.run_until_complete(self.ucxx.create_endpoint("127.0.0.1", port))

    def fetch(self, nbytes: int, count: int) -> float:
        import numpy as np

        c = self.c
        pairs = [(c._src_off(nbytes), c._dst_region(nbytes)) for _ in range(count)]
        offs = np.array([so for so, _ in pairs], dtype=np.int64)

        async def go():
            await self.ep.send(np.array([nbytes, count], dtype=np.int64))
            await self.ep.send(offs)
            for _, do in pairs:
                buf = c.dst[do : do + nbytes]
                await self.ep.recv(buf if c.cuda else buf.numpy())

        import asyncio

        t0 = time.perf_counter()
        self.loop.run_until_complete(asyncio.wait_for(go(), 60))
        _sync(c.device)
        dt = time.perf_counter() - t0
        src = c.src if c.src is not None else getattr(c, "src_np", None)
        if src is not None:
            so, do = pairs[-1]
            want = (tuple(src[so : so + 8].tolist()), tuple(src[so + nbytes - 8 : so + nbytes].tolist()))
            _check(c.dst[do : do + nbytes], want, "ucx")
        return dt


def _consumer_main(cfg: dict, conn, ctl) -> None:
    _watch_parent(cfg["parent_pid"], cfg.get("tmpdir"))
    _quiet_logs()
    cons = None
    try:
        cons = _Consumer(cfg, conn, ctl)
        import torch

        env = {"device": cfg["device"], "torch": torch.__version__, "pinned": cons.pinned and cons.info["pinned"]}
        if cons.cuda:
            env["gpu"] = torch.cuda.get_device_name(0)
        try:
            import nixl  # type: ignore  # noqa: F401
            from importlib.metadata import version

            env["nixl"] = version("nixl")
        except Exception:
            env["nixl"] = "?"
        cons.send("env", env)
        for spec, per_op in cfg["cases"]:
            spec = ItemSpec(*spec)
            for path in cfg["paths"]:
                label = f"{path} {spec.label}" + (f" x{per_op}" if per_op > 1 else "")
                cons.send("case", label)
                if path in cons.skipped:
                    continue
                try:
                    cons.run_case(path, spec, per_op)
                except _Skip as e:
                    cons.skipped[path] = str(e)
                    cons.send("skip", path, str(e))
                except Exception as e:
                    if path != "ucx":  # optional third-party path: its failure never sinks the run
                        raise
                    cons.skipped[path] = f"ucxx failed: {type(e).__name__}: {e}"
                    cons.send("skip", path, cons.skipped[path])
        if cfg["barrier"]:
            cons.send("case", "barrier-landed")
            spec = ItemSpec(*cfg["barrier"][0])
            cons.measure_barrier_landed(spec, cfg["barrier"][1])
        cons.send("case", "copy bandwidth")
        cons.send("copybw", cons.measure_copy_bw(cfg["copy_bw_bytes"]))
        st = cons.rpc("stats")
        left = cons.rpc("drain", 10.0)
        cons.send("prodstats", {"staging_copies": st["dev"]["counters"]["staging_copies"],
                                "published": st["dev"]["counters"]["published"], "left_bytes": left})
        cons.send("done", None)
    except BaseException as e:
        try:
            ctl.send(("error", f"consumer: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
    finally:
        if cons is not None:
            try:
                cons.close()
            except Exception:
                pass
        try:
            conn.send(("close", ()))
        except Exception:
            pass


# ================================================================================================
# orchestrator


class _Progress:
    """tqdm if importable, else a plain progress line."""

    def __init__(self, total: int):
        self.total, self.n = total, 0
        self.t0 = time.monotonic()
        try:
            from tqdm import tqdm  # type: ignore

            self.bar = tqdm(total=total, unit="case", dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
        except Exception:
            self.bar = None
            print("(tqdm not installed: plain progress lines)", file=sys.stderr)

    def step(self, label: str) -> None:
        if self.n >= self.total:
            self.total += 1
            if self.bar is not None:
                self.bar.total = self.total
        self.n += 1
        if self.bar is not None:
            self.bar.set_description_str(label[:40].ljust(40))
            self.bar.update(1)
        else:
            print(f"[{self.n}/{self.total} {time.monotonic() - self.t0:6.1f}s] {label}", file=sys.stderr, flush=True)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ec-nixl bench",
        description="Time ec-nixl's data plane (post -> barrier passed) against the physical reference and "
                    "the other EC connectors' data paths, between two processes on this machine.")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where pools and items live (default: cuda if available, else cpu)")
    p.add_argument("--sizes", default=None,
                   help=f"item sizes, comma list (default {DEFAULT_SIZES}; 9.8M = 1369x3584 bf16; "
                        f"a CPU run adds {CPU_GOAL_SIZE} for the CPU goal)")
    p.add_argument("--items", type=int, default=None, help="items per step of the batch case (default 32; 0: none)")
    p.add_argument("--batch-size", default="9.8M", help="item size of the batch case (default 9.8M)")
    p.add_argument("--repeats", type=int, default=None, help="most timed repeats per case (default 50)")
    p.add_argument("--min-repeats", type=int, default=None, help="fewest timed repeats per case (default 5)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds aimed at per case; repeats adapt between --min-repeats and --repeats (default 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed operations first, per case (default 3)")
    p.add_argument("--paths", default=",".join(ALL_PATHS), help=f"comma list of {', '.join(ALL_PATHS)}")
    p.add_argument("--pool-bytes", default=None,
                   help="pool size per endpoint (default: the largest step, or 4 of the largest item)")
    p.add_argument("--quick", action="store_true", help="a short run (fewer sizes and repeats)")
    p.add_argument("--nixl-progress-thread", choices=("auto", "on", "off"), default="auto",
                   help="NIXL's own (spinning) progress thread: auto = on for the producer only")
    p.add_argument("--backend-params", default=None, metavar="JSON",
                   help='NIXL UCX backend parameters for every endpoint, e.g. \'{"ucx_error_handling_mode":"none"}\'')
    p.add_argument("--json", default=None, metavar="PATH", help="write results as JSON (schema ec-nixl-bench/1)")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a latency-vs-size PNG (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up (killing both processes) after this many s")
    return p


def _plan(args) -> dict:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ec-nixl bench: --device cuda but torch sees no CUDA device")
    q = args.quick
    sizes_s = args.sizes or ("64K,1M,9.8M" if q else DEFAULT_SIZES)
    sizes = [parse_size(s) for s in sizes_s.split(",") if s.strip()]
    notes = []
    if device == "cpu" and args.sizes is None and not q:
        goal = parse_size(CPU_GOAL_SIZE)
        if all(s.nbytes != goal.nbytes for s in sizes):
            sizes.append(goal)
            notes.append(f"added {CPU_GOAL_SIZE} (the CPU goal's size) to the default sizes")
    sizes.sort(key=lambda s: s.nbytes)
    items = args.items if args.items is not None else (8 if q else 32)
    bspec = parse_size(args.batch_size)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in ALL_PATHS]
    if bad:
        raise SystemExit(f"ec-nixl bench: unknown path(s) {bad}; known: {', '.join(ALL_PATHS)}")
    cases = [((s.nbytes, s.shape, s.dtype, s.label), 1) for s in sizes]
    if items > 1:
        cases.append(((bspec.nbytes, bspec.shape, bspec.dtype, bspec.label), items))
    # Headroom: a producer frees a step's items asynchronously (when its own poll sees the
    # transfer done), so the next step may be created before the last one is gone.
    largest = max([blocks(s.nbytes) * BLOCK * 4 for s in sizes] + [blocks(bspec.nbytes) * BLOCK * max(items, 1) * 2])
    if args.pool_bytes:
        pool = parse_size(args.pool_bytes).nbytes
    else:
        pool = largest + PROBE_BYTES + BLOCK
    pool = -(-pool // BLOCK) * BLOCK
    need = max([blocks(s.nbytes) * BLOCK for s in sizes] + [blocks(bspec.nbytes) * BLOCK * max(items, 1)])
    if pool - PROBE_BYTES - BLOCK < need:
        raise SystemExit(f"ec-nixl bench: --pool-bytes {pool} cannot hold one step of {need} B")
    barrier = ((bspec.nbytes, bspec.shape, bspec.dtype, bspec.label), max(items, 1)) \
        if ("ours-read" in paths) else None
    return {
        "device": device,
        "paths": paths,
        "cases": cases,
        "pool_bytes": pool,
        "src_bytes": pool,
        "repeats": args.repeats if args.repeats is not None else (20 if q else 50),
        "min_repeats": args.min_repeats if args.min_repeats is not None else (3 if q else 5),
        "budget_s": args.budget_s if args.budget_s is not None else (0.3 if q else 2.0),
        "warmup": max(1, args.warmup if args.warmup is not None else (2 if q else 3)),
        "barrier": barrier,
        "copy_bw_bytes": max(blocks(bspec.nbytes) * BLOCK * max(items, 1), 64 << 20),
        "idle_timeout_s": 300.0,
        "notes": notes,
        "backend_params": json.loads(args.backend_params) if args.backend_params else {},
        "nixl_progress_thread": {"on": True, "off": False}.get(args.nixl_progress_thread),
    }


def main(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = _plan(args)
    except ValueError as e:
        print(f"ec-nixl bench: {e}", file=sys.stderr)
        return 2
    load0 = _loadavg()
    tmpdir = tempfile.mkdtemp(prefix="ec-nixl-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cfg["tmpdir"] = tmpdir
    cfg["parent_pid"] = os.getpid()
    print(f"ec-nixl bench: device={cfg['device']} paths={','.join(cfg['paths'])} "
          f"pool={human(cfg['pool_bytes'])}/endpoint repeats<= {cfg['repeats']} (>= {cfg['min_repeats']}, "
          f"~{cfg['budget_s']} s per case) warmup={cfg['warmup']}", flush=True)
    for n in cfg["notes"]:
        print(f"  note: {n}", flush=True)
    ctx = mp.get_context("spawn")
    c_prod, p_cons = ctx.Pipe()
    prod_ctl_r, prod_ctl_w = ctx.Pipe(duplex=False)
    cons_ctl_r, cons_ctl_w = ctx.Pipe(duplex=False)
    prod = ctx.Process(target=_producer_main, args=(cfg, c_prod, prod_ctl_w), name="ec-nixl-bench-producer",
                       daemon=True)
    cons = ctx.Process(target=_consumer_main, args=(cfg, p_cons, cons_ctl_w), name="ec-nixl-bench-consumer",
                       daemon=True)
    total = len(cfg["cases"]) * len(cfg["paths"]) + (1 if cfg["barrier"] else 0) + 1
    bar = None
    state: dict = {"rows": [], "skipped": {}, "env": {}, "copybw": None, "prodstats": None}
    ok = False
    old_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        pass
    try:
        prod.start()
        cons.start()
        for end in (c_prod, p_cons, prod_ctl_w, cons_ctl_w):
            end.close()
        bar = _Progress(total)
        deadline = time.monotonic() + args.timeout
        last = time.monotonic()
        done = False
        readers = [cons_ctl_r, prod_ctl_r]
        while not done:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"benchmark did not finish within --timeout {args.timeout} s")
            if now - last > cfg["idle_timeout_s"]:
                raise TimeoutError(f"no progress for {cfg['idle_timeout_s']} s")
            ready = mpc.wait(readers + [cons.sentinel], timeout=1.0)
            for r in ready:
                if r is cons.sentinel:
                    if not cons_ctl_r.poll():
                        cons.join(1.0)
                        raise RuntimeError(f"consumer process exited (code {cons.exitcode}) before finishing")
                    continue
                try:
                    msg = r.recv()
                except EOFError:
                    if r is cons_ctl_r:
                        raise RuntimeError("consumer closed its control pipe before finishing") from None
                    readers.remove(r)  # the producer finished (or died: the consumer will say so)
                    continue
                last = time.monotonic()
                kind = msg[0]
                if kind == "error":
                    raise RuntimeError(msg[1])
                if kind == "ready":
                    continue
                if kind == "env":
                    state["env"] = msg[1]
                elif kind == "case":
                    bar.step(msg[1])
                elif kind == "row":
                    state["rows"].append(msg[1])
                elif kind == "skip":
                    state["skipped"][msg[1]] = msg[2]
                    bar.write(f"{msg[1]}: skipped: {msg[2]}")
                elif kind == "copybw":
                    state["copybw"] = msg[1]
                elif kind == "prodstats":
                    state["prodstats"] = msg[1]
                elif kind == "done":
                    done = True
        ok = True
    except KeyboardInterrupt:
        print("\nec-nixl bench: interrupted", file=sys.stderr)
    except Exception as e:
        print(f"\nec-nixl bench: FAILED: {e}", file=sys.stderr)
    finally:
        if bar is not None:
            bar.close()
        for p in (cons, prod):
            if p.pid is not None:
                p.join(20 if ok else 0.5)
        for p in (cons, prod):
            if p.pid is not None and p.is_alive():
                p.terminate()
                p.join(5)
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(tmpdir, ignore_errors=True)
        try:
            signal.signal(signal.SIGTERM, old_term)
        except (ValueError, TypeError):
            pass
    state["load"] = (load0, _loadavg())
    if state["rows"]:
        report(state, cfg, args)
    return 0 if ok else 1


# ================================================================================================
# report


def _loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _key(r: dict) -> tuple:
    return (r["bytes"], r["items"])


def report(state: dict, cfg: dict, args) -> None:
    rows = state["rows"]
    env = state["env"]
    ref = {_key(r): r for r in rows if r["path"] == "reference-copy"}
    print()
    head = f"ec-nixl bench — {env.get('gpu') or 'CPU'} — device={cfg['device']} torch {env.get('torch', '?')} " \
           f"nixl {env.get('nixl', '?')} — {datetime.datetime.now().isoformat(timespec='seconds')}"
    print(head)
    l0, l1 = state.get("load", ("?", "?"))
    print(f"{os.cpu_count()} CPUs; load average (1/5/15 min) at start {l0}, at end {l1} — other work on this "
          f"host inflates tails and small-item latencies")
    cols = (f"{'path':<15} {'size':>9} {'items':>5} {'bytes/op':>10} {'p50':>10} {'p99':>10} {'GB/s':>8} "
            f"{'x ref':>7} {'n':>4}")
    print(cols)
    print("-" * len(cols))
    last = None
    for r in sorted(rows, key=lambda r: (r["path"] == "barrier-landed", r["items"], r["bytes"],
                                         ALL_PATHS.index(r["path"]) if r["path"] in ALL_PATHS else 99)):
        k = _key(r)
        if last is not None and k != last:
            print()
        last = k
        rr = ref.get(k)
        ratio = f"{r['p50_us'] / rr['p50_us']:.2f}x" if rr and r["path"] not in ("barrier-landed",) else ""
        gb = f"{r['gbps']:.2f}" if r["path"] != "barrier-landed" else ""
        print(f"{r['path']:<15} {r['label']:>9} {r['items']:>5} {human(r['bytes']):>10} {fmt_us(r['p50_us']):>10} "
              f"{fmt_us(r['p99_us']):>10} {gb:>8} {ratio:>7} {r['n']:>4}")
    for p, why in state["skipped"].items():
        print(f"{p}: skipped: {why}")
    cb = state.get("copybw")
    if cb:
        print(f"copy bandwidth ({cb['kind']}, {human(cb['bytes'])} in one process): {cb['gbps']:.1f} GB/s "
              f"({fmt_us(cb['us'])})")
    ps = state.get("prodstats")
    if ps:
        print(f"producer: {ps['published']} items published, {ps['staging_copies']} staging copies "
              f"(staged-write only), {ps['left_bytes']} B left in its pools after the run")
    if "host-bounce" in cfg["paths"] and cfg["device"] == "cuda" and not env.get("pinned", True):
        print("note: host buffers could not be pinned (cudaHostRegister failed): host-bounce used pageable DRAM")
    print("(sizes are per item; 'x ref' = p50 / reference-copy p50 at the same size and items; staged paths add "
          "the producer's stage time to the consumer's per sample)")
    goals(state, cfg)
    if args.json:
        write_json(args.json, rows, cfg, env)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, rows, cfg, env)


def goals(state: dict, cfg: dict) -> list:
    """Print the project's goals as ratios measured in this run (reported, never asserted)."""
    rows = state["rows"]
    by = {(r["path"], r["bytes"], r["items"]): r for r in rows}
    q = parse_size("9.8M").nbytes
    out = []

    def line(name, value, goal_txt, met, detail):
        if value is None:
            s = f"  {name}: n/a ({detail})"
        else:
            verdict = "met" if met else "MISSED"
            s = f"  {name}: {value} — goal {goal_txt}: {verdict}" + (f" ({detail})" if detail else "")
        out.append(s)
        print(s)

    def best_ours(nbytes, items):
        cands = [by.get((p, nbytes, items)) for p in ("ours-read", "ours-write")]
        cands = [c for c in cands if c]
        return min(cands, key=lambda r: r["p50_us"]) if cands else None

    print("\nGoals (measured in this run; reported, never asserted):")
    gpu = cfg["device"] == "cuda"
    o, r = best_ours(q, 1), by.get(("reference-copy", q, 1))
    if o and r:
        x = o["p50_us"] / r["p50_us"]
        line("9.8 MB post->barrier vs reference-copy", f"{x:.2f}x ({o['path']} {fmt_us(o['p50_us'])} vs "
             f"{fmt_us(r['p50_us'])})", "<= 1.25x" + ("" if gpu else " (an H200 goal)"), x <= 1.25,
             "" if x <= 1.25 else f"over by {(x / 1.25 - 1) * 100:.0f}%")
    else:
        line("9.8 MB post->barrier vs reference-copy", None, "", False, "needs 9.8M, ours-* and reference-copy")
    items = max([r["items"] for r in rows if r["items"] > 1] or [0])
    cb = state.get("copybw")
    ob = None
    if items:
        ob = best_ours(next((r["bytes"] for r in rows if r["items"] == items and r["path"].startswith("ours")), 0),
                       items)
    if ob and cb:
        frac = ob["gbps"] / cb["gbps"]
        line(f"{items}x{human(ob['bytes'] // items)} per step vs {'D2D copy' if gpu else 'memcpy'} bandwidth",
             f"{frac * 100:.0f}% ({ob['path']} {ob['gbps']:.1f} GB/s vs {cb['gbps']:.1f} GB/s)", ">= 70%", frac >= 0.7,
             "" if frac >= 0.7 else f"short by {(0.7 - frac) * 100:.0f} points")
    else:
        line("batch per step vs copy bandwidth", None, "", False, "needs a batch case with ours-*")
    for path, goal in (("host-bounce", 30.0), ("file", 120.0)):
        p = by.get((path, q, 1))
        if o and p:
            x = p["p50_us"] / o["p50_us"]
            line(f"9.8 MB vs {path}", f"{x:.1f}x lower ({fmt_us(o['p50_us'])} vs {fmt_us(p['p50_us'])})",
                 f">= {goal:.0f}x lower", x >= goal, "" if x >= goal else f"short by {(1 - x / goal) * 100:.0f}%")
        else:
            why = state["skipped"].get(path, "not measured")
            line(f"9.8 MB vs {path}", None, "", False, why)
    n16 = parse_size("16M").nbytes
    o16, r16 = best_ours(n16, 1), by.get(("reference-copy", n16, 1))
    if not gpu and o16 and r16:
        x = o16["gbps"] / r16["gbps"]
        line("CPU 16 MiB across processes vs memcpy", f"{x:.2f}x ({o16['path']} {o16['gbps']:.2f} GB/s vs memcpy "
             f"{r16['gbps']:.2f} GB/s)", ">= 0.8x", x >= 0.8,
             "" if x >= 0.8 else f"short by {(1 - x / 0.8) * 100:.0f}%")
    else:
        line("CPU 16 MiB across processes vs memcpy", None, "", False,
             "a CPU-run goal: run with --device cpu and 16M among the sizes")
    bl = [r for r in rows if r["path"] == "barrier-landed"]
    for r in sorted(bl, key=lambda r: r["items"]):
        line(f"barrier pass, {r['items']} landed item(s)", f"{r['p50_us']:.1f} us (p99 {r['p99_us']:.1f} us)",
             "<= 50 us", r["p50_us"] <= 50, "" if r["p50_us"] <= 50 else f"over by {r['p50_us'] - 50:.1f} us")
    return out


def write_json(path: str, rows: list, cfg: dict, env: dict) -> None:
    dev = env.get("gpu") or ("cpu" if cfg["device"] == "cpu" else cfg["device"])
    doc = {
        "schema": SCHEMA,
        "device": dev,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "results": [{"path": r["path"], "bytes": int(r["bytes"]), "items": int(r["items"]),
                     "p50_us": float(r["p50_us"]), "p99_us": float(r["p99_us"]), "gbps": float(r["gbps"])}
                    for r in rows],
    }
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def plot(path: str, rows: list, cfg: dict, env: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"plot skipped: matplotlib not available ({e})")
        return
    fig, ax = plt.subplots(figsize=(9, 6))
    for p in ALL_PATHS:
        pts = sorted((r["bytes"], r["p50_us"], r["items"]) for r in rows if r["path"] == p)
        if not pts:
            continue
        line, = ax.plot([x[0] for x in pts], [x[1] for x in pts], marker="o", label=p)
        for b, us, n in pts:
            if n > 1:
                ax.plot([b], [us], marker="s", markersize=10, mfc="none", color=line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per operation (square: a batch step of several items)")
    ax.set_ylabel("p50 latency, µs (post -> barrier passed / copy + sync)")
    ax.set_title(f"ec-nixl bench — {env.get('gpu') or 'CPU'} ({cfg['device']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
