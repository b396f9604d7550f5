#!/usr/bin/env python3
"""Probe: where the overlapped flow's hand-off (``expect-landed``) spends its time.

A consumer's Hold waits at the producer for an item not published yet (PD asked while E
encodes); the producer publishes it; the Hold is answered; the consumer READs at the place the
answer gave and its barrier returns. Both processes stamp their steps with ``perf_counter``
(CLOCK_MONOTONIC on Linux: one clock for the two), relative to the moment publishing began:

    publish_slot returned | the producer's loop answers | Grant sent | the consumer sees the
    answer | load() returned | barrier returned

The producer's steps are seen by wrapping its server's ``answer_parked`` and ``reply`` in this
probe's own process (instrumentation, not a change of behaviour); where the publish answers it
natively (``native_answers``), "Grant sent" is when the publish queued it on the hand-off's thread,
and the loop's answer comes after (it only settles). "Grant sent" is stamped when the send
returned: on a busy host the I/O thread may be preempted right after it, and the stamp then comes
after the consumer already saw the answer. Not a benchmark of record:
``ec-nixl bench --paths expect-landed`` is; this says which hop to work on.

Each hand-off's item is then read once more at once (load() -> barrier, into another slot): the
READ after the hand-off against the same READ when nothing else happened in between.

``--write`` traces ``expect-write`` instead: the consumer's ``load(wait_s=)`` on a write-mode link
parks a Push at the producer; the publish starts the WRITE into the consumer's slot. Its steps:

    publish_slot returned | the producer's loop answers | WRITE posted | the consumer sees the
    WRITE's notification | barrier returned

(the READ control is then skipped: the item is not held); with the native hand-off the producer's
"hx fired / posted / done" are its thread's own stamps. ``--marks`` also stamps the producer's
steps from taking the parked Push to the post (``_push``, ``claim_pushes``, the pusher, the post;
"made": NIXL's make is done and its post begins).

``--spin-ms`` keeps the producer's publishing thread running Python after each publish, as vLLM's
runner goes on with its step (with ``--gil-switch-ms``: how long our I/O thread then waits for
the GIL); ``--no-progress-thread`` runs the producer's agent without NIXL's progress thread;
``--hot-loop`` keeps its I/O thread polling without ever blocking (a probe-only patch);
``--wake-loop`` has every publish wake it, as before the publish left it asleep when the hand-off
answers everything waiting (a probe-only patch: that change's A/B on one machine).

    python bench/probes/handoff_trace.py [--device cpu|cuda] [--size 64K] [--n 60] [--quiet-ms MS] [--touch] [--busy]
                                         [--write [--marks]] [--no-progress-thread] [--hot-loop] [--wake-loop]
                                         [--spin-ms MS] [--gil-switch-ms MS] [--python-push] [--barrier-spin-ms MS]
                                         [--handoff-spin-ms MS]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time

STEPS = ("publish_slot returned", "answer_parked entered", "Grant sent", "consumer saw the answer",
         "load() returned", "barrier returned")
WRITE_STEPS = ("publish_slot returned", "answer_parked entered", "WRITE posted", "consumer saw WRITE done",
               "barrier returned")


def mark_calls(ep, marks: dict) -> None:
    """Wrap the producer's push path so that each step's first entry ("name>") and exit ("name<")
    after the publish is stamped; ``is_ready`` also stamps its first True ("is_ready=T")."""
    from ec_nixl.published import Item

    def wrap(name, obj, attr):
        fn = getattr(obj, attr)

        def timed(*a, **k):
            marks.setdefault(name + ">", time.perf_counter())
            r = fn(*a, **k)
            marks.setdefault(name + "<", time.perf_counter())
            if name == "is_ready" and r:
                marks.setdefault("is_ready=T", time.perf_counter())
            return r

        setattr(obj, attr, timed)

    srv = ep.server
    wrap("_push", srv, "_push")
    wrap("claim_pushes", ep.items, "claim_pushes")
    wrap("pusher.add", srv.pusher, "add")
    wrap("pusher.poll", srv.pusher, "poll")
    wrap("post_many", ep.transport, "post_many")
    wrap("is_ready", Item, "is_ready")
    split_post(ep, marks)


def split_post(ep, marks: dict) -> None:
    """Stamp "made" between NIXL's make and post of the transport's requests: the transport's own
    post (``transport.nixl_calls``) over NIXL's bindings, whose ``makeXferReq`` stamps its return."""
    from ec_nixl.transport import nixl_calls

    agent = ep.transport._agent
    bind = agent.agent

    class Stamped:  # the bindings, with the make stamped
        def __getattr__(self, attr):
            return getattr(bind, attr)

        @staticmethod
        def makeXferReq(*args):
            req = bind.makeXferReq(*args)
            marks.setdefault("made", time.perf_counter())
            return req

    class Agent:  # what nixl_calls reads of a nixl_agent on its bindings path
        nixl_ops = agent.nixl_ops

    Agent.agent = Stamped()
    post, _ = nixl_calls(Agent())
    if post.via != "bindings":
        raise RuntimeError("--marks: this NIXL has no bindings path to split make from post")
    ep.transport._post = post


