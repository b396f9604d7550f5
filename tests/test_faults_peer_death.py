"""Peers that die: producers and consumers killed (SIGKILL) or gone, at every stage of a load.

Loads waiting on a dead producer fail within bounded time naming it; a DMA target whose
transfer's fate is unknown stays quarantined until that is safe; a producer whose consumer died
frees everything when its pins and leases end; the survivors keep serving others. Peers are
real processes (``peers``) moving real bytes over NIXL DRAM; the consumer under test usually runs
here, unthreaded, so that the test drives its progress and sees every state change.
"""

from __future__ import annotations

import time

import pytest

from ec_nixl.barrier import LoadBarrier
from ec_nixl.config import EndpointConfig
from ec_nixl.errors import LoadFailed
from ec_nixl.tickets import ItemRef
from helpers import (MODES, NO_VRAM_TCP, SMALL, TCP_ONLY, awaiting_push, check, connection_state, drained, fetch,
                     fill_pool, landed, overlaps, phase, quarantined_until, refs_for, set_peer_timeout, slot_state,
                     ticket_slot, timing, wait_until)
from peers import ConsumerProcess, digest, make_item


# --------------------------------------------------------------------------------------------
# producer killed


@pytest.mark.parametrize("mode", MODES)
def test_producer_killed_while_consumer_waits(make_peer, make_consumer, device, mode):
    """A producer dies while the consumer waits for an item it has not written yet: the load fails
    within 5 s naming the item, the consumer keeps serving another producer, nothing leaks."""
    prod = make_peer()
    other = make_peer()
    cons = make_consumer(mode=mode, pool_bytes=SMALL, quarantine_s=0.2, peer_timeout_s=30.0, load_timeout_s=10.0)
    desc = prod.call("publish_late", ("never", (256, 256), "float32", 1, 3600.0))
    ok_specs = [("fine", (64, 64), "float32", 2)]
    ok_descs = other.call("publish", ok_specs)
    tickets = cons.load(refs_for(prod, [desc]))
    # The handshake may be slow on a loaded machine; the death must come after it.
    assert cons.wait_for(lambda: connection_state(cons, prod.address) == "ready", 30)
    set_peer_timeout(cons, 2.0)
    cons.wait_for(lambda: False, 0.3)  # let the request reach the producer
    prod.kill()
    t0 = time.monotonic()
    with pytest.raises(LoadFailed) as e:
        LoadBarrier(cons).wait(tickets)
    assert time.monotonic() - t0 < 5.0
    assert list(e.value.failures) == ["never"] and tickets[0].reason == "PEER_LOST", tickets[0]
    # The consumer keeps serving other producers.
    fetch(cons, refs_for(other, ok_descs), ok_specs, device)
    cons.wait_for(lambda: cons.pool.stats().used == 0 and cons.pool.stats().quarantined == 0, 5)
    st = cons.pool.stats()
    assert st.used == 0 and st.quarantined == 0, st


@pytest.mark.parametrize("device", ["cpu"])  # UCX over TCP moves DRAM only; no VRAM twin
def test_producer_killed_mid_transfer_hands_over_only_whole_items(make_peer, make_consumer, device, monkeypatch):
    """The producer is killed while large READs are really in flight: UCX over TCP (no CMA, which
    would copy the bytes while the READ is posted), and the kill comes right after the READs were
    posted, before the consumer drove them any further. The barrier answers within the load
    deadline, and whatever it hands over is byte-exact (the consumer's pool starts poisoned); an
    item that did not land names a lost peer or a failed transfer. Nothing leaks."""
    for k, v in TCP_ONLY.items():
        monkeypatch.setenv(k, v)  # for the consumer's agent, created below in this process
    prod = make_peer(pool_bytes=160 << 20, env=TCP_ONLY)
    cons = make_consumer(mode="read", pool_bytes=160 << 20, quarantine_s=0.2, load_timeout_s=10.0)
    specs = [(f"big{i}", (4096, 4096), "float16", i) for i in range(4)]  # 4 x 32 MiB
    descs = prod.call("publish", specs, timeout=120)
    held = cons.hold(prod.address, [s[0] for s in specs], timeout=30)
    assert all(st.status == "ready" for st in held.values()), held
    refs = [ItemRef(desc=d, producer=prod.address, block=held[d.mm_hash].block,
                    valid_until=time.time() + held[d.mm_hash].lease_s) for d in descs]
    tickets = cons.load(refs)
    cons.progress(0)  # posts the four READs as one request
    assert [phase(t) for t in tickets] == ["read"] * 4, tickets
    prod.kill()
    t0 = time.monotonic()
    try:
        handed = LoadBarrier(cons).wait(tickets)
    except LoadFailed as e:
        handed, failures = None, e.failures
    timing("producer SIGKILL mid-transfer: barrier answered after", time.monotonic() - t0)
    assert time.monotonic() - t0 < 10.0
    if handed is not None:  # everything landed before the kill
        check(handed, specs, device)
    else:
        for t, spec in zip(tickets, specs):
            if landed(t):
                check({t.mm_hash: t.tensor()}, [spec], device)
            else:
                assert t.mm_hash in failures and t.reason in ("PEER_LOST", "XFER_ERR"), t
    for t in tickets:
        t.release()
    assert cons.wait_for(lambda: cons.pool.stats().used == 0, 10), cons.pool.stats()


