#!/usr/bin/env python3
"""Probe: the floor of a WRITE posted at publish (issue 25, part 2): the producer's post -> the
consumer sees NIXL's notification, against the reference copy of the same bytes.

Issue 25 asks for a WRITE posted as soon as an item is published into space the consumer leased
ahead (no control round trip), and for publish -> landed ≤ 4x the CUDA-IPC copy. This times what
no design can beat: plain NIXL (``RawAgent``, the bench's floor agent, no ec-nixl), the producer
WRITEs one item into the consumer's buffer with a notification carrying the post's clock; the
consumer polls ``get_new_notifs`` (spinning, or sleeping ``--poll-us`` between polls, as a loop
would) and stamps the arrival. Every operation follows a pause of ``--gap-ms`` on both sides, so
each hand-off starts cold as a publish does. Both clocks are CLOCK_MONOTONIC of one host.

In the same run, interleaved: ``reference``, the consumer's copy of the same item from the
producer's buffer (a CUDA-IPC handle on CUDA, the bench's ``reference-copy``; a local memcpy on
CPU), also after the pause. Landed bytes are checked (head and tail) for every WRITE.

    python bench/probes/write_notify.py [--device cpu|cuda] [--size 9.8M] [--n 200] [--gap-ms 2]
                                        [--poll-us 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SLOTS = 8
TIMEOUT_S = 30.0


def producer(conn, device: str, nbytes: int, stride: int, spin: bool, notify: bool) -> None:
    """The initiator: WRITE slot k -> the consumer's slot k (with a notification unless not
    ``notify``) on each 'go'; ``spin``: wait for it polling the pipe (a busy producer's thread)."""
    import torch

    from ec_nixl.bench.paths.raw_nixl import RawAgent

    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    fill = (torch.arange(SLOTS * stride, device=device) % 251).to(torch.uint8)
    me = RawAgent(f"wn-producer-{os.getpid()}", device, SLOTS * stride, {}, fill=fill)
    conn.send({"info": me.info(), "buf": me.buf if device.startswith("cuda") else None})
    me.connect(conn.recv())
    me.prep(nbytes, SLOTS, stride)
    local, remote = me.ring
    while True:
        while spin and not conn.poll(0):
            pass
        msg = conn.recv()
        if msg is None:
            break
        i, gap_s = msg
        if spin:  # busy for the gap, as a producer running its encoder is
            until = time.perf_counter() + gap_s
            while time.perf_counter() < until:
                pass
        else:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        h, st = me.post("WRITE", local, [i % SLOTS], remote, [i % SLOTS], f"{i}".encode() if notify else b"")
        while st == "PROC" and time.perf_counter() - t0 < TIMEOUT_S:
            st = me.status(h)
        t_done = time.perf_counter()
        me.agent.release_xfer_handle(h)
        conn.send((i, t0, t_done, st))
    me.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="9.8M")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=2.0, help="pause before each operation (both sides idle)")
    ap.add_argument("--poll-us", type=float, default=0.0, help="consumer's sleep between notification polls")
    ap.add_argument("--producer-spins", action="store_true",
                    help="the producer polls for its cue instead of sleeping in recv (a busy producer)")
    ap.add_argument("--no-notify", action="store_true",
                    help="a WRITE with no notification (the consumer then sees only the producer's DONE)")
    ap.add_argument("--consumer-gpu", choices=("check", "idle"), default="check",
                    help="check: the consumer checks each WRITE's bytes on its GPU and copies the reference "
                         "between WRITEs; idle: its GPU does nothing between them (the copies follow, the "
                         "bytes are checked at the end): one GPU is time-sliced between the two processes")
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    import torch

    from ec_nixl.bench.paths.raw_nixl import RawAgent
    from ec_nixl.bench.units import page_round, parse_size

    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(0)
    nbytes = parse_size(a.size).nbytes
    stride = page_round(nbytes)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(child, a.device, nbytes, stride, a.producer_spins,
                                                    not a.no_notify), daemon=True)
    proc.start()
    hello = conn.recv()
    me = RawAgent(f"wn-consumer-{os.getpid()}", a.device, SLOTS * stride, {})
    me.connect(hello["info"])
    conn.send(me.info())
    src = hello["buf"] if cuda else torch.empty(SLOTS * stride, dtype=torch.uint8)  # the reference's source
    dst = torch.empty(stride, dtype=torch.uint8, device=a.device)
    want = [(torch.arange(k * stride, k * stride + nbytes) % 251).to(torch.uint8) for k in range(SLOTS)]
    sleep_s = a.poll_us * 1e-6

    def one_write(i: int, check: bool = True) -> tuple[float, float]:
        """(post -> notification seen, post -> producer's DONE), seconds; ``check``: the landed
        head and tail checked and poisoned again (the consumer's GPU works between operations)."""
        conn.send((i, a.gap_ms * 1e-3))
        deadline = time.monotonic() + TIMEOUT_S + a.gap_ms * 1e-3
        while not a.no_notify:
            notes = me.agent.get_new_notifs()
            if notes:
                t_seen = time.perf_counter()
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no notification for WRITE {i}")
            if sleep_s:
                time.sleep(sleep_s)
        while a.no_notify and not conn.poll(0):  # a WRITE's target may still have to drive UCX (CPU)
            me.agent.get_new_notifs()
        j, t0, t_done, st = conn.recv()
        if a.no_notify:
            t_seen = t_done
        elif [m for ms in notes.values() for m in ms] != [f"{i}".encode()]:
            raise RuntimeError(f"WRITE {i}: unexpected notifications {notes}")
        if st != "DONE" or j != i:
            raise RuntimeError(f"WRITE {i} ended {st}")
        if check:
            check_slot(i % SLOTS, f"WRITE {i}: the notification came before the bytes")
        return t_seen - t0, t_done - t0

    def check_slot(k: int, why: str) -> None:
        got = me.buf[k * stride : k * stride + nbytes]
        for part in (slice(0, 64), slice(nbytes - 64, nbytes)):
            if not torch.equal(got[part].cpu(), want[k][part]):
                raise RuntimeError(f"{why} (slot {k})")
        me.buf[k * stride : k * stride + 64].zero_()
        me.buf[k * stride + nbytes - 64 : k * stride + nbytes].zero_()
        if cuda:
            torch.cuda.synchronize()

    def one_copy(i: int) -> float:
        time.sleep(a.gap_ms * 1e-3)
        k = i % SLOTS
        t0 = time.perf_counter()
        dst[:nbytes].copy_(src[k * stride : k * stride + nbytes])
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for i in range(5):  # warm-up (wire-up, IPC handle opened)
        one_write(i)
        one_copy(i)
    seen, done, ref = [], [], []
    if a.consumer_gpu == "check":  # interleaved: WRITE (checked), copy, WRITE, ...
        for i in range(a.n):
            s, d = one_write(i)
            seen.append(s * 1e6)
            done.append(d * 1e6)
            ref.append(one_copy(i) * 1e6)
    else:  # the consumer's GPU idle through the WRITEs; the copies after; the bytes checked at the end
        for i in range(a.n):
            s, d = one_write(i, check=False)
            seen.append(s * 1e6)
            done.append(d * 1e6)
        ref = [one_copy(i) * 1e6 for i in range(a.n)]
        for k in range(SLOTS):
            check_slot(k, "a WRITE did not land")  # (and poisons the slot again)
        for k in range(SLOTS):
            one_write(a.n + k, check=False)
        for k in range(SLOTS):
            check_slot((a.n + k) % SLOTS, "a WRITE did not land")
    conn.send(None)
    proc.join(10)
    r = statistics.median(ref)
    rows = {"notification seen": seen, "producer's DONE": done, "reference copy": ref}
    if a.no_notify:
        del rows["notification seen"]
    print(f"{a.device} WRITE of {a.size}" + (" (no notification)" if a.no_notify else " + notification")
          + f", {a.n} ops, gap {a.gap_ms} ms, producer " + ("spins" if a.producer_spins else "sleeps")
          + ", consumer " + (f"sleeps {a.poll_us} us between polls" if a.poll_us else "spins")
          + f", consumer's GPU {a.consumer_gpu}")
    out = {}
    for name, t in rows.items():
        q = statistics.quantiles(t, n=10)
        out[name] = {"p50_us": statistics.median(t), "p10_us": q[0], "p90_us": q[-1]}
        print(f"  {name:18s} p50 {statistics.median(t):8.1f} us  p10 {q[0]:8.1f}  p90 {q[-1]:8.1f}  "
              f"({statistics.median(t) / r:.2f}x the reference copy)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "size": nbytes, "n": a.n, "gap_ms": a.gap_ms, "poll_us": a.poll_us,
                       "producer_spins": a.producer_spins, "consumer_gpu": a.consumer_gpu, "notify": not a.no_notify,
                       "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
