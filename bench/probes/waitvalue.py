#!/usr/bin/env python3
"""Probe: does a CUDA stream resume when a host-mapped word is written? And does pack() pay off?

An experiment kept outside the product (a device-side load barrier, dropped: bench/RESULTS.md,
"Native fast paths"). It needs no ec-nixl native code: the driver calls go through cuda-bindings,
and the one native helper (a release store + sfence, ``flag_store.c`` beside this file) is built
here with the system C compiler into a temporary folder; without a compiler its variants SKIP.

On 2026-12-02 a cuStreamWaitValue32 on a cuMemHostAlloc'd word never resumed after the host wrote
it (design/device.md). This script tries the wait in ~14 variants of memory x stream x writer x
condition, EACH IN ITS OWN SUBPROCESS, killed --timeout seconds (default 10) after it has
initialised CUDA: a wait that never resumes stalls its stream forever, so only a killed process
gets rid of it. For the variants that work it measures host-store -> event-complete latency
(median of 50), and for comparison the host-side alternative (a thread blocked on a
threading.Event, then stream.wait_event). Last, pack() (one launch) vs per-tensor copy_ for
32 x 9.8 MB and 32 x 64 KiB items.

    python bench/probes/waitvalue.py [--timeout 10] [--json $OUT/probe_waitvalue.json]
                                     [--only A,B,...] [--no-pack] [--no-wait]

Needs torch with CUDA and cuda-bindings; the pack part uses ec_nixl.native (``ec_nixl._C`` where
it was built with CUDA, else only the Python fallback is timed). Prints one table per part and
writes everything to --json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
FLAG_LIB_ENV = "EC_NIXL_PROBE_FLAG_LIB"  # the parent builds the helper, children load it from here

# name: (memory, stream, writer, condition, what it tells)
VARIANTS = {
    "A": ("hostalloc", "legacy", "ctypes", "GEQ", "the 2026-12-02 attempt: torch's default (legacy) stream"),
    "B": ("hostalloc", "torch", "ctypes", "GEQ", "the intended path from Python"),
    "C": ("hostalloc", "nonblocking", "ctypes", "GEQ", "a raw cuStreamCreate(NON_BLOCKING) stream"),
    "D": ("hostalloc", "torch", "ctypes", "EQ", "EQ instead of GEQ"),
    "E": ("hostalloc", "torch", "store", "GEQ", "release store + sfence (flag_store.c)"),
    "F": ("hostalloc", "torch", "devwrite", "GEQ", "GPU writes the sysmem word (cuStreamWriteValue32)"),
    "G": ("hostalloc_wc", "torch", "ctypes", "GEQ", "write-combined word"),
    "H": ("hostalloc_wc", "torch", "store", "GEQ", "write-combined + sfence"),
    "I": ("hostregister", "torch", "ctypes", "GEQ", "cuMemHostRegister'd malloc memory"),
    "J": ("hostregister", "legacy", "ctypes", "GEQ", "registered memory, legacy stream"),
    "K": ("device", "torch", "devwrite", "GEQ", "control: word in VRAM, GPU writer"),
    "N": ("rt_hostalloc", "legacy", "store", "GEQ", "runtime cudaHostAlloc + release store, legacy stream"),
}
ROUNDS = 50


def emit(kind: str, obj) -> None:
    print(f"{kind} {json.dumps(obj)}", flush=True)


def median_us(xs):
    return round(statistics.median(xs) * 1e6, 2) if xs else None


# ============================================================================================
# children (each one a fresh process; they print READY once CUDA is up, then RESULT)


def _cuda_setup():
    import torch
    from cuda.bindings import driver as d

    torch.cuda.init()
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    err, ctx = d.cuCtxGetCurrent()
    if int(ctx) == 0:  # torch bound the primary context to this thread; make sure
        _, dev = d.cuDeviceGet(torch.cuda.current_device())
        _, ctx = d.cuDevicePrimaryCtxRetain(dev)
        d.cuCtxSetCurrent(ctx)
    return torch, d, x


def _ck(res, what):
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise RuntimeError(f"{what}: {err}")
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None


def build_flag_lib(tmpdir: str) -> tuple:
    """Compile flag_store.c into ``tmpdir``: (path, "") or (None, why)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc/gcc)"
    out = os.path.join(tmpdir, "libflag_store.so")
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", out, os.path.join(HERE, "flag_store.c")],
                       capture_output=True, text=True, timeout=120)
    return (out, "") if r.returncode == 0 else (None, f"cc failed: {r.stderr.strip()[-300:]}")


