#!/usr/bin/env python3
"""Probe: does a native post-and-poll loop over NIXL's C API pay? (issue 25, part 3)

The nixl wheels ship ``libnixl_capi.so``, a C API over the same ``nixlAgent`` as the Python
bindings. This probe times the same READs between two processes, interleaved in rounds, as:

* ``py-make``   ec-nixl's way: make a request from prepped lists, post, poll, release, through
                the Python bindings as ``transport.nixl_calls`` calls them (= the bench's floor);
* ``py-repost`` requests made beforehand, posted again and polled (Python bindings);
* ``c-make``    the ``py-make`` steps in a C loop over the C API (``capi_loop.c``, no Python
                between the calls);
* ``c-repost``  the ``py-repost`` steps in that C loop;
* ``ctypes-make`` the ``c-make`` calls made one by one from Python through ctypes (what a
                transport over the C API without a compiled loop would pay).

Each process has one agent per API (no progress thread, as the bench's raw agents), both over
one buffer registered twice; both prep one descriptor per slot, so ``--items`` consecutive slots
are one request. The target drives both agents (``get_notifs``) until told to stop. The first
operation's bytes are checked against the source. The C loop is built here with the system C
compiler into a temporary folder; without one, or without the library, its cases SKIP.

    python bench/probes/capi_post.py [--device cpu|cuda] [--size 9.8M] [--items 1] [--n 400]
                                     [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
VP, SZ, I32P = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)
READ, MEM = 0, {"DRAM": 0, "VRAM": 1}
SUCCESS, IN_PROG = 0, 1
TIMEOUT_S = 30.0


class AgentConfig(ctypes.Structure):
    """``nixl_capi_agent_config_t`` (nixl 1.5 C API)."""
    _fields_ = [("enable_prog_thread", ctypes.c_bool), ("enable_listen_thread", ctypes.c_bool),
                ("listen_port", ctypes.c_int), ("thread_sync", ctypes.c_int), ("num_workers", ctypes.c_uint),
                ("pthr_delay_us", ctypes.c_uint64), ("lthr_delay_us", ctypes.c_uint64),
                ("capture_telemetry", ctypes.c_bool)]


def capi_library() -> ctypes.CDLL:
    """The C API of the nixl wheel that ``import nixl`` loads (same libnixl as its bindings)."""
    import nixl._api as api

    from ec_nixl.handoff import capi_library as find_capi  # the product's look-up (same wheel, same lib)

    lib, why = find_capi(api)
    if lib is None:
        raise FileNotFoundError(why)
    sigs = {
        "nixl_capi_create_configured_agent": [ctypes.c_char_p, ctypes.POINTER(AgentConfig), ctypes.POINTER(VP)],
        "nixl_capi_get_plugin_params": [VP, ctypes.c_char_p, ctypes.POINTER(VP), ctypes.POINTER(VP)],
        "nixl_capi_create_backend": [VP, ctypes.c_char_p, VP, ctypes.POINTER(VP)],
        "nixl_capi_create_reg_dlist": [ctypes.c_int, ctypes.POINTER(VP)],
        "nixl_capi_reg_dlist_add_desc": [VP, ctypes.c_size_t, SZ, ctypes.c_uint64, VP, SZ],
        "nixl_capi_register_mem": [VP, VP, VP],
        "nixl_capi_get_local_md": [VP, ctypes.POINTER(VP), ctypes.POINTER(SZ)],
        "nixl_capi_load_remote_md": [VP, ctypes.c_char_p, SZ, ctypes.POINTER(ctypes.c_char_p)],
        "nixl_capi_create_xfer_dlist": [ctypes.c_int, ctypes.POINTER(VP)],
        "nixl_capi_xfer_dlist_add_desc": [VP, ctypes.c_size_t, SZ, ctypes.c_uint64],
        "nixl_capi_prep_xfer_dlist": [VP, ctypes.c_char_p, VP, ctypes.POINTER(VP), VP],
        "nixl_capi_make_xfer_req": [VP, ctypes.c_int, VP, I32P, SZ, VP, I32P, SZ, ctypes.POINTER(VP), VP],
        "nixl_capi_post_xfer_req": [VP, VP, VP],
        "nixl_capi_get_xfer_status": [VP, VP],
        "nixl_capi_release_xfer_req": [VP, VP],
        "nixl_capi_destroy_xfer_req": [VP],
        "nixl_capi_create_notif_map": [ctypes.POINTER(VP)],
        "nixl_capi_get_notifs": [VP, VP, VP],
        "nixl_capi_notif_map_clear": [VP],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def ok(st: int, what: str) -> None:
    if st != SUCCESS:
        raise RuntimeError(f"NIXL C API {what} returned {st}")


class CAgent:
    """One C API agent over ``buf`` (UCX backend, no progress thread)."""

    def __init__(self, lib, name: str, mem: str, base: int, size: int, dev: int):
        self.lib, self.mem, self.dev = lib, mem, dev
        self.agent, mems, params, backend = VP(), VP(), VP(), VP()
        cfg = AgentConfig(False, False, 0, 0, 1, 0, 0, False)
        ok(lib.nixl_capi_create_configured_agent(name.encode(), ctypes.byref(cfg), ctypes.byref(self.agent)), "create")
        ok(lib.nixl_capi_get_plugin_params(self.agent, b"UCX", ctypes.byref(mems), ctypes.byref(params)), "params")
        ok(lib.nixl_capi_create_backend(self.agent, b"UCX", params, ctypes.byref(backend)), "backend")
        reg = VP()
        ok(lib.nixl_capi_create_reg_dlist(MEM[mem], ctypes.byref(reg)), "reg dlist")
        ok(lib.nixl_capi_reg_dlist_add_desc(reg, base, size, dev, None, 0), "reg desc")
        ok(lib.nixl_capi_register_mem(self.agent, reg, None), "register")
        self.notifs = VP()
        ok(lib.nixl_capi_create_notif_map(ctypes.byref(self.notifs)), "notif map")

    def metadata(self) -> bytes:
        data, n = VP(), SZ()
        ok(self.lib.nixl_capi_get_local_md(self.agent, ctypes.byref(data), ctypes.byref(n)), "md")
        return ctypes.string_at(data, n.value)

    def connect(self, md: bytes) -> str:
        name = ctypes.c_char_p()
        ok(self.lib.nixl_capi_load_remote_md(self.agent, md, len(md), ctypes.byref(name)), "load md")
        return name.value.decode()

    def prep(self, agent_name: str, base: int, stride: int, count: int, dev: int) -> VP:
        dl, h = VP(), VP()
        ok(self.lib.nixl_capi_create_xfer_dlist(MEM[self.mem], ctypes.byref(dl)), "xfer dlist")
        for k in range(count):
            ok(self.lib.nixl_capi_xfer_dlist_add_desc(dl, base + k * stride, stride, dev), "xfer desc")
        ok(self.lib.nixl_capi_prep_xfer_dlist(self.agent, agent_name.encode(), dl, ctypes.byref(h), None), "prep")
        return h

    def progress(self) -> None:
        self.lib.nixl_capi_get_notifs(self.agent, self.notifs, None)
        self.lib.nixl_capi_notif_map_clear(self.notifs)


class PyAgent:
    """One agent of the Python bindings over the same buffer, called as ec-nixl's transport calls it."""

    def __init__(self, name: str, mem: str, base: int, size: int, dev: int):
        from nixl._api import nixl_agent, nixl_agent_config

        from ec_nixl import transport

        self.agent = nixl_agent(name, nixl_agent_config(backends=[], enable_prog_thread=False))
        self.agent.create_backend("UCX", {})
        self.mem = mem
        self.reg = self.agent.register_memory([(base, size, dev, "")], mem)
        self.post, self.status = transport.nixl_calls(self.agent)

    def prep(self, agent_name: str, base: int, stride: int, count: int, dev: int):
        import numpy as np

        return self.agent.prep_xfer_dlist(agent_name, np.array([[base, stride, dev, stride, count]], dtype=np.uint64),
                                          self.mem)


