"""Soak: 2 producer processes : 2 consumer processes (one READs, one is written to) moving >= 10 000
items of random sizes and dtypes over real NIXL, each checked by its blake2b digest.

Nothing may fail or differ; afterwards every pool on all four sides is empty, both producers have
freed every item, and no process grew its resident memory by more than ``RSS_GROWTH`` after the
warm-up rounds. ``EC_NIXL_SOAK_ITEMS`` changes the item count (e.g. for a longer local run).
"""

from __future__ import annotations

import os
import random
import time

import pytest

from peers import ConsumerProcess, ProducerProcess, rss_bytes

ITEMS = int(os.environ.get("EC_NIXL_SOAK_ITEMS", "10000"))
PER_ROUND = 100  # items per consumer per round
WARMUP_ROUNDS = 3
RSS_GROWTH = 64 << 20
POOL = 192 << 20
DTYPES = ["bfloat16", "float16", "float32", "float64", "int8", "uint8", "int32", "int64"]
SIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int32": 4, "int64": 8}
LARGE_PER_ROUND = 3  # at most this many multi-MiB items per consumer and round


def random_item(rng: random.Random, large_left: int) -> tuple[tuple[int, int], str]:
    """Mostly small (a few rows of an encoder output), some medium, a few up to 4 MiB."""
    dtype = rng.choice(DTYPES)
    width = rng.choice([16, 64, 128, 256, 1000, 1024])
    r = rng.random()
    if r < 0.90 or not large_left:
        target = rng.randint(1, 96 << 10)
    elif r < 0.98:
        target = rng.randint(96 << 10, 1 << 20)
    else:
        target = rng.randint(1 << 20, 4 << 20)
    rows = max(1, target // (width * SIZE[dtype]))
    return (rows, width), dtype


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_2x2_read_and_write(device):
    if device != "cpu":
        pytest.skip("the soak runs on DRAM")
    rng = random.Random(20261202)
    producers = [ProducerProcess(name=f"soak-p{i}", device=device, pool_bytes=POOL) for i in range(2)]
    # Generous deadlines: this checks integrity, leaks and memory under sustained load on a shared
    # machine; detecting dead or silent peers within the default 5 s is test_faults_*'s job.
    consumers = [ConsumerProcess(name=f"soak-c-{mode}", device=device, pool_bytes=POOL, mode=mode,
                                 load_timeout_s=60.0, peer_timeout_s=30.0) for mode in ("read", "write")]
    everyone = producers + consumers
    try:
        rounds = max(WARMUP_ROUNDS + 2, -(-ITEMS // (PER_ROUND * len(consumers))))
        moved = 0
        failures: list = []
        mismatches: list = []
        nbytes = steady_bytes = steady_items = 0
        load_s = 0.0
        rss: dict[str, list[int]] = {p.name: [] for p in everyone}
        t_start = time.perf_counter()
        seq = 0

        def plan_round():
            """Every consumer gets PER_ROUND items, each from a random producer."""
            nonlocal seq
            plan: list[list[str]] = [[] for _ in consumers]
            per_producer: list[list[tuple]] = [[] for _ in producers]
            for ci in range(len(consumers)):
                large_left = LARGE_PER_ROUND
                for _ in range(PER_ROUND):
                    shape, dtype = random_item(rng, large_left)
                    if shape[0] * shape[1] * SIZE[dtype] > (1 << 20):
                        large_left -= 1
                    spec = (f"soak-{seq}", shape, dtype, seq)
                    seq += 1
                    plan[ci].append(spec[0])
                    per_producer[rng.randrange(len(producers))].append(spec)
            for p, specs in zip(producers, per_producer):
                p.send("publish_bytes", specs)
            return plan

        plan = plan_round()
        for rnd in range(rounds):
            if rnd in (WARMUP_ROUNDS, rounds // 2, rounds - 1):
                for p in everyone:
                    rss[p.name].append(rss_bytes(p.pid))
            published = {}
            for p in producers:
                for desc, dig in p.result("publish_bytes", 120):
                    published[desc.mm_hash] = (p.address, desc, dig)
            t0 = time.perf_counter()
            for c, items in zip(consumers, plan):
                c.send("load", ([(published[h][1], published[h][0], 0, 1) for h in items], 60.0))
            this_plan, plan = plan, (plan_round() if rnd + 1 < rounds else None)  # publish the next meanwhile
            for c, items in zip(consumers, this_plan):
                for mm_hash, state, error, dig in c.result("load", 180):
                    if state != "landed":
                        failures.append((c.name, mm_hash, state, error))
                    elif dig != published[mm_hash][2]:
                        mismatches.append((c.name, mm_hash))
                    else:
                        moved += 1
                        nbytes += published[mm_hash][1].nbytes
            # Fail fast: a wrong byte or a lost item ends the soak at the round it happened in
            # (a consumer that kept the slots of items it never got would otherwise stall later
            # rounds until the timeout, hiding the cause).
            assert not mismatches, f"round {rnd}: {len(mismatches)} item(s) handed over with other bytes: " \
                                   f"{mismatches[:10]}"
            assert not failures, f"round {rnd}: {len(failures)} item(s) failed: {failures[:10]}"
            if rnd >= WARMUP_ROUNDS:  # handshakes, link probes and UCX wire-up are not throughput
                load_s += time.perf_counter() - t0
                steady_items += sum(len(items) for items in this_plan)
                steady_bytes += sum(published[h][1].nbytes for items in this_plan for h in items)
        wall = time.perf_counter() - t_start
        print(f"\n[soak] {moved} items, {nbytes / 1e6:.1f} MB in {rounds} rounds, {wall:.1f} s wall (with item "
              f"generation); after warm-up: {steady_items / load_s:.0f} items/s, "
              f"{steady_bytes / load_s / 1e6:.1f} MB/s while loading ({load_s:.1f} s)")
        assert moved >= ITEMS
        # Drained on all four sides: producers freed every item (the last READ notifications may
        # still be on their way), consumers hold nothing.
        deadline = time.monotonic() + 15
        for p in producers:
            while p.call("published") and time.monotonic() < deadline:
                time.sleep(0.05)
            st = p.call("stats")
            assert p.call("published") == [], (p.name, p.call("published")[:5])
            assert st["pool"]["used"] == 0 and st["pool"]["quarantined"] == 0, (p.name, st["pool"])
        for c in consumers:
            st = c.call("stats")
            assert st["pool"]["used"] == 0 and st["pool"]["quarantined"] == 0, (c.name, st["pool"])
            assert st["counters"]["loads_failed"] == 0, (c.name, st["failure_reasons"])
        for name, samples in rss.items():
            mib = [s >> 20 for s in samples]
            print(f"[soak] RSS {name}: {mib} MiB (after warm-up, middle, end)")
            assert samples[-1] - samples[0] < RSS_GROWTH, f"{name} grew {mib} MiB"
    finally:
        for p in everyone:
            p.close()