def producer(conn, device: str, nbytes: int, shape: tuple, dtype: str, quiet_s: float = 0.0,
             write: bool = False, marked: bool = False, prog_thread: bool | None = None,
             spin_s: float = 0.0, gil: dict | None = None, hot_loop: bool = False,
             wake_loop: bool = False, handoff_spin_s: float | None = None) -> None:
    import torch

    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint

    if handoff_spin_s is not None:  # --handoff-spin-ms: a probe-only patch of the producer
        import ec_nixl.handoff as handoff

        handoff.SPIN_S = handoff_spin_s
    ep = Endpoint(EndpointConfig(name="trace-prod", device=device, listen="127.0.0.1:0",
                                 pool_bytes=max(64 << 20, 8 * nbytes), nixl_progress_thread=prog_thread,
                                 **(gil or {})))
    srv, marks = ep.server, {}
    answer, reply = srv.answer_parked, srv.reply

    def timed_answer(now=None):
        marks.setdefault("answer", time.perf_counter())  # the first call after the publish
        answer(now)

    def timed_reply(identity, msg):
        reply(identity, msg)
        marks.setdefault("sent", time.perf_counter())

    srv.answer_parked, srv.reply = timed_answer, timed_reply
    answers = ep.items.answers  # the publish answers the parked Hold natively: "sent" is its queueing
    if answers is not None:
        queue = answers.send

        def timed_queue(out):
            queued = queue(out)
            marks.setdefault("sent", time.perf_counter())
            return queued  # (False sends the Grants back to the server: the publish then wakes the loop)

        answers.send = timed_queue
    post = ep.transport.post_many

    def timed_post(op, *a, **k):  # --write: "sent" is the WRITE's post
        x = post(op, *a, **k)
        if op == "WRITE":
            marks.setdefault("sent", time.perf_counter())
        return x

    ep.transport.post_many = timed_post
    hx = ep.transport.handoff
    if hx is not None:  # the native thread's own stamps (CLOCK_MONOTONIC, as perf_counter): when
        take = hx.take  # it posted / sent and when NIXL said DONE, read where the owner takes them

        def timed_take(key):
            out = take(key)
            if out.state == "DONE" and "hx done" not in marks:
                marks["hx fired"], marks["hx posted"], marks["hx done"] = out.t_fired, out.t_posted, out.t_done
            return out

        hx.take = timed_take
    if marked:
        mark_calls(ep, marks)
    if wake_loop:  # --wake-loop: every publish wakes the I/O thread, as if something went back to it
        on_publish = ep.items._on_publish
        ep.items._on_publish = lambda back: on_publish(True)
    if hot_loop:  # --hot-loop: the I/O thread polls without blocking (its core never idles)
        ep.loop._idle_timeout = lambda: 0.0
    waits_for = "pushes_parked" if write else "holds_parked"
    rates: list[float] = []  # --spin-ms: the publishing thread's loop iterations per ms (what the I/O thread costs it)
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
        time.sleep(quiet_s)  # --quiet-ms: this process's GPU work long done before the publish
        while ep.metrics.counters.get(waits_for, 0) < parked:  # the consumer's Hold (or Push) is here
            time.sleep(0.0002)
        marks.clear()
        t0 = time.perf_counter()
        ep.publish_slot(mm_hash, slot, shape, getattr(torch, dtype))
        t1 = time.perf_counter()
        end = t1 + spin_s  # --spin-ms: keep running Python after the publish, as a model runner does
        spins = 0
        while time.perf_counter() < end:
            spins += 1
        if spin_s:
            rates.append(spins / (spin_s * 1e3))
        time.sleep(0.005)  # let the answer go out before reporting
        conn.send((t0, t1, marks.get("answer", float("nan")), marks.get("sent", float("nan")),
                   {k: v - t0 for k, v in marks.items() if k not in ("answer", "sent")}))
    if rates:
        print(f"  producer's publishing thread: {statistics.median(rates):.0f} loop iterations per ms while it "
              f"went on after the publish (p50; GIL switch interval {sys.getswitchinterval() * 1e3:g} ms)", flush=True)
    c = ep.metrics.counters  # how the publishes went: natively, or by waking the I/O thread
    print("  producer: " + ", ".join(f"{k} {c.get(k, 0)}" for k in (
        "published", "native_answers", "native_pushes", "publish_wakes")), flush=True)
    ep.close()