def buffer(device: str, nbytes: int, fill: bool):
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if fill:
        buf.copy_((torch.arange(nbytes, device=device) % 251).to(torch.uint8))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return buf, ("VRAM" if device.startswith("cuda") else "DRAM"), (torch.cuda.current_device() if
                                                                    device.startswith("cuda") else 0)


def target(conn, device: str, nbytes: int) -> None:
    """The producer: a filled buffer under both agents, driven until the consumer says stop."""
    buf, mem, dev = buffer(device, nbytes, fill=True)
    lib = capi_library()
    c = CAgent(lib, f"capi-target-{os.getpid()}", mem, buf.data_ptr(), nbytes, dev)
    py = PyAgent(f"py-target-{os.getpid()}", mem, buf.data_ptr(), nbytes, dev)
    conn.send({"c_md": c.metadata(), "py_md": py.agent.get_agent_metadata(), "base": buf.data_ptr(), "dev": dev,
               "head": buf[:4096].cpu().numpy().tobytes()})  # bytes: a tensor sent would move buf
    i = 0
    while True:
        c.progress()
        py.agent.get_new_notifs()
        i += 1
        if i % 256 == 0 and conn.poll(0):
            conn.recv()
            break
    conn.send("bye")


def build_loop() -> tuple[str, str]:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "", "no C compiler (cc/gcc)"
    out = os.path.join(tempfile.mkdtemp(prefix="capi-loop-"), "capi_loop.so")
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", out, os.path.join(HERE, "capi_loop.c")],
                       capture_output=True, text=True)
    return (out, "") if r.returncode == 0 else ("", f"cc failed: {r.stderr.strip()[-300:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="9.8M")
    ap.add_argument("--items", type=int, default=1, help="consecutive slots per READ (one request)")
    ap.add_argument("--n", type=int, default=400, help="operations per case and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    from ec_nixl.bench.units import parse_size, page_round

    size = parse_size(a.size).nbytes
    stride = page_round(size)
    ring = max(2, 64 // a.items) if a.device.startswith("cuda") else max(2, 8 // a.items)
    slots = ring * a.items
    nbytes = slots * stride
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, a.device, nbytes), daemon=True)
    proc.start()
    info = parent.recv()
    buf, mem, dev = buffer(a.device, nbytes, fill=False)
    lib = capi_library()
    c = CAgent(lib, f"capi-init-{os.getpid()}", mem, buf.data_ptr(), nbytes, dev)
    py = PyAgent(f"py-init-{os.getpid()}", mem, buf.data_ptr(), nbytes, dev)
    c_peer = c.connect(info["c_md"])
    py_peer = py.agent.add_remote_agent(info["py_md"])
    py_peer = py_peer.decode() if isinstance(py_peer, bytes) else str(py_peer)
    c_local, c_remote = c.prep("", buf.data_ptr(), stride, slots, dev), c.prep(c_peer, info["base"], stride, slots,
                                                                                  info["dev"])
    py_local = py.prep("NIXL_INIT_AGENT", buf.data_ptr(), stride, slots, dev)
    py_remote = py.prep(py_peer, info["base"], stride, slots, info["dev"])
    idx_rows = [list(range(k * a.items, (k + 1) * a.items)) for k in range(ring)]
    idx = (ctypes.c_int * (slots))(*[i for row in idx_rows for i in row])
    fns = (VP * 5)(*[ctypes.cast(getattr(lib, f), VP) for f in (
        "nixl_capi_make_xfer_req", "nixl_capi_post_xfer_req", "nixl_capi_get_xfer_status",
        "nixl_capi_release_xfer_req", "nixl_capi_destroy_xfer_req")])
    loop_path, why = build_loop()
    loop = ctypes.CDLL(loop_path) if loop_path else None
    if loop is not None:
        loop.capi_time_ops.restype = ctypes.c_int
        loop.capi_time_ops.argtypes = [VP * 5, VP, ctypes.c_int, VP, VP, I32P, SZ, SZ, ctypes.c_int, ctypes.c_int,
                                       ctypes.POINTER(VP), ctypes.c_double, ctypes.POINTER(ctypes.c_double)]
    py_reqs = [py.post("READ", py_local, row, py_remote, row, b"")[0] for row in idx_rows]
    for h in py_reqs:  # the first posts above were real: wait for them
        while py.status(h) == "PROC":
            pass
    c_reqs = (VP * ring)()
    for k in range(ring):
        at, r = ctypes.cast(ctypes.byref(idx, k * a.items * 4), I32P), VP()
        ok(lib.nixl_capi_make_xfer_req(c.agent, READ, c_local, at, a.items, c_remote, at, a.items, ctypes.byref(r),
                                       None), "make (repost)")
        c_reqs[k] = r
    bind = py.agent.agent

    def run_py(n: int, remake: bool) -> list[float]:
        out, post, status = [], py.post, py.status
        for i in range(n):
            row = idx_rows[i % ring]
            t0 = time.perf_counter()
            if remake:
                h, st = post("READ", py_local, row, py_remote, row, b"")
            else:
                h = py_reqs[i % ring]
                st = "DONE" if bind.postXferReq(h._handle, b"").value == 0 else "PROC"
            while st == "PROC":
                st = status(h)
            out.append((time.perf_counter() - t0) * 1e6)
            if st != "DONE":
                raise RuntimeError(f"python READ ended {st}")
            if remake:
                py.agent.release_xfer_handle(h)
        return out

    def run_c(n: int, remake: bool) -> list[float]:
        out = (ctypes.c_double * n)()
        st = loop.capi_time_ops(fns, c.agent, READ, c_local, c_remote, idx, a.items, ring, n, int(remake), c_reqs,
                                TIMEOUT_S * 1e6, out)
        if st != 0:
            raise RuntimeError(f"C loop ended with {st}")
        return list(out)

    def run_ctypes(n: int) -> list[float]:
        out, req = [], VP()
        make, post, status = lib.nixl_capi_make_xfer_req, lib.nixl_capi_post_xfer_req, lib.nixl_capi_get_xfer_status
        rows = [ctypes.cast(ctypes.byref(idx, k * a.items * 4), I32P) for k in range(ring)]
        for i in range(n):
            at = rows[i % ring]
            t0 = time.perf_counter()
            ok(make(c.agent, READ, c_local, at, a.items, c_remote, at, a.items, ctypes.byref(req), None), "make")
            st = post(c.agent, req, None)
            while st == IN_PROG:
                st = status(c.agent, req)
            out.append((time.perf_counter() - t0) * 1e6)
            ok(st, "READ")
            lib.nixl_capi_release_xfer_req(c.agent, req)
            lib.nixl_capi_destroy_xfer_req(req)
        return out

    cases = {"py-make": lambda n: run_py(n, True), "py-repost": lambda n: run_py(n, False),
             "ctypes-make": run_ctypes}
    if loop is not None:
        cases |= {"c-make": lambda n: run_c(n, True), "c-repost": lambda n: run_c(n, False)}
    else:
        print(f"c-make, c-repost: SKIP ({why})")
    for name, run in cases.items():  # warm-up, and the bytes of slot 0 checked
        buf.zero_()
        run(ring)
        if buf[:4096].cpu().numpy().tobytes() != info["head"]:
            raise RuntimeError(f"{name}: the READ did not bring the source's bytes: {buf[:8].tolist()} "
                               f"vs {list(info['head'][:8])}")
    times: dict[str, list[float]] = {k: [] for k in cases}
    p50s: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.rounds):
        for name, run in cases.items():
            t = run(a.n)
            times[name] += t
            p50s[name].append(statistics.median(t))
    parent.send("stop")
    parent.recv()
    proc.join(10)
    ref = statistics.median(times["py-make"])
    print(f"{a.device} READ of {a.items} x {a.size} ({a.items * size / 1e6:.1f} MB), {a.rounds} rounds x {a.n}:")
    print(f"{'case':12s} {'p50 us':>8s} {'p10':>7s} {'p90':>7s} {'÷ py-make':>9s}  round p50s")
    rows = {}
    for name, t in times.items():
        q = statistics.quantiles(t, n=10)
        rows[name] = {"p50_us": statistics.median(t), "p10_us": q[0], "p90_us": q[-1], "round_p50s": p50s[name]}
        print(f"{name:12s} {statistics.median(t):8.1f} {q[0]:7.1f} {q[-1]:7.1f} {statistics.median(t) / ref:9.2f}  "
              + " ".join(f"{x:.1f}" for x in p50s[name]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "size": size, "items": a.items, "n": a.n, "rounds": a.rounds,
                       "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