@pytest.mark.parametrize("mode", MODES)
def test_producer_sigkill_quarantines_dma_target_until_safe(make_peer, make_consumer, device, mode, monkeypatch):
    """A DMA target whose transfer's fate is unknown is not handed out before its quarantine ends.

    READ: both sides use UCX over TCP and the producer is frozen (SIGSTOP), so the consumer's
    READ (posted straight from a Hold) cannot finish; then the producer is killed. WRITE: the
    producer was asked to push into a slot and died before answering. Either way the slot goes to
    quarantine; filling the pool shows no allocation reaches it until the quarantine ends, and
    then every block is usable again.
    """
    quarantine = 1.5
    if mode == "read" and device != "cpu":
        pytest.skip(NO_VRAM_TCP)
    env = TCP_ONLY if mode == "read" else {}
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # for the consumer's agent, created below in this process
    prod = make_peer(pool_bytes=64 << 20, env=env)
    other = make_peer(env=env)
    cons = make_consumer(mode=mode, pool_bytes=48 << 20, quarantine_s=quarantine)
    if mode == "read":
        spec = ("victim", (4096, 2048), "float32", 1)  # 32 MiB
        desc = prod.call("publish", [spec])[0]
        st = cons.hold(prod.address, ["victim"], timeout=30)["victim"]
        assert st.status == "ready"
        ref = ItemRef(desc=desc, producer=prod.address, block=st.block, valid_until=time.time() + st.lease_s)
        prod.stop()
        tickets = cons.load([ref])  # posts the READ at once: we own the consumer's progress
        cons.wait_for(lambda: False, 0.2)
        assert phase(tickets[0]) == "read" and not tickets[0].done, tickets[0]
        prod.kill()
        t0 = time.monotonic()
    else:
        spec = ("victim", (512, 1024), "float32", 1)  # 2 MiB
        desc = prod.call("publish_late", (*spec, 3600.0))
        tickets = cons.load([ItemRef(desc=desc, producer=prod.address)])
        assert cons.wait_for(lambda: phase(tickets[0]) == "push" and awaiting_push(cons, prod.address), 10)
        prod.kill()
        t0 = time.monotonic()
    target = ticket_slot(tickets[0])
    with pytest.raises(LoadFailed) as e:
        LoadBarrier(cons).wait(tickets)
    timing(f"producer SIGKILL ({mode}): in-flight load failed after", time.monotonic() - t0)
    assert time.monotonic() - t0 < 5.0
    assert list(e.value.failures) == ["victim"], e.value
    # Quarantined (or, if NIXL could not cancel the transfer yet, held as a zombie that goes to
    # quarantine once it can): either way out of the free list.
    assert target is not None and slot_state(target) != "free", (tickets[0], cons.pool.stats())
    t_fail = time.monotonic()
    others = fill_pool(cons.pool)
    assert not any(overlaps(s, target) for s in others), "a quarantined DMA target was handed out"
    free_blocks = cons.pool.nblocks - cons.pool.reserved_blocks
    assert len(others) == free_blocks - target.nblocks, "everything but the quarantined slot is usable"
    for s in others:
        cons.pool.release(s)
    assert cons.wait_for(lambda: slot_state(target) == "quarantined", 10), target
    until = quarantined_until(cons.pool, target)
    assert cons.wait_for(lambda: slot_state(target) == "free", quarantine + 10), target
    assert time.monotonic() >= until, "quarantine ended early"
    timing(f"producer SIGKILL ({mode}): quarantined slot reusable after", time.monotonic() - t_fail)
    whole = fill_pool(cons.pool)
    assert len(whole) == free_blocks and any(overlaps(s, target) for s in whole)
    for s in whole:
        cons.pool.release(s)
    assert cons.pool.stats().used == 0
    # The consumer keeps serving other producers.
    specs = [("fine", (64, 64), "float32", 2)]
    fetch(cons, refs_for(other, other.call("publish", specs)), specs, device)
    assert cons.pool.stats().used == 0


