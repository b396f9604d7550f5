#!/usr/bin/env python3
"""Probe: what does an idle producer/consumer pair cost, and is the first load after idling slow?

A real producer process (serving endpoint, its own I/O thread, defaults otherwise) and a real
consumer process (this one; no I/O thread by default, like a vLLM consumer worker) handshake and
move ``--warm`` items of ``--size`` bytes (one per load, timed ``load()`` -> ``LoadBarrier``
passed). Then, ``--cycles`` times: both idle for ``--idle`` seconds while the CPU time of every
thread of both processes is read from /proc/<pid>/task/*/schedstat, then ``--after`` loads
(the first is the "first load after idle"). Finally ``--warm`` more loads. Prints one JSON line:
idle cores per process and cycle, busy threads, warm p50/p90, and each first-after-idle time.

    PYTHONPATH=. python scripts/probe_idle.py [--mode read|write] [--idle 10] [--cycles 2]
        [--size 65536] [--warm 30] [--after 3] [--producer-thread auto|on|off]
        [--consumer-thread auto|on|off] [--wait S] [--consumer-threaded]

``--producer-thread``/``--consumer-thread`` set ``nixl_progress_thread``; ``--wait`` sets
``nixl_progress_wait_s`` on both. Compare trees by pointing PYTHONPATH at each, in one session.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

FLAG = {"auto": None, "on": True, "off": False}


def threads_cpu(pid: int) -> dict[int, tuple[str, int]]:
    """{tid: (name, ns on CPU so far)} for every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = (comm, int(f.read().split()[0]))
        except OSError:
            continue
    return out


def cores(a: dict, b: dict, secs: float) -> list[tuple[str, float]]:
    """Per thread, cores used between snapshots ``a`` and ``b``, busiest first."""
    rows = [(comm, (ns - a.get(tid, (comm, 0))[1]) / 1e9 / secs) for tid, (comm, ns) in b.items()]
    return sorted(rows, key=lambda r: -r[1])


def producer_main(conn, cfg: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint

    ep = Endpoint(EndpointConfig(**cfg))
    conn.send((ep.address, os.getpid()))
    n = 0
    while True:
        cmd, args = conn.recv()
        if cmd == "publish":  # one item written in place into a reserved slot (zero-copy publish)
            n += 1
            slot = ep.reserve(args, tag=f"it-{n}")
            slot.bytes()[:args].fill_(n % 251)
            conn.send(ep.publish_slot(f"it-{n}", slot, (args // 2,), torch.bfloat16))
        else:
            ep.close()
            conn.send(None)
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("read", "write"), default="read")
    ap.add_argument("--idle", type=float, default=10.0)
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--size", type=int, default=64 << 10)
    ap.add_argument("--warm", type=int, default=30)
    ap.add_argument("--after", type=int, default=3)
    ap.add_argument("--pool", type=int, default=64 << 20)
    ap.add_argument("--producer-thread", choices=tuple(FLAG), default="auto")
    ap.add_argument("--consumer-thread", choices=tuple(FLAG), default="auto")
    ap.add_argument("--wait", type=float, default=None, help="nixl_progress_wait_s for both")
    ap.add_argument("--consumer-threaded", action="store_true", help="give the consumer its own I/O thread")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from ec_nixl.barrier import LoadBarrier
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint, ItemRef

    extra = {} if a.wait is None else {"nixl_progress_wait_s": a.wait}
    ctx = mp.get_context("spawn")
    pc, cc = ctx.Pipe()
    prod = ctx.Process(target=producer_main, daemon=True, args=(cc, dict(
        name=f"probe-idle-p-{os.getpid()}", pool_bytes=a.pool, listen="127.0.0.1:0", threaded=True,
        nixl_progress_thread=FLAG[a.producer_thread], announce_lease_s=600, grant_lease_s=600, **extra)))
    prod.start()
    addr, ppid = pc.recv()
    ep = Endpoint(EndpointConfig(name=f"probe-idle-c-{os.getpid()}", pool_bytes=a.pool, mode=a.mode,
                                 threaded=a.consumer_threaded, nixl_progress_thread=FLAG[a.consumer_thread],
                                 load_timeout_s=30, peer_timeout_s=30, **extra))
    barrier = LoadBarrier(ep)

    def one() -> float:
        pc.send(("publish", a.size))
        desc = pc.recv()
        ref = ItemRef(desc=desc, producer=addr)
        if a.mode == "read":  # the place from a hold, as vLLM's scheduler gets it: a direct READ
            st = ep.hold(addr, [desc.mm_hash], timeout=10)[desc.mm_hash]
            ref = ItemRef(desc=desc, producer=addr, block=st.block, valid_until=time.time() + st.lease_s - 1)
        t0 = time.perf_counter()
        tickets = ep.load([ref])
        barrier.wait(tickets, timeout=30)
        dt = time.perf_counter() - t0
        for t in tickets:
            t.release()
        return dt

    try:
        one()  # handshake and wire-up
        warm = [one() for _ in range(a.warm)]
        pids = {"producer": ppid, "consumer": os.getpid()}
        out = {"mode": a.mode, "size": a.size, "idle_s": a.idle, "loadavg": [], "idle_cores": {k: [] for k in pids},
               "busy_threads": {k: [] for k in pids}, "first_after_idle_us": []}
        for _ in range(a.cycles):
            before = {k: threads_cpu(p) for k, p in pids.items()}
            out["loadavg"].append(round(os.getloadavg()[0], 2))
            t0 = time.monotonic()
            time.sleep(a.idle)
            secs = time.monotonic() - t0
            for k, p in pids.items():
                rows = cores(before[k], threads_cpu(p), secs)
                out["idle_cores"][k].append(round(sum(r[1] for r in rows), 4))
                out["busy_threads"][k].append([(c, round(v, 4)) for c, v in rows if v >= 0.001])
            after = [one() for _ in range(a.after)]
            out["first_after_idle_us"].append(round(after[0] * 1e6, 1))
        warm += [one() for _ in range(a.warm)]
        warm.sort()
        out["warm_p50_us"] = round(statistics.median(warm) * 1e6, 1)
        out["warm_p90_us"] = round(warm[int(0.9 * (len(warm) - 1))] * 1e6, 1)
        print(json.dumps(out))
    finally:
        pc.send(("close", None))
        pc.recv()
        ep.close()
        prod.join(10)


if __name__ == "__main__":
    main()
