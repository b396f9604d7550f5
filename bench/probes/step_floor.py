#!/usr/bin/env python3
"""Probe: what one step's READ costs as NIXL sees it, cut into operations in different ways.

Two processes, each with an ec-nixl ``Arena`` (cudaMalloc'd VRAM, or huge-page DRAM), registered
once. The initiator READs the target's first ``items x size`` bytes into its own, timed host-side
(post -> poll until DONE), medians of ``--n``:

* ``blocks, make+post``: the arena prepped as 64 KiB blocks (one strided row, as
  ``Transport`` does), one ``make_prepped_xfer`` per operation over the step's consecutive block
  indices. NIXL merges consecutive indices of one strided row into one descriptor
  (``descs`` = its telemetry's count): this is ours' way.
* ``blocks, made once``: the same request made once and re-posted (the post alone).
* ``per item``: a second prepped list with one descriptor per item slot, NIXL's merging off
  (``skip_desc_merge``): one descriptor per item, as the raw-nixl floor of ``ec-nixl bench`` posts.
* ``one descriptor``: a prepped list whose single descriptor is the whole step.
* ``D2D copy``: the same bytes copied inside the initiator (torch, CUDA events): the copy engine's limit.

``--op WRITE`` times WRITEs instead, ``--notif`` gives each request a notification (as ec-nixl's
WRITEs carry: NIXL's UCX backend flushes the endpoint and sends it once the flush completed);
each line also gives the post (``transfer``) alone. ``--thread`` posts from a thread that never
touched CUDA (as an endpoint's I/O thread may). ``--gap-ms`` sleeps (``--spin-gap``: busy-waits)
before each timed operation, as a thread that idles between items; ``--prog-thread`` gives the
initiator NIXL's progress thread, as ec-nixl's serving endpoints run it; ``--touch`` runs a small
kernel of the initiator's own (finished) right before each operation.

Not a benchmark of record (``ec-nixl bench`` is): it answers "is the gap the copy engine, the way
the bytes are cut, or the host?" on the machine it runs on.

    python bench/probes/step_floor.py [--device cuda|cpu] [--size 9.8M] [--items 32] [--n 30]
                                      [--op READ|WRITE] [--notif] [--thread]
                                      [--gap-ms MS [--spin-gap]] [--prog-thread] [--touch]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time

BLOCK = 64 << 10


def _agent(name: str, cuda: bool, prog_thread: bool = False):
    """A NIXL agent with a UCX backend; ``prog_thread``: with NIXL's progress thread, set up as an
    ec-nixl serving endpoint's (asleep on UCX's fds up to 10 ms, a mutex-guarded UCX worker)."""
    from nixl._api import nixl_agent_config

    from ec_nixl.transport import _new_agent, _with_mt_mutex

    a = _new_agent(name, nixl_agent_config(backends=[], capture_telemetry=True, enable_prog_thread=prog_thread),
                   0.01)
    engine = "CUDA_IPC_ENABLE_GET_ZCOPY=y" if cuda else ""
    if prog_thread:
        engine = _with_mt_mutex(engine)
    a.create_backend("UCX", {"engine_config": engine} if engine else {})
    return a


def _arena(device: str, nbytes: int):
    import torch

    from ec_nixl.arena import Arena

    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    return Arena(nbytes, torch.device(device))


CHECKED = 4096  # the head of the step the initiator checks after its last READ


def _pattern(device):
    import torch

    return (torch.arange(CHECKED, device=device) % 251).to(torch.uint8)


def target(device: str, nbytes: int, conn) -> None:
    ar = _arena(device, nbytes)
    a = _agent("tgt", device != "cpu")
    a.register_memory([(ar.base, ar.size, ar.device_id, "")], ar.mem_type)
    ar.bytes[:CHECKED].copy_(_pattern(ar.bytes.device))
    conn.send((a.get_agent_metadata(), ar.base, ar.size))
    wait = 0 if device != "cpu" else 0.0005  # a GPU host has cores to spare: progress at once
    while not conn.poll(wait):
        a.get_new_notifs()  # UCX progress for the target side (a WRITE's notification needs it)
    conn.recv()
    # What the initiator's WRITEs left (it writes the pattern's complement from its own arena).
    conn.send(bool((ar.bytes[:CHECKED].cpu() == 255 - _pattern("cpu")).all()))
    ar.close()


def _time(fn, n: int, gap_s: float = 0.0, spin: bool = False, before=None) -> list[float]:
    """Microseconds of ``n`` calls of ``fn`` (after 3 untimed), ``gap_s`` apart: asleep, or
    busy-waiting where ``spin``; ``before()`` (untimed) right before each."""
    out = []
    for i in range(n + 3):
        if gap_s:
            if spin:
                end = time.perf_counter() + gap_s
                while time.perf_counter() < end:
                    pass
            else:
                time.sleep(gap_s)
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if i >= 3:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def initiator(device: str, item: int, items: int, n: int, conn, op: str = "READ", notif: bool = False,
              in_thread: bool = False, gap_s: float = 0.0, spin_gap: bool = False,
              prog_thread: bool = False, touch: bool = False) -> list[str]:
    import numpy as np
    import torch

    cuda = device != "cpu"
    step = item * items
    ar = _arena(device, 2 * step + BLOCK)
    a = _agent("ini", cuda, prog_thread)
    a.register_memory([(ar.base, ar.size, ar.device_id, "")], ar.mem_type)
    md, rbase, rsize = conn.recv()
    if op == "WRITE":
        ar.bytes[:CHECKED].copy_(255 - _pattern(ar.bytes.device))
    peer = a.add_remote_agent(md)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    mem = ar.mem_type
    nb = step // BLOCK

    def strided(base, length, count):
        return np.array([[base, length, ar.device_id, length, count]], dtype=np.uint64)

    lists = {
        "blocks": (strided(ar.base, BLOCK, ar.size // BLOCK), strided(rbase, BLOCK, rsize // BLOCK)),
        "per item": (strided(ar.base, item, items), strided(rbase, item, items)),
        "one descriptor": (strided(ar.base, step, 1), strided(rbase, step, 1)),
    }
    prepped = {k: (a.prep_xfer_dlist("NIXL_INIT_AGENT", l, mem), a.prep_xfer_dlist(peer, r, mem))
               for k, (l, r) in lists.items()}

    posts: list[float] = []
    before = None
    if touch and cuda:  # --touch: this process's own GPU work, finished, right before each operation
        scratch = torch.zeros(1 << 20, device=ar.bytes.device)

        def before():
            scratch.add_(1)
            torch.cuda.synchronize()

    def run(h):
        t0 = time.perf_counter()
        s = a.transfer(h)
        posts.append((time.perf_counter() - t0) * 1e6)
        while s == "PROC":
            s = a.check_xfer_state(h)
        if s != "DONE":
            raise RuntimeError(s)

    out = [f"{device}: {op}{' + notification' if notif else ''} of {items} x {item / 1e6:.2f} MB = {step / 2**20:.0f} MiB, medians of {n}"]
    cases = [("blocks, make+post", "blocks", np.arange(nb, dtype=np.int32), True, False),
             ("blocks, made once", "blocks", np.arange(nb, dtype=np.int32), False, False),
             ("per item, make+post", "per item", np.arange(items, dtype=np.int32), True, True),
             ("one descriptor, make+post", "one descriptor", np.zeros(1, dtype=np.int32), True, False)]
    failed: list[BaseException] = []

    def timed_cases():
        try:
            for case in cases:
                time_case(*case)
        except BaseException as e:  # --thread: raised again in the initiator's own thread
            failed.append(e)

    def time_case(label, key, idx, remake, skip):
        loc, rem = prepped[key]
        descs = []
        posts.clear()

        def make():
            return a.make_prepped_xfer(op, loc, idx, rem, idx, notif_msg=b"n" if notif else b"",
                                       skip_desc_merge=skip)

        def once():
            h = make()
            run(h)
            descs.append(a.get_xfer_telemetry(h).descCount)
            a.release_xfer_handle(h)

        if remake:
            ts = _time(once, n, gap_s, spin_gap, before)
        else:
            h = make()
            ts = _time(lambda: run(h), n, gap_s, spin_gap, before)
            descs.append(a.get_xfer_telemetry(h).descCount)
            a.release_xfer_handle(h)
        made = _time(lambda: a.release_xfer_handle(make()), 20)
        m = statistics.median(ts)
        out.append(f"  {label:<27} descs {descs[-1]:>4}  p50 {m:8.1f} us  min {min(ts):8.1f}  "
                   f"{step / m / 1e3:7.0f} GB/s  (post alone {statistics.median(posts):.1f} us, make+release alone "
                   f"{statistics.median(made):.1f} us)")

    if gap_s:
        out[0] += f", {gap_s * 1e3:g} ms apart ({'busy-waiting' if spin_gap else 'asleep'} in between)"
    if prog_thread:
        out[0] += ", NIXL's progress thread on"
    if before is not None:
        out[0] += ", a kernel of its own finished right before each"
    if in_thread:  # --thread: as an endpoint's I/O thread (it never calls CUDA itself)
        out[0] += ", posted from a thread that never touched CUDA"
        t = threading.Thread(target=timed_cases)
        t.start()
        t.join()
    else:
        timed_cases()
    if failed:
        raise failed[0]
    ok = bool((ar.bytes[:CHECKED].cpu() == _pattern("cpu")).all()) if op == "READ" else None
    if cuda:
        src, dst = ar.bytes[:step], ar.bytes[step:2 * step]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for i in range(n + 3):
            s.record()
            dst.copy_(src)
            e.record()
            e.synchronize()
            if i >= 3:
                ts.append(s.elapsed_time(e) * 1e3)
        m = statistics.median(ts)
        out.append(f"  {'D2D copy, one process':<27} {'':>10}  p50 {m:8.1f} us  {'':>14}  {step / m / 1e3:7.0f} GB/s")
    conn.send("bye")
    if ok is None:
        ok = conn.recv() if conn.poll(30) else "no answer"  # the target checked our WRITEs
    out.append(f"  bytes landed as written: {ok}")
    ar.close()
    return out


def _initiator_main(device, item, items, n, conn, res, *opts):
    try:
        res.send(initiator(device, item, items, n, conn, *opts))
    except BaseException as e:
        res.send([f"initiator failed: {type(e).__name__}: {e}"])
        conn.send("bye")


def main() -> None:
    from ec_nixl.bench.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="9.8M")
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--op", default="READ", choices=("READ", "WRITE"))
    ap.add_argument("--notif", action="store_true", help="a notification on every request")
    ap.add_argument("--thread", action="store_true",
                    help="post from a new thread with no current CUDA context (UCX then pushes the context per call)")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="sleep this long before each timed operation (a thread that idles between items)")
    ap.add_argument("--spin-gap", action="store_true", help="with --gap-ms: busy-wait the gap instead of sleeping")
    ap.add_argument("--touch", action="store_true",
                    help="the initiator runs a small kernel and waits for it right before each operation (as a "
                         "producer that just wrote the item)")
    ap.add_argument("--prog-thread", action="store_true",
                    help="the initiator's agent runs NIXL's progress thread, as ec-nixl's serving endpoints do")
    a = ap.parse_args()
    item = -(-parse_size(a.size).nbytes // BLOCK) * BLOCK  # a slot: whole blocks, as the pool carves
    ctx = mp.get_context("spawn")
    c1, c2 = ctx.Pipe()
    r1, r2 = ctx.Pipe(duplex=False)
    ps = [ctx.Process(target=target, args=(a.device, item * a.items + BLOCK, c1)),
          ctx.Process(target=_initiator_main, args=(a.device, item, a.items, a.n, c2, r2, a.op, a.notif, a.thread,
                                                        a.gap_ms / 1e3, a.spin_gap, a.prog_thread, a.touch))]
    for p in ps:
        p.start()
    print("\n".join(r1.recv() if r1.poll(240) else ["TIMEOUT"]), flush=True)
    for p in ps:
        p.join(10)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    main()
