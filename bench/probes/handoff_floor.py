#!/usr/bin/env python3
"""Probe: where should the per-item hand-off run? (issue 40, part 1)

In a serving process the publishing thread goes on in Python after each encoder step, and
today's hand-off (a Python I/O thread of that process) waits for its interpreter lock. Issue 40
puts two designs on the table; this times the floor of each, in the same run, against the
design of today in miniature:

* ``py-thread``  today's: a Python thread of the publishing process, asleep until the publish
                 wakes it (``threading.Event``), then posts the WRITE through NIXL's bindings (as
                 ``transport.nixl_calls`` does) and polls it. The publisher runs with the GIL
                 switch interval ec-nixl sets today (``--py-gil-switch-ms``, 0.2).
* ``native``     design (a): a pthread of the publishing process (``handoff_loop.c``) over NIXL's
                 C API (``libnixl_capi.so``), which never takes the GIL: the publish is one atomic
                 store (and a futex wake when the thread sleeps). The WRITE is made, posted and
                 polled in C; on CUDA the thread first waits for the publisher's copy
                 (``cuEventQuery``).
* ``agent``      design (b): a per-rank agent process owning the NIXL agent and the pool (VRAM
                 exported to the publisher by CUDA IPC, DRAM by shared memory): the publisher
                 copies into its slot there, records an interprocess event (CUDA), stores the
                 sequence number in a shared word and writes a byte to a pipe. The agent is
                 plain Python (its own interpreter), as ec-nixl's endpoint would move there.

``-spin`` variants spin (bounded, ``--spin-budget-ms``) for the next publish while one is expected,
as a loop may while a consumer's Push is parked; ``-sleep`` variants sleep until woken. These run
with CPython's default switch interval (5 ms): they must not need a process-wide setting.

Each operation: the publisher sleeps ``--gap-ms`` (its loop went idle), copies item k into pool
slot k (the publish), signals, then either waits (``idle``) or runs Python for ``--spin-ms``
(``busy``: the runner goes on after an encoder step). The consumer (its own process) spins on
NIXL notifications and stamps the arrival: **landed** = publish began -> notification seen;
**answered** = publish began -> the hand-off saw it; **posted** = -> the post returned. All
clocks are CLOCK_MONOTONIC of one host. ``copy`` is the publisher's copy of the same item alone
(synchronized), after the same gap. The consumer's slots are checked against what was written
last into each after every case. The C loop is built here with the system C compiler; without
one, or without the library, the native cases SKIP.

    python bench/probes/handoff_floor.py [--device cpu|cuda] [--size 9.8M] [--n 100] [--rounds 2]
        [--spin-ms 2] [--gap-ms 2] [--consumer-poll-us 0] [--cases py-thread,native-spin,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from capi_post import VP, SZ, CAgent, capi_library, ok  # noqa: E402  (the C API's signatures)

SLOTS = 8
TIMEOUT_S = 30.0
CASES = ("py-thread", "native-spin", "native-sleep", "agent-spin", "agent-sleep")
DEFAULT_SWITCH_S = 0.005  # CPython's
PENDING = -99999  # a native operation's result before its end


def mono() -> float:
    return time.monotonic()


def pattern(k: int, nbytes: int, device: str):
    import torch

    return ((torch.arange(nbytes, device=device) + 17 * k) % 251).to(torch.uint8)


def py_agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    a = nixl_agent(name, nixl_agent_config(backends=[], enable_prog_thread=False))
    a.create_backend("UCX", {})
    return a


def peer_name(n) -> str:
    return n.decode() if isinstance(n, (bytes, bytearray)) else str(n)


def ring_dlist(agent, who: str, base: int, stride: int, dev: int, mem: str):
    import numpy as np

    return agent.prep_xfer_dlist(who, np.array([[base, stride, dev, stride, SLOTS]], dtype=np.uint64), mem)


def mem_of(device: str) -> tuple[str, int]:
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(0)
        return "VRAM", 0
    return "DRAM", 0


# ---------------------------------------------------------------- the consumer (its own process)

def consumer(conn, device: str, stride: int, poll_us: float) -> None:
    """Polls for notifications (spinning, or sleeping ``poll_us`` between polls: on a host with
    few cores a spinning consumer takes the core the hand-off needs); acks each (seq, time seen)
    to the publisher; checks slots on demand."""
    import torch

    mem, dev = mem_of(device)
    buf = torch.zeros(SLOTS * stride, dtype=torch.uint8, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    a = py_agent(f"hf-consumer-{os.getpid()}")
    reg = a.register_memory([(buf.data_ptr(), buf.numel(), dev, "")], mem)
    conn.send({"md": a.get_agent_metadata(), "base": buf.data_ptr(), "dev": dev})
    for md in conn.recv():  # the initiators' metadata
        a.add_remote_agent(md)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "check":  # {slot: (k, nbytes)}: slot holds pattern k
            bad = [s for s, (k, nbytes) in msg[1].items()
                   if not torch.equal(buf[s * stride: s * stride + nbytes], pattern(k, nbytes, device))]
            buf.zero_()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            conn.send(bad)
            continue
        _, n = msg  # a case of n operations: ack each notification as it comes
        seen = 0
        deadline = mono() + TIMEOUT_S * max(1, n)
        while seen < n and mono() < deadline:
            notes = a.get_new_notifs()
            if not notes:
                if poll_us:
                    time.sleep(poll_us * 1e-6)
                continue
            t = mono()
            for ms in notes.values():
                for m in ms:
                    conn.send((int(m), t))
                    seen += 1
    a.deregister_memory(reg)


# ---------------------------------------------------------------- design (b): the agent process

def agent_process(conn, wake, device: str, stride: int) -> None:
    """Owns the pool (shared with the publisher) and a NIXL agent; WRITEs slot s % SLOTS of each
    publish to the consumer. Plain Python in its own interpreter."""
    import numpy as np
    import torch
    from multiprocessing import shared_memory

    cuda = device.startswith("cuda")
    mem, dev = mem_of(device)
    word = shared_memory.SharedMemory(create=True, size=64)
    flag = np.ndarray((8,), dtype=np.int64, buffer=word.buf)
    flag[:] = 0
    if cuda:
        pool = torch.zeros(SLOTS * stride, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        shm, share = None, pool
    else:
        shm = shared_memory.SharedMemory(create=True, size=SLOTS * stride)
        pool = torch.frombuffer(shm.buf, dtype=torch.uint8)
        pool.zero_()
        share = shm.name
    a = py_agent(f"hf-agent-{os.getpid()}")
    reg = a.register_memory([(pool.data_ptr(), pool.numel(), dev, "")], mem)
    from ec_nixl import transport

    post, status = transport.nixl_calls(a)
    conn.send({"md": a.get_agent_metadata(), "pool": share, "word": word.name})
    hello = conn.recv()
    peer = peer_name(a.add_remote_agent(hello["consumer_md"]))
    local = ring_dlist(a, "NIXL_INIT_AGENT", pool.data_ptr(), stride, dev, mem)
    remote = ring_dlist(a, peer, hello["consumer_base"], stride, hello["consumer_dev"], mem)
    event = torch.cuda.Event.from_ipc_handle(0, hello["event"]) if cuda else None
    while True:
        msg = conn.recv()
        if msg is None:
            break
        _, n, spin_s = msg  # a case: n publishes; spin up to spin_s for each before sleeping
        stamps, last = [], int(flag[0])
        conn.send("ready")
        for _ in range(n):
            until = mono() + spin_s
            while int(flag[0]) == last and mono() < until:
                pass
            while int(flag[0]) == last:
                wake.recv_bytes()
            s = int(flag[0])
            last = s
            t_seen = mono()
            if event is not None:
                event.synchronize()
            k = s % SLOTS
            h, st = post("WRITE", local, [k], remote, [k], str(s).encode())
            t_posted = mono()
            while st == "PROC":
                st = status(h)
            t_done = mono()
            a.release_xfer_handle(h)
            stamps.append((s, t_seen, t_posted, t_done, st))
        while wake.poll(0):
            wake.recv_bytes()
        conn.send(stamps)
    a.release_dlist_handle(local)
    a.release_dlist_handle(remote)
    a.deregister_memory(reg)
    del pool
    for m in (shm, word):
        if m is not None:
            m.close()
            m.unlink()


# ---------------------------------------------------------------- the publisher (this process)

class Publisher:
    def __init__(self, a, nbytes: int, stride: int):
        import torch

        self.a, self.nbytes, self.stride = a, nbytes, stride
        self.cuda = a.device.startswith("cuda")
        self.mem, self.dev = mem_of(a.device)
        self.src = [pattern(k, nbytes, a.device) for k in range(SLOTS)]
        self.pool = torch.zeros(SLOTS * stride, dtype=torch.uint8, device=a.device)
        self.event = torch.cuda.Event() if self.cuda else None
        self.ipc_event = torch.cuda.Event(interprocess=True) if self.cuda else None
        self.last_written: dict[int, int] = {}  # consumer slot -> pattern k last written there
        self.stamps: dict[int, list] = {}  # seq -> [t_pub, t_seen, t_posted, t_done, status]
        self.seq = 0

    def slot(self, pool, k: int):
        return pool[k * self.stride: k * self.stride + self.nbytes]

    def publish(self, pool, k: int, event) -> float:
        """Copy item k into its slot (the publish); returns when it began."""
        t = mono()
        self.slot(pool, k).copy_(self.src[k])
        if event is not None:
            event.record()
        return t

    def busy(self, seconds: float) -> None:
        """The runner goes on in Python after its encoder step."""
        until, x = time.perf_counter() + seconds, 0
        while time.perf_counter() < until:
            x += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="9.8M")
    ap.add_argument("--n", type=int, default=100, help="operations per case and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spin-ms", type=float, default=2.0, help="busy: the publisher runs Python this long after")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="the publisher idles this long before each publish")
    ap.add_argument("--spin-budget-ms", type=float, default=20.0,
                    help="-spin cases: spin this long for the next publish before sleeping")
    ap.add_argument("--py-gil-switch-ms", type=float, default=0.2, help="the switch interval of the py-thread cases")
    ap.add_argument("--consumer-poll-us", type=float, default=0.0,
                    help="the consumer sleeps this long between notification polls (0: it spins)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    import torch
    from multiprocessing import shared_memory
    import numpy as np

    from ec_nixl import transport
    from ec_nixl.bench.units import page_round, parse_size

    cases = [c for c in a.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    nbytes = parse_size(a.size).nbytes
    stride = page_round(nbytes)
    ctx = mp.get_context("spawn")
    pub = Publisher(a, nbytes, stride)
    # the consumer and the agent process
    c_conn, c_child = ctx.Pipe()
    cons = ctx.Process(target=consumer, args=(c_child, a.device, stride, a.consumer_poll_us), daemon=True)
    cons.start()
    chello = c_conn.recv()
    g_conn, g_child = ctx.Pipe()
    wake_r, wake_w = ctx.Pipe(duplex=False)
    agp = ctx.Process(target=agent_process, args=(g_child, wake_r, a.device, stride), daemon=True)
    agp.start()
    ghello = g_conn.recv()
    # py-thread's agent (bindings) and native's agent (C API), both over this process's pool
    pya = py_agent(f"hf-pub-py-{os.getpid()}")
    pya.register_memory([(pub.pool.data_ptr(), pub.pool.numel(), pub.dev, "")], pub.mem)
    lib = capi_library()
    for name, args in {"nixl_capi_create_opt_args": [ctypes.POINTER(VP)],
                       "nixl_capi_opt_args_set_has_notif": [VP, ctypes.c_bool],
                       "nixl_capi_opt_args_set_notif_msg": [VP, VP, SZ]}.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    ca = CAgent(lib, f"hf-pub-c-{os.getpid()}", pub.mem, pub.pool.data_ptr(), pub.pool.numel(), pub.dev)
    c_conn.send([pya.get_agent_metadata(), ca.metadata(), ghello["md"]])
    if pub.cuda:  # (torch makes the interprocess event at its first record)
        pub.ipc_event.record()
        torch.cuda.synchronize()
    g_conn.send({"consumer_md": chello["md"], "consumer_base": chello["base"], "consumer_dev": chello["dev"],
                 "event": pub.ipc_event.ipc_handle() if pub.cuda else None})
    if pub.cuda:
        agent_pool = ghello["pool"]
        word = shared_memory.SharedMemory(name=ghello["word"])
    else:
        pool_shm = shared_memory.SharedMemory(name=ghello["pool"])
        agent_pool = torch.frombuffer(pool_shm.buf, dtype=torch.uint8)
        word = shared_memory.SharedMemory(name=ghello["word"])
    flag = np.ndarray((8,), dtype=np.int64, buffer=word.buf)

    peer = peer_name(pya.add_remote_agent(chello["md"]))
    py_local = ring_dlist(pya, "NIXL_INIT_AGENT", pub.pool.data_ptr(), stride, pub.dev, pub.mem)
    py_remote = ring_dlist(pya, peer, chello["base"], stride, chello["dev"], pub.mem)
    py_post, py_status = transport.nixl_calls(pya)

    # ---- py-thread: today's hand-off in miniature
    wake_py, state = threading.Event(), {"seq": 0, "stop": False}

    def py_loop() -> None:
        while True:
            wake_py.wait()
            wake_py.clear()
            if state["stop"]:
                return
            s = state["seq"]
            rec = pub.stamps[s]
            rec[1] = mono()
            if pub.event is not None:
                pub.event.synchronize()
            k = s % SLOTS
            h, st = py_post("WRITE", py_local, [k], py_remote, [k], str(s).encode())
            rec[2] = mono()
            while st == "PROC":
                st = py_status(h)
            rec[3] = mono()
            pya.release_xfer_handle(h)
            rec[4] = st

    py_thread = threading.Thread(target=py_loop, daemon=True)
    py_thread.start()

    # ---- native: the C loop
    so, why = build_native()
    ring = (ctypes.c_int * SLOTS)(*range(SLOTS))
    cap = 1 << 16
    n_seen, n_posted, n_done = (ctypes.c_double * cap)(), (ctypes.c_double * cap)(), (ctypes.c_double * cap)()
    n_res = (ctypes.c_int * cap)()
    if so:
        native = ctypes.CDLL(so)
        native.handoff_loop_start.restype = VP
        native.handoff_loop_start.argtypes = [VP * 6, VP, VP, VP, VP, ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                              VP, VP, VP, VP, ctypes.c_double, ctypes.c_int,
                                              ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double),
                                              ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int)]
        for f in ("handoff_loop_publish", "handoff_loop_arm"):
            getattr(native, f).argtypes, getattr(native, f).restype = [VP, ctypes.c_uint32], None
        native.handoff_loop_stop.argtypes, native.handoff_loop_stop.restype = [VP], None
        c_peer = ca.connect(chello["md"])
        c_local = ca.prep("", pub.pool.data_ptr(), stride, SLOTS, pub.dev)
        c_remote = ca.prep(c_peer, chello["base"], stride, SLOTS, chello["dev"])
        opt = VP()
        ok(lib.nixl_capi_create_opt_args(ctypes.byref(opt)), "opt args")
        ok(lib.nixl_capi_opt_args_set_has_notif(opt, True), "has notif")
        fns = (VP * 6)(*[ctypes.cast(getattr(lib, f), VP) for f in (
            "nixl_capi_make_xfer_req", "nixl_capi_post_xfer_req", "nixl_capi_get_xfer_status",
            "nixl_capi_release_xfer_req", "nixl_capi_destroy_xfer_req", "nixl_capi_opt_args_set_notif_msg")])
        ev_query = ev_handle = ctx_set = ctx_h = None
        if pub.cuda:
            cu = ctypes.CDLL("libcuda.so.1")
            pub.event.record()  # torch makes the CUDA event at its first record
            torch.cuda.synchronize()
            ev_handle = VP(pub.event.cuda_event)
            ctx_h = VP()
            cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(VP)]
            if cu.cuCtxGetCurrent(ctypes.byref(ctx_h)) != 0 or not ctx_h.value:
                raise RuntimeError("no current CUDA context to give the native loop")
            ev_query, ctx_set = ctypes.cast(cu.cuEventQuery, VP), ctypes.cast(cu.cuCtxSetCurrent, VP)
        loops = {}
        for variant, spin_us in (("native-spin", a.spin_budget_ms * 1e3), ("native-sleep", 0.0)):
            if variant in cases:
                h = native.handoff_loop_start(fns, ca.agent, c_local, c_remote, opt, ring, SLOTS, ev_query,
                                              ev_handle, ctx_set, ctx_h, spin_us, cap, n_seen, n_posted, n_done,
                                              n_res)
                if not h:
                    raise RuntimeError("the native loop did not start")
                loops[variant] = VP(h)
    else:
        print(f"native-spin, native-sleep: SKIP ({why})")
        cases = [c for c in cases if not c.startswith("native")]

    def copy_once(k: int) -> float:
        time.sleep(a.gap_ms * 1e-3)
        t0 = mono()
        pub.slot(pub.pool, k).copy_(pub.src[k])
        if pub.cuda:
            torch.cuda.synchronize()
        return mono() - t0

    def run_case(case: str, n: int, busy: bool) -> list[tuple]:
        """n publishes through ``case``; rows (landed, answered, posted) in seconds after the publish."""
        design = case.split("-")[0]
        sys.setswitchinterval(a.py_gil_switch_ms * 1e-3 if design == "py" else DEFAULT_SWITCH_S)
        c_conn.send(("case", n))
        if design == "agent":
            g_conn.send(("case", n, a.spin_budget_ms * 1e-3 if case.endswith("spin") else 0.0))
            assert g_conn.recv() == "ready"
        if design == "native":
            native.handoff_loop_arm(loops[case], 1)
        seen = {}
        for _ in range(n):
            pub.seq += 1
            s, k = pub.seq, pub.seq % SLOTS
            time.sleep(a.gap_ms * 1e-3)
            if design == "py":
                pub.stamps[s] = [0.0, 0.0, 0.0, 0.0, "?"]
                t_pub = pub.publish(pub.pool, k, pub.event)
                pub.stamps[s][0] = t_pub
                state["seq"] = s
                wake_py.set()
            elif design == "native":
                n_res[s % cap] = PENDING
                t_pub = pub.publish(pub.pool, k, pub.event)
                native.handoff_loop_publish(loops[case], s)
            else:
                t_pub = pub.publish(agent_pool, k, pub.ipc_event)
                flag[0] = s
                wake_w.send_bytes(b"")
            if busy:
                pub.busy(a.spin_ms * 1e-3)
            got, t_seen = c_conn.recv()
            if got != s:
                raise RuntimeError(f"{case}: the consumer saw publish {got}, expected {s}")
            seen[s] = (t_pub, t_seen)
            pub.last_written[k] = k
        if design == "native":
            native.handoff_loop_arm(loops[case], 0)
        if design == "agent":
            stamps = {r[0]: r[1:] for r in g_conn.recv()}
        # The consumer may see the last notification before the hand-off has seen its DONE.
        deadline = mono() + TIMEOUT_S
        while mono() < deadline and any(pub.stamps[s][4] == "?" if design == "py" else n_res[s % cap] == PENDING
                                        for s in seen if design != "agent"):
            time.sleep(0.001)
        rows = []
        for s, (t_pub, t_seen) in seen.items():
            if design == "py":
                _, t_ans, t_post, _, st = pub.stamps.pop(s)
            elif design == "native":
                i = s % cap
                t_ans, t_post, st = n_seen[i], n_posted[i], n_res[i]
                st = "DONE" if st == 0 else f"status {st}"
            else:
                t_ans, t_post, _, st = stamps[s]
            if st != "DONE":
                raise RuntimeError(f"{case}: publish {s} ended {st}")
            rows.append((t_seen - t_pub, t_ans - t_pub, t_post - t_pub))
        c_conn.send(("check", {k: (k, nbytes) for k in pub.last_written}))
        bad = c_conn.recv()
        if bad:
            raise RuntimeError(f"{case}: the consumer's slots {bad} do not hold what was written last")
        pub.last_written.clear()
        return rows

    for case in cases:  # warm-up: wire-up, IPC handles, first posts
        run_case(case, SLOTS, busy=False)
    results: dict[str, dict[str, list]] = {}
    ref: list[float] = []
    for _ in range(a.rounds):
        ref += [copy_once(k % SLOTS) for k in range(a.n)]
        for busy in (False, True):
            for case in cases:
                rows = run_case(case, a.n, busy)
                r = results.setdefault(f"{case} {'busy' if busy else 'idle'}", {"landed": [], "answered": [],
                                                                                 "posted": [], "round_p50": []})
                for landed, ans, post in rows:
                    r["landed"].append(landed * 1e6)
                    r["answered"].append(ans * 1e6)
                    r["posted"].append(post * 1e6)
                r["round_p50"].append(statistics.median(x[0] for x in rows) * 1e6)
    state["stop"] = True
    wake_py.set()
    for h in (loops.values() if so else ()):
        native.handoff_loop_stop(h)
    c_conn.send(None)
    g_conn.send(None)
    cons.join(10)
    agp.join(10)
    copy_us = statistics.median(ref) * 1e6
    print(f"{a.device} hand-off of {a.size} ({nbytes} B), {a.rounds} rounds x {a.n}, gap {a.gap_ms} ms, busy = "
          f"{a.spin_ms} ms of Python after the publish; copy p50 {copy_us:.1f} us; consumer "
          + (f"sleeps {a.consumer_poll_us} us between polls" if a.consumer_poll_us else "spins"))
    print(f"{'case':22s} {'landed':>9s} {'÷ copy':>7s} {'answered':>9s} {'posted':>9s}  round p50s (landed)")
    out = {}
    for name, r in results.items():
        p = {k: statistics.median(v) for k, v in r.items() if k != "round_p50"}
        out[name] = dict(p, ratio=p["landed"] / copy_us, round_p50=r["round_p50"],
                         p90_landed=statistics.quantiles(r["landed"], n=10)[-1])
        print(f"{name:22s} {p['landed']:9.1f} {p['landed'] / copy_us:7.2f} {p['answered']:9.1f} {p['posted']:9.1f}  "
              + " ".join(f"{x:.1f}" for x in r["round_p50"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "size": nbytes, "n": a.n, "rounds": a.rounds, "spin_ms": a.spin_ms,
                       "gap_ms": a.gap_ms, "consumer_poll_us": a.consumer_poll_us, "copy_us": copy_us, "cases": out}, f, indent=1)


def build_native() -> tuple[str, str]:
    import shutil
    import subprocess
    import tempfile

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "", "no C compiler (cc/gcc)"
    out = os.path.join(tempfile.mkdtemp(prefix="handoff-loop-"), "handoff_loop.so")
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", out, os.path.join(HERE, "handoff_loop.c"), "-lpthread"],
                       capture_output=True, text=True)
    return (out, "") if r.returncode == 0 else ("", f"cc failed: {r.stderr.strip()[-300:]}")


if __name__ == "__main__":
    main()