def _flag_lib():
    """The helper the parent built, via ctypes; None when it could not be built."""
    path = os.environ.get(FLAG_LIB_ENV)
    if not path:
        return None
    lib = ctypes.CDLL(path)
    lib.flag_store.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.flag_load.argtypes = [ctypes.c_void_p]
    lib.flag_load.restype = ctypes.c_uint32
    return lib


def child_env() -> None:
    import platform

    torch, d, _ = _cuda_setup()
    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(), "driver": _ck(d.cuDriverGetVersion(), "cuDriverGetVersion")}
    try:
        import cuda.bindings

        out["cuda_bindings"] = cuda.bindings.__version__
    except Exception:
        pass
    _, dev = d.cuDeviceGet(torch.cuda.current_device())
    attrs = {}
    for name in ["CAN_USE_STREAM_MEM_OPS_V1", "CAN_USE_STREAM_WAIT_VALUE_NOR", "CAN_USE_64_BIT_STREAM_MEM_OPS",
                 "CAN_MAP_HOST_MEMORY", "UNIFIED_ADDRESSING", "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM",
                 "PAGEABLE_MEMORY_ACCESS", "PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES", "CAN_FLUSH_REMOTE_WRITES",
                 "HOST_NATIVE_ATOMIC_SUPPORTED", "GPU_DIRECT_RDMA_SUPPORTED", "GPU_DIRECT_RDMA_WRITES_ORDERING",
                 "HOST_REGISTER_SUPPORTED", "MPS_ENABLED"]:
        enum = getattr(d.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name, None)
        if enum is not None:
            err, v = d.cuDeviceGetAttribute(enum, dev)
            attrs[name] = v if int(err) == 0 else f"error {err}"
    out["attributes"] = attrs
    out["flag_store helper"] = "built" if _flag_lib() else "absent (no C compiler)"
    # Host-side suspects: a VM/IOMMU, confidential computing, the driver's stream-memop switch.
    try:
        q = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=20).stdout
        keys = ("confidential", "cc ", "virtualization", "host vgpu", "addressing", "persistence", "mig mode")
        out["nvidia_smi"] = sorted({ln.strip() for ln in q.splitlines() if any(k in ln.lower() for k in keys)})
    except Exception as e:
        out["nvidia_smi"] = f"unavailable: {e}"
    try:
        params = open("/proc/driver/nvidia/params").read().splitlines()
        out["driver_params"] = [p for p in params if any(k in p for k in ("StreamMemOP", "Iommu", "IOMMU", "Confidential"))]
    except OSError as e:
        out["driver_params"] = f"unavailable: {e}"
    try:
        out["iommu_groups"] = len(os.listdir("/sys/kernel/iommu_groups"))
    except OSError:
        out["iommu_groups"] = None
    emit("RESULT", out)