def test_producer_sigkill_with_default_timers(make_peer, make_consumer, device):
    """Defaults only (load_timeout_s=5, peer_timeout_s=5): loads waiting on a killed producer fail
    within 5 s (in practice at once: the side channel's TCP connection breaks), in both modes."""
    defaults = EndpointConfig(name="x")
    assert defaults.load_timeout_s <= 5.0 and defaults.peer_timeout_s <= 5.0
    prod = make_peer()
    r = make_consumer(mode="read", pool_bytes=SMALL)
    w = make_consumer(mode="write", pool_bytes=SMALL)
    d1 = prod.call("publish_late", ("never-r", (256, 256), "float32", 1, 3600.0))
    d2 = prod.call("publish_late", ("never-w", (256, 256), "float32", 2, 3600.0))
    tr = r.load(refs_for(prod, [d1]))
    tw = w.load(refs_for(prod, [d2]))
    assert r.wait_for(lambda: connection_state(r, prod.address) == "ready", 10)
    assert w.wait_for(lambda: connection_state(w, prod.address) == "ready", 10)
    r.wait_for(lambda: False, 0.1)
    w.wait_for(lambda: False, 0.1)
    prod.kill()
    t0 = time.monotonic()
    for cons, mode, tickets in ((r, "read", tr), (w, "write", tw)):
        with pytest.raises(LoadFailed) as e:
            LoadBarrier(cons).wait(tickets)
        reason = tickets[0].reason
        timing(f"producer SIGKILL, default timers ({mode}): failed after", time.monotonic() - t0)
        assert reason == "PEER_LOST" and prod.address in tickets[0].error, e.value
    assert time.monotonic() - t0 < 5.0
    for cons in (r, w):
        assert cons.wait_for(lambda: cons.pool.stats().used == 0, 15), cons.pool.stats()


# --------------------------------------------------------------------------------------------
# consumer killed or gone


def test_consumer_sigkill_holding_grants(make_peer, make_consumer, device):
    """A consumer process takes READ grants (pins) and Holds, then is killed: the producer's pins
    and leases expire, its pool returns to 0, and it keeps serving others, including the killed
    consumer restarted under the same name (a new NIXL agent for an old name)."""
    grant, lease = 1.0, 2.0
    # load_timeout_s: how long the producer keeps a dropped reader's READ target (grant + it)
    prod = make_peer(grant_lease_s=grant, announce_lease_s=lease, load_timeout_s=grant)
    cons = make_peer(ConsumerProcess, name="restarting-consumer", mode="read")
    cons.call("query_stats", (prod.address, 30))  # handshake first: the 2 s lease runs from publish
    specs = [("pinned", (300, 300), "float32", 1), ("held", (100, 100), "float32", 2)]
    prod.call("publish", specs)
    assert cons.call("get_only", (prod.address, ["pinned"], 10))["pinned"][0] == "ready"
    assert cons.call("hold", (prod.address, ["held"], 10))["held"][0] == "ready"
    cons.kill()
    t0 = time.monotonic()
    st = drained(prod, grant + lease + 10)
    timing("consumer SIGKILL holding grants: producer pool back to 0 after", time.monotonic() - t0)
    assert st["pool"]["used"] == 0 and prod.call("published") == []
    # its session is reclaimed when the connection drops (its pins go; the pinned slot stays until
    # the READ's deadline, grant + load_timeout_s); the leases run out
    assert st["counters"]["reclaimed_sessions"] >= 1 and st["counters"]["expired_leases"] >= 2
    # Others are served; so is the same consumer name with a new agent (a restarted rank).
    again = make_peer(ConsumerProcess, name="restarting-consumer", mode="read")
    more = [("after", (50, 70), "float32", 3)]
    descs = prod.call("publish", more)
    got = again.call("load", ([(descs[0], prod.address, 0, 1)], 10))
    assert got[0][1] == "landed", got
    assert got[0][3] == digest(make_item(3, (50, 70), "float32"))
    fresh = make_consumer(mode="read", pool_bytes=SMALL)
    more = [("after2", (50, 70), "float32", 4)]
    fetch(fresh, refs_for(prod, prod.call("publish", more)), more, device)
    assert drained(prod)["pool"]["used"] == 0


