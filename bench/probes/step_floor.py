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
each line also gives the post (``transfer``) alone.

Not a benchmark of record (``ec-nixl bench`` is): it answers "is the gap the copy engine, the way
the bytes are cut, or the host?" on the machine it runs on.

    python bench/probes/step_floor.py [--device cuda|cpu] [--size 9.8M] [--items 32] [--n 30]
                                      [--op READ|WRITE] [--notif]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

BLOCK = 64 << 10


def _agent(name: str, cuda: bool):
    from nixl._api import nixl_agent, nixl_agent_config

    a = nixl_agent(name, nixl_agent_config(backends=[], capture_telemetry=True, enable_prog_thread=False))
    a.create_backend("UCX", {"engine_config": "CUDA_IPC_ENABLE_GET_ZCOPY=y"} if cuda else {})
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
    while not conn.poll(0.0005):
        a.get_new_notifs()  # UCX progress for the target side
    conn.recv()
    # What the initiator's WRITEs left (it writes the pattern's complement from its own arena).
    conn.send(bool((ar.bytes[:CHECKED].cpu() == 255 - _pattern("cpu")).all()))
    ar.close()


def _time(fn, n: int) -> list[float]:
    out = []
    for i in range(n + 3):
        t0 = time.perf_counter()
        fn()
        if i >= 3:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def initiator(device: str, item: int, items: int, n: int, conn, op: str = "READ", notif: bool = False) -> list[str]:
    import numpy as np
    import torch

    cuda = device != "cpu"
    step = item * items
    ar = _arena(device, 2 * step + BLOCK)
    a = _agent("ini", cuda)
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
    for label, key, idx, remake, skip in cases:
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
            ts = _time(once, n)
        else:
            h = make()
            ts = _time(lambda: run(h), n)
            descs.append(a.get_xfer_telemetry(h).descCount)
            a.release_xfer_handle(h)
        made = _time(lambda: a.release_xfer_handle(make()), 20)
        m = statistics.median(ts)
        out.append(f"  {label:<27} descs {descs[-1]:>4}  p50 {m:8.1f} us  min {min(ts):8.1f}  "
                   f"{step / m / 1e3:7.0f} GB/s  (post alone {statistics.median(posts):.1f} us, make+release alone "
                   f"{statistics.median(made):.1f} us)")
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


def _initiator_main(device, item, items, n, conn, res, op="READ", notif=False):
    try:
        res.send(initiator(device, item, items, n, conn, op, notif))
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
    a = ap.parse_args()
    item = -(-parse_size(a.size).nbytes // BLOCK) * BLOCK  # a slot: whole blocks, as the pool carves
    ctx = mp.get_context("spawn")
    c1, c2 = ctx.Pipe()
    r1, r2 = ctx.Pipe(duplex=False)
    ps = [ctx.Process(target=target, args=(a.device, item * a.items + BLOCK, c1)),
          ctx.Process(target=_initiator_main, args=(a.device, item, a.items, a.n, c2, r2, a.op, a.notif))]
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
