"""``ec-nixl bench events``: what publishing encoder-cache events costs an engine, simulated.

An engine's scheduler at ``--rate`` requests/s, each request bringing ``--items`` new items into
vLLM's encoder cache (stored) and, once the cache is full (``--cache-items``), evicting as many
(removed): the worst case, every item new and every item evicted. The driver makes the calls the
adapter makes (``stored``/``removed`` per item, one ``flush`` per request, i.e. per engine step)
on a real ``EventPublisher``; a real subscriber in another process follows it, and must end with
the publisher's state. The cost is this process's CPU time (the driver, the publisher's thread,
ZMQ's I/O thread) with the publisher, minus the same driver with a publisher that does nothing,
measured in interleaved rounds, as a share of one core over the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Optional

GOAL_PCT = 1.0
"""Issue 49: at most 1 % of a core per instance at 100 requests/s."""


class _Null:
    """A publisher that does nothing: the reference."""

    def stored(self, *a) -> None:
        pass

    def removed(self, *a) -> None:
        pass

    def flush(self) -> None:
        pass


def drive(pub, rate: float, seconds: float, items: int, cache_items: int, start: int) -> tuple[int, float, float]:
    """Requests at ``rate`` for ``seconds``: (requests, CPU seconds, wall seconds)."""
    n = int(rate * seconds)
    live: list[str] = []
    t0, c0 = time.monotonic(), time.process_time()
    for i in range(n):
        due = t0 + i / rate
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        for j in range(items):
            h = f"{start + i:08d}-{j}"
            pub.stored(h, "image", 602112, "encoder_cache")
            live.append(h)
        while len(live) > cache_items:
            pub.removed(live.pop(0), "encoder_cache")
        pub.flush()
    return n, time.process_time() - c0, time.monotonic() - t0


def _subscriber(conn, endpoint: str, replay: str) -> None:
    from ec_nixl.events.subscriber import Source, Subscriber

    sub = Subscriber([Source(endpoint, replay)], dead_after_s=60.0)
    conn.send("ready")
    while not conn.poll(0):
        sub.poll(0.05)
    want_seq = conn.recv()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (sub.synced() and sub.status()[0]["seq"] >= want_seq):
        sub.poll(0.05)
    conn.send((sub.index.dump(), dict(sub.counters)))
    sub.close()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ec-nixl bench events", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second (default 100)")
    ap.add_argument("--seconds", type=float, default=10.0, help="per measurement (default 10)")
    ap.add_argument("--items", type=int, default=2, help="new items per request (default 2)")
    ap.add_argument("--cache-items", type=int, default=1000, help="items the simulated cache holds")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--batch-s", type=float, default=None, help="the publisher's batch_s (default: its default)")
    ap.add_argument("--json", default=None, metavar="PATH")
    a = ap.parse_args(argv)
    from ec_nixl.events.publisher import EventPublisher, PublisherConfig

    cfg = PublisherConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "http://bench", ("encoder_cache",))
    if a.batch_s is not None:
        cfg.batch_s = a.batch_s
    pub = EventPublisher(cfg)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_subscriber, args=(child, pub.endpoint, pub.replay_endpoint), daemon=True)
    proc.start()
    conn.recv()
    costs, rows, start = [], [], 0
    try:
        for rnd in range(a.rounds):
            n, ref_cpu, ref_wall = drive(_Null(), a.rate, a.seconds, a.items, a.cache_items, start)
            n, cpu, wall = drive(pub, a.rate, a.seconds, a.items, a.cache_items, start)
            start += n
            pct = 100 * (cpu - ref_cpu) / wall
            costs.append(pct)
            rows.append({"round": rnd, "requests": n, "cpu_s": round(cpu, 4), "ref_cpu_s": round(ref_cpu, 4),
                         "wall_s": round(wall, 3), "cost_pct_core": round(pct, 3)})
            print(f"round {rnd}: {n} requests in {wall:.2f} s: CPU {cpu * 1e3:.1f} ms with the publisher, "
                  f"{ref_cpu * 1e3:.1f} ms without: {pct:.3f} % of a core", flush=True)
        pub.drain()
        st = pub.stats()
        conn.send(st["seq"])
        dump, sub_counters = conn.recv()
        held = pub.held()
        consistent = dump == ({"http://bench": held} if held else {})
    finally:
        pub.close()
        proc.join(10)
    batches, total = st.get("batches", 0), start
    median = statistics.median(costs)
    out = {"rate": a.rate, "items_per_request": a.items, "batch_s": cfg.batch_s, "rounds": rows, "median_cost_pct_core": round(median, 3),
           "batches_per_request": round(batches / total, 3), "events_per_request": round(st.get("events", 0) / total, 3),
           "subscriber_consistent": consistent, "subscriber": sub_counters, "goal_pct": GOAL_PCT}
    print(f"\nevents cost at {a.rate:g} requests/s ({a.items} items each, every one stored then evicted; "
          f"batch_s {cfg.batch_s:g}): "
          f"median {median:.3f} % of a core (goal <= {GOAL_PCT} %: {'met' if median <= GOAL_PCT else 'MISSED'}); "
          f"{out['batches_per_request']} messages and {out['events_per_request']} events per request; "
          f"subscriber {'in sync with' if consistent else 'DIFFERS from'} the publisher")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if consistent else 1


if __name__ == "__main__":
    sys.exit(main())
