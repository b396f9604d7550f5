#!/usr/bin/env python3
"""Probe: where the overlapped flow's hand-off (``expect-landed``) spends its time.

A consumer's Hold waits at the producer for an item not published yet (PD asked while E
encodes); the producer publishes it; the Hold is answered; the consumer READs at the place the
answer gave and its barrier returns. Both processes stamp their steps with ``perf_counter``
(CLOCK_MONOTONIC on Linux: one clock for the two), relative to the moment publishing began:

    publish_slot returned | the producer's loop answers | Grant sent | the consumer sees the
    answer | load() returned | barrier returned

The producer's steps are seen by wrapping its server's ``answer_parked`` and ``reply`` in this
probe's own process (instrumentation, not a change of behaviour). "Grant sent" is stamped when the
send returned: on a busy host the I/O thread may be preempted right after it, and the stamp then
comes after the consumer already saw the answer. Not a benchmark of record:
``ec-nixl bench --paths expect-landed`` is; this says which hop to work on.

    python bench/probes/handoff_trace.py [--device cpu|cuda] [--size 64K] [--n 60]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

STEPS = ("publish_slot returned", "answer_parked entered", "Grant sent", "consumer saw the answer",
         "load() returned", "barrier returned")


def producer(conn, device: str, nbytes: int, shape: tuple, dtype: str) -> None:
    import torch

    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint

    ep = Endpoint(EndpointConfig(name="trace-prod", device=device, listen="127.0.0.1:0",
                                 pool_bytes=max(64 << 20, 8 * nbytes)))
    srv, marks = ep.server, {}
    answer, reply = srv.answer_parked, srv.reply

    def timed_answer(now=None):
        marks.setdefault("answer", time.perf_counter())  # the first call after the publish
        answer(now)

    def timed_reply(identity, msg):
        reply(identity, msg)
        marks.setdefault("sent", time.perf_counter())

    srv.answer_parked, srv.reply = timed_answer, timed_reply
    conn.send(ep.address)
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        mm_hash, parked = cmd
        slot = ep.reserve(nbytes, mm_hash)
        slot.bytes()[:nbytes].fill_(parked % 251)
        if device == "cuda":
            torch.cuda.synchronize()
        while ep.metrics.counters.get("holds_parked", 0) < parked:  # the consumer's Hold is here
            time.sleep(0.0002)
        marks.clear()
        t0 = time.perf_counter()
        ep.publish_slot(mm_hash, slot, shape, getattr(torch, dtype))
        t1 = time.perf_counter()
        time.sleep(0.005)  # let the answer go out before reporting
        conn.send((t0, t1, marks.get("answer", float("nan")), marks.get("sent", float("nan"))))
    ep.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--size", default="64K", help="item size (K/M suffixes)")
    ap.add_argument("--n", type=int, default=60, help="hand-offs timed (after 5 untimed)")
    args = ap.parse_args()
    from ec_nixl.bench.units import parse_size

    spec = parse_size(args.size)
    nbytes, shape, dtype = spec.nbytes, tuple(spec.shape), spec.dtype

    from ec_nixl import ItemRef
    from ec_nixl.barrier import LoadBarrier
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint
    from ec_nixl.protocol import ItemDesc

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(there, args.device, nbytes, shape, dtype), daemon=True)
    proc.start()
    addr = here.recv()
    ep = Endpoint(EndpointConfig(name="trace-cons", device=args.device, pool_bytes=max(64 << 20, 8 * nbytes),
                                 threaded=False))
    barrier = LoadBarrier(ep, settle=False)  # as vLLM's PD worker: settle after the hand-over
    rows = []
    try:
        for i in range(args.n + 5):
            mm_hash = f"trace-{i}"
            hold = ep.hold_async(addr, [mm_hash], timeout=30, wait_s=10)
            ep.progress()
            here.send((mm_hash, i + 1))
            if not ep.wait_for(lambda: hold.done, 30):
                raise RuntimeError("the waiting Hold was not answered")
            c_seen = time.perf_counter()
            s = hold.states[mm_hash]
            if s.status != "ready":
                raise RuntimeError(f"hold of {mm_hash}: {s.status} {s.detail}")
            desc = ItemDesc(mm_hash=mm_hash, shape=list(shape), dtype=dtype, nbytes=nbytes)
            tickets = ep.load([ItemRef(desc=desc, producer=addr, block=s.block, valid_until=time.time() + s.lease_s - 1,
                                       incarnation=hold.incarnation)])
            c_loaded = time.perf_counter()
            barrier.wait(tickets, timeout=10)
            c_landed = time.perf_counter()
            t0, t1, t_answer, t_sent = here.recv()
            for t in tickets:
                t.release()
            ep.progress()
            if i >= 5:
                rows.append([x - t0 for x in (t1, t_answer, t_sent, c_seen, c_loaded, c_landed)])
    finally:
        here.send(None)
        proc.join(10)
        ep.close()
    print(f"{args.device} {args.size}: {len(rows)} hand-offs, microseconds after publishing began")
    for k, name in enumerate(STEPS):
        xs = sorted(r[k] * 1e6 for r in rows)
        print(f"  {name:24s} p50 {statistics.median(xs):8.1f}   p10 {xs[len(xs) // 10]:8.1f}   "
              f"p90 {xs[9 * len(xs) // 10]:8.1f}")


if __name__ == "__main__":
    main()