def _spread(seconds: list[float]) -> str:
    """p50, p10 and p90 of ``seconds``, in microseconds."""
    xs = sorted(x * 1e6 for x in seconds)
    return f"p50 {statistics.median(xs):8.1f}   p10 {xs[len(xs) // 10]:8.1f}   p90 {xs[9 * len(xs) // 10]:8.1f}"


def keep_busy(stop) -> None:
    """``--busy``: tiny kernels on a stream of their own until ``stop``."""
    import torch

    x = torch.zeros(1024, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()):
        while not stop.is_set():
            x.add_(1)
            time.sleep(0.0002)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--size", default="64K", help="item size (K/M suffixes)")
    ap.add_argument("--n", type=int, default=60, help="hand-offs timed (after 5 untimed)")
    ap.add_argument("--quiet-ms", type=float, default=0.0,
                    help="the producer waits this long after writing an item before publishing it")
    ap.add_argument("--touch", action="store_true",
                    help="the consumer runs a tiny kernel (and waits for it) right before load(): its CUDA "
                         "context is then the GPU's most recent one when the READ is posted")
    ap.add_argument("--busy", action="store_true",
                    help="a thread of the consumer launches a tiny kernel every ~0.2 ms on its own stream, as a "
                         "PD worker's forward passes keep its GPU busy")
    ap.add_argument("--write", action="store_true",
                    help="trace expect-write: a parked Push on a write-mode link, the WRITE started by the publish")
    ap.add_argument("--marks", action="store_true",
                    help="with --write: also stamp the producer's steps from taking the parked Push to the post")
    ap.add_argument("--spin-ms", type=float, default=0.0,
                    help="the producer's publishing thread keeps running Python this long after each publish "
                         "(as vLLM's model runner goes on with its step) instead of sleeping at once")
    ap.add_argument("--gil-switch-ms", type=float, default=None,
                    help="the producer's gil_switch_interval_s in ms (0: leave the interpreter's 5 ms; default: "
                         "EndpointConfig's)")
    ap.add_argument("--python-push", action="store_true",
                    help="the producer posts parked pushes' WRITEs from its I/O thread in Python (native_handoff "
                         "off), as before issue 40; default: the publish starts them off the GIL where the "
                         "library is built")
    ap.add_argument("--no-progress-thread", action="store_true",
                    help="the producer's NIXL agent runs without its progress thread (its loop drives UCX)")
    ap.add_argument("--hot-loop", action="store_true",
                    help="the producer's I/O thread never blocks between rounds (a probe-only patch): is the "
                         "cost of its NIXL calls the cost of waking an idle core?")
    ap.add_argument("--wake-loop", action="store_true",
                    help="every publish wakes the producer's I/O thread (a probe-only patch), as before the "
                         "publish left it asleep when the hand-off answers all that waits (code before 4389dbb)")
    ap.add_argument("--handoff-spin-ms", type=float, default=None,
                    help="how long the producer's hand-off thread spins for the publish once a push is armed or "
                         "a Hold noted (handoff.SPIN_S; default: the library's, 20 ms with 4 CPUs or more, else 0)")
    ap.add_argument("--barrier-spin-ms", type=float, default=None,
                    help="how long the consumer's barrier spins before it blocks between rounds (read_lane.SPIN_S; "
                         "default: the library's, 20 ms with 4 CPUs or more, else 0.5 ms)")
    args = ap.parse_args()
    if args.barrier_spin_ms is not None:  # a probe-only patch of the consumer (this process)
        import ec_nixl.read_lane as read_lane

        read_lane.SPIN_S = args.barrier_spin_ms / 1e3
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
    proc = ctx.Process(target=producer, args=(there, args.device, nbytes, shape, dtype, args.quiet_ms / 1e3,
                                              args.write, args.marks,
                                              False if args.no_progress_thread else None, args.spin_ms / 1e3,
                                              ({} if args.gil_switch_ms is None else
                                               {"gil_switch_interval_s": args.gil_switch_ms / 1e3 or None})
                                              | ({"native_handoff": False} if args.python_push else {}),
                                              args.hot_loop, args.wake_loop,
                                              None if args.handoff_spin_ms is None else args.handoff_spin_ms / 1e3),
                           daemon=True)
    proc.start()
    addr = here.recv()
    ep = Endpoint(EndpointConfig(name="trace-cons", device=args.device, pool_bytes=max(64 << 20, 8 * nbytes),
                                 threaded=False, mode="write" if args.write else "read"))
    barrier = LoadBarrier(ep, settle=False)  # as vLLM's PD worker: settle after the hand-over
    rows, again, extra = [], [], []
    touch = None
    if args.touch and args.device == "cuda":
        import torch

        touch = torch.zeros(1, device="cuda")
    stop = threading.Event()
    if args.busy and args.device == "cuda":
        threading.Thread(target=keep_busy, args=(stop,), daemon=True).start()
    try:
        seen: list[float] = []
        if args.write:
            on_write_done = ep.loader.on_write_done

            def timed_write_done(*a):
                seen.append(time.perf_counter())
                on_write_done(*a)

            ep.loader.on_write_done = timed_write_done
        for i in range(args.n + 5):
            mm_hash = f"trace-{i}"
            if args.write:
                desc = ItemDesc(mm_hash=mm_hash, shape=list(shape), dtype=dtype, nbytes=nbytes)
                if touch is not None:
                    touch.add_(1)
                    torch.cuda.synchronize()
                tickets = ep.load([ItemRef(desc=desc, producer=addr)], timeout=30, wait_s=10)
                ep.progress()
                here.send((mm_hash, i + 1))
                barrier.wait(tickets, timeout=30)
                c_landed = time.perf_counter()
                t0, t1, t_answer, t_sent, more = here.recv()
                for t in tickets:
                    t.release()
                ep.progress()
                if i >= 5:
                    extra.append(more)
                    rows.append([x - t0 for x in (t1, t_answer, t_sent, seen[-1], c_landed)])
                continue
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
            if touch is not None:
                touch.add_(1)
                torch.cuda.synchronize()
            refs = [ItemRef(desc=desc, producer=addr, block=s.block, valid_until=time.time() + s.lease_s - 1,
                            incarnation=hold.incarnation)]
            c_read = time.perf_counter()
            tickets = ep.load(refs)
            c_loaded = time.perf_counter()
            barrier.wait(tickets, timeout=10)
            c_landed = time.perf_counter()
            # The control: the same item read again at once, into another slot (a hot READ; its
            # bytes stay where they are until the producer reserves the next item, after this).
            # The first READ is settled first, as vLLM's worker does at the end of its step: else
            # the second one's wait would do that work while its DMA runs.
            ep.progress()
            t_again = time.perf_counter()
            second = ep.load(refs)
            barrier.wait(second, timeout=10)
            dt_again = time.perf_counter() - t_again
            for t in second:
                t.release()
            t0, t1, t_answer, t_sent, more = here.recv()
            for t in tickets:
                t.release()
            ep.progress()
            if i >= 5:
                rows.append([x - t0 for x in (t1, t_answer, t_sent, c_seen, c_loaded, c_landed)])
                again.append((c_landed - c_read, dt_again))
                extra.append(more)
    finally:
        stop.set()
        here.send(None)
        proc.join(10)
        ep.close()
    print(f"{args.device} {args.size}{' write' if args.write else ''}: {len(rows)} hand-offs, "
          f"microseconds after publishing began")
    for k, name in enumerate(WRITE_STEPS if args.write else STEPS):
        print(f"  {name:24s} {_spread([r[k] for r in rows])}")
    # The producer's own stamps (the hand-off thread's; with --marks its steps), in their order
    names = sorted({k for m in extra for k in m},
                   key=lambda k: statistics.median(m.get(k, float("inf")) for m in extra))
    for name in names:
        xs = [m[name] for m in extra if name in m]
        print(f"    {name:22s} {_spread(xs)}   (n={len(xs)})")
    if args.write:
        return
    first = sorted(a * 1e6 for a, _ in again)
    hot = sorted(b * 1e6 for _, b in again)
    print(f"  the READ itself (load() -> barrier): after the hand-off p50 {statistics.median(first):.1f} us, "
          f"the same item again right after p50 {statistics.median(hot):.1f} us")


if __name__ == "__main__":
    main()