@pytest.mark.parametrize("when", ["queued", "posted"])
def test_consumer_sigkill_while_producer_pushes(make_peer, make_consumer, device, when):
    """WRITE mode: the consumer dies while the producer has a push queued for it (item not ready
    yet) or a WRITE posted into it. For 'posted' both sides use UCX over TCP and the consumer is
    frozen (SIGSTOP) before the item becomes ready, so the producer's 32 MiB WRITE is posted and
    cannot finish when the consumer is killed. The producer's push ends, the lease expires, its
    pool returns to 0, it serves others, and the consumer's name can come back."""
    lease = 1.5
    if when == "posted" and device != "cpu":
        pytest.skip(NO_VRAM_TCP)
    env = TCP_ONLY if when == "posted" else {}
    prod = make_peer(pool_bytes=64 << 20, announce_lease_s=lease, grant_lease_s=lease, env=env)
    cons = make_peer(ConsumerProcess, name=f"pushed-consumer-{when}", mode="write",
                 pool_bytes=64 << 20, env=env)
    shape = (256, 256) if when == "queued" else (4096, 4096)  # 256 KiB or 32 MiB of float16
    delay = 2.0
    desc = prod.call("publish_late", ("late", shape, "float16", 1, delay))
    t_pub = time.monotonic()
    cons.call("load_async", ([(desc, prod.address, 0, 1)], 60))
    assert wait_until(lambda: prod.call("pushes") == [("late", "queued")], 30), \
        (prod.call("pushes"), cons.call("phases"))
    if when == "posted":
        cons.stop()
        assert wait_until(lambda: prod.call("pushes") == [("late", "posted")], delay + 30), prod.call("pushes")
    assert time.monotonic() < t_pub + delay or when == "posted", "the item became ready too soon"
    cons.kill()
    t0 = time.monotonic()
    st = drained(prod, delay + lease + 15)
    timing(f"consumer SIGKILL while pushed to ({when}): producer pool back to 0 after", time.monotonic() - t0)
    assert st["pool"]["used"] == 0 and prod.call("published") == [] and prod.call("pushes") == [], st
    again = make_peer(ConsumerProcess, name=f"pushed-consumer-{when}", mode="write", env=env)
    more = prod.call("publish", [("after", (64, 64), "float32", 9)])
    got = again.call("load", ([(more[0], prod.address, 0, 1)], 30))
    assert got[0][1] == "landed" and got[0][3] == digest(make_item(9, (64, 64), "float32")), got
    fresh = make_consumer(mode="write", pool_bytes=SMALL)
    specs = [("after2", (64, 64), "float32", 10)]
    fetch(fresh, refs_for(prod, prod.call("publish", specs)), specs, device, timeout=30)


def test_consumer_gone_producer_leases_expire(make_peer, make_consumer, device):
    """A consumer that held items and closed: the producer frees them when their leases end."""
    prod = make_peer(announce_lease_s=0.5, grant_lease_s=0.5)
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    prod.call("publish", [("orphan", (128, 128), "float32", 1)])
    assert cons.hold(prod.address, ["orphan"], timeout=5)["orphan"].status == "ready"
    cons.close()
    st = drained(prod, 5)
    assert st["pool"]["used"] == 0 and st["counters"]["expired_leases"] == 1, st