def child_wait(name: str) -> None:
    """One variant: enqueue a wait, a kernel and an event; write the word; see if it resumes."""
    mem, stream_kind, writer, cond, _ = VARIANTS[name]
    torch, d, x = _cuda_setup()
    lib = _flag_lib()
    res = {"variant": name, "status": "error"}
    geq, eq = int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ), int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)
    flag_cond = eq if cond == "EQ" else geq

    def nonblocking_stream():
        return int(_ck(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate"))

    # --- the word ---
    host = dptr = 0
    if writer == "store" and lib is None:
        emit("READY", {})
        emit("RESULT", {"variant": name, "status": "skip", "error": "flag_store helper not built (no C compiler)"})
        return
    if mem in ("hostalloc", "hostalloc_wc"):
        flags = d.CU_MEMHOSTALLOC_DEVICEMAP | d.CU_MEMHOSTALLOC_PORTABLE
        if mem == "hostalloc_wc":
            flags |= d.CU_MEMHOSTALLOC_WRITECOMBINED
        host = int(_ck(d.cuMemHostAlloc(4096, flags), "cuMemHostAlloc"))
        dptr = int(_ck(d.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
    elif mem == "hostregister":  # plain malloc'd (page-aligned) memory, registered afterwards
        libc = ctypes.CDLL(None)
        libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
        p = ctypes.c_void_p()
        assert libc.posix_memalign(ctypes.byref(p), 4096, 4096) == 0
        host = p.value
        _ck(d.cuMemHostRegister(host, 4096, d.CU_MEMHOSTREGISTER_DEVICEMAP | d.CU_MEMHOSTREGISTER_PORTABLE),
            "cuMemHostRegister")
        dptr = int(_ck(d.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
    elif mem == "device":
        dptr = int(_ck(d.cuMemAlloc(4096), "cuMemAlloc"))
    elif mem == "rt_hostalloc":  # the runtime API, as an extension would call it
        from cuda.bindings import runtime as rt

        host = int(_ck(rt.cudaHostAlloc(4096, rt.cudaHostAllocMapped | rt.cudaHostAllocPortable), "cudaHostAlloc"))
        dptr = int(_ck(rt.cudaHostGetDevicePointer(host, 0), "cudaHostGetDevicePointer"))
    if mem == "device":
        _ck(d.cuMemsetD32(d.CUdeviceptr(dptr), 0, 1), "cuMemsetD32")
    else:
        ctypes.memset(host, 0, 4)

    # --- the streams ---
    if stream_kind == "legacy":
        ts = torch.cuda.default_stream()
    elif stream_kind == "torch":
        ts = torch.cuda.Stream()
    else:
        ts = torch.cuda.ExternalStream(nonblocking_stream())
    sp = ts.cuda_stream
    writer_stream = nonblocking_stream()  # for device-side writes and the rescue; never the legacy one
    torch.cuda.synchronize()

    def enqueue_wait(v: int) -> float:
        t = time.perf_counter()
        _ck(d.cuStreamWaitValue32(d.CUstream(sp), d.CUdeviceptr(dptr), v, flag_cond), "cuStreamWaitValue32")
        return time.perf_counter() - t

    def write(v: int) -> None:
        if writer == "ctypes":  # a plain store
            ctypes.c_uint32.from_address(host).value = v
        elif writer == "store":
            lib.flag_store(host, v)
        else:  # devwrite
            _ck(d.cuStreamWriteValue32(d.CUstream(writer_stream), d.CUdeviceptr(dptr), v, 0), "cuStreamWriteValue32")

    def enqueue_work():
        with torch.cuda.stream(ts):
            x.add_(1)
        ev = torch.cuda.Event()
        ev.record(ts)
        return ev

    def spin(ev, budget: float):
        end = time.perf_counter() + budget
        while time.perf_counter() < end:
            if ev.query():
                return time.perf_counter()
        return None

    emit("READY", {})
    # --- functional round ---
    enq = [enqueue_wait(1)]
    ev = enqueue_work()
    time.sleep(0.02)
    res["early"] = bool(ev.query())  # True would mean the wait did not hold the stream
    t0 = time.perf_counter()
    write(1)
    t1 = spin(ev, 3.0)
    if t1 is None:
        res["status"] = "stuck"
        res["word_seen_by_host"] = None if mem == "device" else ctypes.c_uint32.from_address(host).value
        if writer != "devwrite":  # does a GPU-side write of the same word release it?
            _ck(d.cuStreamWriteValue32(d.CUstream(writer_stream), d.CUdeviceptr(dptr), 1, 0), "rescue write")
            res["rescued"] = spin(ev, 1.0) is not None
        emit("RESULT", res)
        return
    res["status"] = "ok"
    res["first_us"] = round((t1 - t0) * 1e6, 1)
    # --- latency: the GPU is parked in the wait when the word is written ---
    lat = []
    for k in range(2, 2 + ROUNDS):
        enq.append(enqueue_wait(k))
        ev = enqueue_work()
        time.sleep(0.002)
        if ev.query():
            res["status"], res["error"] = "error", f"round {k}: ran before the write"
            break
        t0 = time.perf_counter()
        write(k)
        t1 = spin(ev, 2.0)
        if t1 is None:
            res["status"], res["error"] = "stuck", f"round {k} never resumed"
            break
        lat.append(t1 - t0)
    if res["status"] == "ok":
        torch.cuda.synchronize()
    res["lat_us"] = median_us(lat)
    res["lat_p90_us"] = round(sorted(lat)[int(0.9 * len(lat))] * 1e6, 1) if lat else None
    res["enqueue_us"] = median_us(enq)
    res["x_ok"] = res["status"] == "ok" and x.item() == 1 + len(lat)
    emit("RESULT", res)


def child_hostwait() -> None:
    """The host-side alternative: the runner thread blocks on a threading.Event set by another
    thread (as NIXL's DONE would), then orders its stream after the landed data's CUDA event."""
    torch, _, x = _cuda_setup()
    s = torch.cuda.Stream()
    landed = torch.cuda.Event()
    landed.record(torch.cuda.Stream())  # an event that has completed, like the transfer's
    torch.cuda.synchronize()
    emit("READY", {})
    total, wake = [], []
    for _ in range(ROUNDS):
        ready = threading.Event()
        t_set = []

        def nixl_done():
            time.sleep(0.002)
            t_set.append(time.perf_counter())
            ready.set()

        threading.Thread(target=nixl_done).start()
        ready.wait()
        tw = time.perf_counter()
        s.wait_event(landed)
        with torch.cuda.stream(s):
            x.add_(1)
        ev = torch.cuda.Event()
        ev.record(s)
        while not ev.query():
            pass
        t1 = time.perf_counter()
        total.append(t1 - t_set[0])
        wake.append(tw - t_set[0])
    emit("RESULT", {"variant": "host-side", "status": "ok", "lat_us": median_us(total),
                    "lat_p90_us": round(sorted(total)[int(0.9 * len(total))] * 1e6, 1),
                    "wake_us": median_us(wake)})


def child_pack() -> None:
    """pack() (ec_nixl._C: one launch) vs per-tensor copy_ (python): host and device time per step."""
    torch, _, _ = _cuda_setup()
    from ec_nixl import native

    emit("READY", {})
    impls = {"python": native.pack_python}
    if native.NATIVE_WITH_CUDA:
        impls["native"] = native.pack_native
    cases = [("32 x 9.8MB", 32, (1369, 3584), torch.bfloat16, 0), ("32 x 64KiB", 32, (32768,), torch.bfloat16, 0),
             ("32 x 64KiB, dst+1 (unaligned)", 32, (32768,), torch.bfloat16, 1)]
    rows = []
    for label, n, shape, dtype, skew in cases:
        srcs = [torch.randn(shape, device="cuda").to(dtype) for _ in range(n)]
        nbytes = srcs[0].numel() * srcs[0].element_size()
        slot = (nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        offsets = [i * slot + skew for i in range(n)]
        dst = torch.empty(n * slot + 16, dtype=torch.uint8, device="cuda")
        for impl, fn in impls.items():
            dst.zero_()
            fn(srcs, dst, offsets)
            torch.cuda.synchronize()
            ok = all(torch.equal(dst[o : o + nbytes], s.view(-1).view(torch.uint8)) for s, o in zip(srcs, offsets))
            host, dev, wall = [], [], []
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(5):
                fn(srcs, dst, offsets)
            torch.cuda.synchronize()
            for _ in range(ROUNDS):
                e0.record()
                t0 = time.perf_counter()
                fn(srcs, dst, offsets)
                t1 = time.perf_counter()
                e1.record()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                host.append(t1 - t0)
                wall.append(t2 - t0)
                dev.append(e0.elapsed_time(e1) / 1e3)
            kernels = None
            try:  # how many kernels/copies does one call launch?
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn(srcs, dst, offsets)
                    torch.cuda.synchronize()
                kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
            except Exception as e:
                kernels = f"n/a ({type(e).__name__})"
            gbps = n * nbytes / statistics.median(dev) / 1e9
            rows.append({"case": label, "impl": impl, "correct": ok, "host_us": median_us(host),
                         "device_us": median_us(dev), "wall_us": median_us(wall), "GB/s": round(gbps, 1),
                         "gpu_ops": kernels})
    emit("RESULT", rows)


# ============================================================================================
# parent: no CUDA here, only subprocesses


def run_child(args: list[str], timeout: float, init_timeout: float) -> dict:
    """Run one child; kill it `timeout` s after READY (or `init_timeout` s after start)."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    errs: list[str] = []

    def read_stdout():
        for ln in proc.stdout:
            lines.put(ln)
        lines.put(None)

    threading.Thread(target=read_stdout, daemon=True).start()
    threading.Thread(target=lambda: errs.extend(proc.stderr), daemon=True).start()
    t_start = time.monotonic()
    deadline = t_start + init_timeout
    result, ready = None, False
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            proc.wait()
            what = "after READY" if ready else "before READY (CUDA init)"
            return {"status": "TIMEOUT", "error": f"killed {timeout if ready else init_timeout:g} s {what}",
                    **(result or {})}
        if line is None:
            break
        if line.startswith("READY"):
            ready, deadline = True, time.monotonic() + timeout
        elif line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            break
    try:
        proc.wait(timeout=5)  # children os._exit at once; a stuck one is killed here
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if result is None:
        tail = [ln.strip() for ln in errs if ln.strip()]
        return {"status": "error", "error": f"rc {proc.returncode}: {tail[-1] if tail else 'no output'}",
                "stderr_tail": "".join(errs)[-2000:]}
    return result


def fmt_table(rows: list[dict], cols: list[str]) -> str:
    cells = [["" if r.get(c) is None else str(r[c]).replace("\n", " ")[:120] for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds a variant may run after CUDA init")
    ap.add_argument("--init-timeout", type=float, default=90.0, help="seconds for a child's imports + CUDA init")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--json", default="", help="write all results here")
    ap.add_argument("--no-wait", action="store_true", help="skip the device-wait variants")
    ap.add_argument("--no-pack", action="store_true", help="skip the pack measurement")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind = a.child[0]
        try:
            if kind == "env":
                child_env()
            elif kind == "hostwait":
                child_hostwait()
            elif kind == "pack":
                child_pack()
            else:
                child_wait(a.child[1])
        except BaseException as e:  # report, then leave without CUDA teardown like the rest
            import traceback

            traceback.print_exc()
            emit("RESULT", {"status": "error", "error": f"{type(e).__name__}: {e}"})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # never wait for a possibly stuck stream at interpreter teardown

    report: dict = {}
    tmpdir = tempfile.mkdtemp(prefix="ec-nixl-probe-")
    try:
        lib, why = build_flag_lib(tmpdir)
        if lib:
            os.environ[FLAG_LIB_ENV] = lib  # inherited by every child
        else:
            print(f"flag_store helper not built ({why}): variants E, H, N will SKIP")
        return _parent(a, report)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _parent(a, report: dict) -> int:
    env = run_child(["env"], 60, a.init_timeout)
    report["env"] = env
    print("== environment")
    print(json.dumps(env, indent=1))
    if not a.no_wait:
        names = [n for n in (a.only.split(",") if a.only else VARIANTS) if n in VARIANTS]
        rows = []
        for n in names:
            t = time.monotonic()
            r = run_child(["wait", n], a.timeout, a.init_timeout)
            mem, stream, writer, cond, what = VARIANTS[n]
            rows.append({"variant": n, "memory": mem, "stream": stream, "writer": writer, "cond": cond, **r,
                         "what": what})
            print(f"  {n}: {r.get('status')} ({time.monotonic() - t:.1f} s) {r.get('error', '')}", flush=True)
        host = run_child(["hostwait"], 60, a.init_timeout)
        rows.append({"variant": "host", "memory": "-", "stream": "torch", "writer": "threading.Event",
                     "cond": "-", **host, "what": "host-side: thread wakes, then stream.wait_event"})
        report["wait"] = rows
        print("\n== device-side wait. lat_us: host write -> event complete (median, p90 of 50); enqueue_us: host\n"
              "   cost of the wait call; wake_us: host-side path, threading.Event set -> runner awake; rescued:\n"
              "   a stuck wait released by a GPU-side write of the same word (then the GPU never saw the CPU's)")
        print(fmt_table(rows, ["variant", "memory", "stream", "writer", "cond", "status", "early", "first_us",
                               "lat_us", "lat_p90_us", "enqueue_us", "wake_us",
                               "rescued", "x_ok", "error", "what"]))
    if not a.no_pack:
        r = run_child(["pack"], 120, a.init_timeout)
        report["pack"] = r
        print("\n== pack: one launch (native) vs per-tensor copy_ (python); medians of 50, microseconds per step")
        if isinstance(r, list):
            print(fmt_table(r, ["case", "impl", "correct", "host_us", "device_us", "wall_us", "GB/s", "gpu_ops"]))
        else:
            print(r)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwritten: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
