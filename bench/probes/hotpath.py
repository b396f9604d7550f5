#!/usr/bin/env python3
"""Probe: where a consumer's load -> barrier spends its host time (the ``ours-read`` path).

A bench producer runs in its own process (items written in place into reserved slots, as in
``ec-nixl bench``); this process is a caller-driven consumer that holds a batch of items, then
times ``Endpoint.load`` -> ``LoadBarrier.wait`` per operation, settles untimed, and releases.
With ``--profile`` the timed operations also run under cProfile and the top entries are printed:
the tool for cutting the connector's own per-operation cost (issue: the hot path at the
physical limit). Not a benchmark of record: ``ec-nixl bench`` is (it has the raw-NIXL floor).

    python bench/probes/hotpath.py [--device cpu|cuda] [--size 64K] [--items 1] [--n 300] [--profile]
                                   [--floor | --python-only [--fake-dma-us US]]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time


def bare_read(ep, refs) -> float:
    """One READ of ``refs``' producer blocks into a scratch slot through the endpoint's transport:
    post, poll until final, release (what ec-nixl adds nothing to)."""
    link = ep.links.find(refs[0].producer)
    n = [ep.pool.blocks_for(r.desc.nbytes) for r in refs]
    slot = ep.pool.allocate(sum(n) * ep.pool.block_size, tag="bare")
    ranges, at = [], slot.block
    for r, k in zip(refs, n):
        ranges.append((at, r.block, k))
        at += k
    t0 = time.perf_counter()
    x = ep.transport.post_many("READ", link.peer, ranges)
    while not ep.transport.finished([x]):
        pass
    dt = time.perf_counter() - t0
    ep.transport.release(x)
    ep.pool.release(slot)
    return dt


POSTED: list[float] = []  # --python-only: when each post happened (the DMA would start there)
SEEN_DONE: list[float] = []  # --python-only: when a poll first reported a fake request DONE


def fake_nixl_after(warm_posts: int = 20, dma_s: float = 0.0) -> None:
    """``--python-only``: after ``warm_posts`` real posts, Transport's post/poll/release become
    fakes: a request is DONE at its first poll ``dma_s`` after its post (``--fake-dma-us``: the
    DMA's time, during which ec-nixl's bookkeeping after the post overlaps it), nothing moves.
    So an operation's time is ec-nixl's own Python: a steady number to cut, free of DMA and NIXL
    noise, and with ``dma_s`` what of it stands outside the DMA. Not a transfer."""
    import ec_nixl.transport as T

    post, finished, release, telemetry = (T.Transport.post_many, T.Transport.finished, T.Transport.release,
                                          T.Transport.telemetry)
    posts = [0]

    def fake_post(self, op, peer, ranges, notif=b""):
        posts[0] += 1
        POSTED.append(time.perf_counter())
        if posts[0] <= warm_posts:
            return post(self, op, peer, ranges, notif)
        return T.Xfer(None, op, peer.name, sum(r[2] for r in ranges) * self.block_size, "PROC")

    def fake_finished(self, xfers):
        now = time.perf_counter()
        fake = [x for x in xfers if x.handle is None and now >= POSTED[-1] + dma_s]
        for x in fake:
            x.state = "DONE"
        if fake:
            SEEN_DONE.append(now)
        real = [x for x in xfers if x.handle is not None]
        return fake + (finished(self, real) if real else [])

    def fake_release(self, x):
        if x.handle is None:
            x.released = True
            return True
        return release(self, x)

    T.Transport.post_many, T.Transport.finished = fake_post, fake_finished
    T.Transport.release = fake_release
    T.Transport.telemetry = lambda self, x: None if x.handle is None else telemetry(self, x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="64K")
    ap.add_argument("--items", type=int, default=1)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--batch", type=int, default=50, help="operations prepared (held) at a time")
    ap.add_argument("--mode", choices=("read", "write"), default="read", help="the link's mode (write: no hold)")
    ap.add_argument("--check", action="store_true", help="check each item's head and tail bytes after each op "
                    "(as ec-nixl bench does; on CUDA that synchronizes)")
    ap.add_argument("--ring", type=int, default=0, help="landed operations kept before release (distinct slots)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--floor", action="store_true",
                    help="also time the bare transfer through the endpoint's own agent and link (no tickets)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--callees", default="", help="with --profile: also print what functions matching this "
                    "regular expression called (pstats print_callees)")
    ap.add_argument("--python-only", action="store_true",
                    help="after warm-up, NIXL's post and poll are instant fakes: time ec-nixl's own Python only")
    ap.add_argument("--fake-dma-us", type=float, default=0.0,
                    help="with --python-only: a fake request is DONE this long after its post (what of "
                         "ec-nixl's Python stands outside the DMA: until the post, and after DONE)")
    a = ap.parse_args()
    if a.python_only:
        if a.check or a.floor:
            ap.error("--python-only moves no bytes: no --check or --floor")
        fake_nixl_after(dma_s=a.fake_dma_us * 1e-6)

    import torch

    from ec_nixl import Endpoint, EndpointConfig, LoadBarrier
    from ec_nixl.bench.memory import as_u8, check
    from ec_nixl.bench.paths.ours import held_refs
    from ec_nixl.bench.producer import ProducerProcess
    from ec_nixl.bench.units import BLOCK, parse_size

    spec = parse_size(a.size)
    per_batch = spec.nbytes * a.items * a.batch
    pool = max(64 << 20, 2 * per_batch + (a.ring + 1) * spec.nbytes * a.items + (16 << 20))
    if a.device.startswith("cuda"):
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    prod = ProducerProcess(device=a.device, pool_bytes=pool)
    try:
        ep = Endpoint(EndpointConfig(name=f"hotpath-{os.getpid()}", device=a.device, mode=a.mode, pool_bytes=pool,
                                     block_bytes=BLOCK, threaded=False, load_timeout_s=60.0))
    except BaseException:
        prod.close()  # else its source file stays in /dev/shm (seen when NIXL's UCX backend failed to start)
        raise
    barrier = LoadBarrier(ep, settle=False)
    prof = cProfile.Profile() if a.profile else None
    times: list[float] = []
    loads: list[float] = []  # load() alone: everything before (and including) the post
    to_post: list[float] = []  # --python-only: load() called -> the post (the critical path before the DMA)
    tail: list[float] = []  # --python-only: DONE first seen -> the barrier returned (the critical path after it)
    floor: list[float] = []
    ring: list = []
    try:
        done = -5  # warm-up operations first
        while done < a.n:
            k = min(a.batch, a.n - done)
            groups = prod.rpc("items", "ours", f"hp{done}", (spec.nbytes, spec.shape, spec.dtype), k, a.items)
            refs = held_refs(ep, prod.address, [d for g in groups for d in g[0]], hold=a.mode == "read")
            probes = [p for g in groups for p in g[1]]
            for i in range(k):
                op = refs[i * a.items:(i + 1) * a.items]
                if prof is not None and done >= 0:
                    prof.enable()
                t0 = time.perf_counter()
                tickets = ep.load(op)
                t1 = time.perf_counter()
                out = barrier.wait(tickets, timeout=60)
                dt = time.perf_counter() - t0
                if prof is not None:
                    prof.disable()
                ep.progress()
                if a.check:
                    for r, p in zip(op, probes[i * a.items:(i + 1) * a.items]):
                        check(as_u8(out[r.mm_hash]), p, r.mm_hash)
                ring.append(tickets)
                while len(ring) > a.ring:
                    for t in ring.pop(0):
                        t.release()
                if done >= 0:
                    times.append(dt)
                    loads.append(t1 - t0)
                    if POSTED and POSTED[-1] > t0:
                        to_post.append(POSTED[-1] - t0)
                    if SEEN_DONE and SEEN_DONE[-1] > t0:
                        tail.append(t0 + dt - SEEN_DONE[-1])
                    if a.floor and a.mode == "read":
                        floor.append(bare_read(ep, op))
                done += 1
    finally:
        ep.close()
        prod.close()
    times.sort()
    print(f"{a.device} {a.mode} {a.size} x{a.items} check={a.check} ring={a.ring}: n={len(times)} p50 {statistics.median(times) * 1e6:.1f} us "
          f"p10 {times[len(times) // 10] * 1e6:.1f} p90 {times[len(times) * 9 // 10] * 1e6:.1f} "
          f"min {times[0] * 1e6:.1f}; load() alone p50 {statistics.median(loads) * 1e6:.1f} us"
          + (f", until the post {statistics.median(to_post) * 1e6:.1f} us" if to_post else "")
          + (f", DONE seen -> barrier returned {statistics.median(tail) * 1e6:.1f} us" if tail else ""))
    if floor:
        floor.sort()
        print(f"bare transfer (same agent, link, blocks; post + poll, no ec-nixl bookkeeping): "
              f"p50 {statistics.median(floor) * 1e6:.1f} us min {floor[0] * 1e6:.1f}")
    if prof is not None:
        st = pstats.Stats(prof).sort_stats("tottime")
        st.print_stats(a.top)
        if a.callees:
            st.print_callees(a.callees)


if __name__ == "__main__":
    main()
