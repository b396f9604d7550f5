"""Peers that stall or lose messages: a producer whose I/O thread stops, an idle connection,
read-done notifications that never arrive. Waits stay bounded, nothing is declared dead too soon,
and the producer still frees everything.

Peers are real processes (``peers``) moving real bytes over NIXL DRAM; the consumer under test
runs here, unthreaded, so that the test drives its progress. Timings are printed as
``[timing] what: N s`` (``pytest -s`` shows them; docs/RELIABILITY.md quotes them).
"""

from __future__ import annotations

import time

import pytest

from ec_nixl.barrier import LoadBarrier
from ec_nixl.config import EndpointConfig
from ec_nixl.errors import LoadFailed
from helpers import (SMALL, drained, drop_read_done, fetch, fetch_retrying, refs_for, set_peer_timeout, timing,
                     wait_until)


@pytest.mark.parametrize("timers", ["short", "default"])
def test_stalled_producer_fails_loads_in_time_then_recovers(make_peer, make_consumer, device, timers):
    """FAULT INJECTION: the producer's I/O thread stalls (``stall``: a sleep on its owner thread)
    while its process and sockets stay up, so no disconnect is seen. Loads from it fail within the
    load deadline, the consumer keeps serving another producer meanwhile, loads succeed again once
    the stall ends, and the producer still frees everything (pins granted late expire)."""
    kw = {} if timers == "default" else {"load_timeout_s": 1.0, "peer_timeout_s": 1.0}
    budget = 5.0 if timers == "default" else 1.0
    stall = budget + 2.0
    grant = 1.0
    prod = make_peer(grant_lease_s=grant, announce_lease_s=60.0)
    other = make_peer()
    cons = make_consumer(mode="read", pool_bytes=SMALL, **kw)
    warm = [("warm", (32, 32), "float32", 1)]
    set_peer_timeout(cons, 30.0)  # the first handshakes may be slow on a loaded machine
    fetch(cons, refs_for(prod, prod.call("publish", warm)), warm, device, timeout=30)
    specs = [("during", (128, 128), "float32", 2)]
    descs = prod.call("publish", specs)
    ok = [("elsewhere", (64, 64), "float32", 3)]
    ok_descs = other.call("publish", ok)
    assert cons.hold(other.address, ["elsewhere"], timeout=30)["elsewhere"].status == "ready"
    set_peer_timeout(cons, kw.get("peer_timeout_s", EndpointConfig(name="x").peer_timeout_s))
    prod.call("stall", stall)
    t0 = time.monotonic()
    tickets = cons.load(refs_for(prod, descs))
    with pytest.raises(LoadFailed) as e:
        LoadBarrier(cons).wait(tickets)
    waited = timing(f"stalled producer ({timers} timers): load failed after", time.monotonic() - t0)
    assert waited < budget + 2.0, e.value
    assert tickets[0].reason in ("TIMEOUT", "PEER_LOST"), tickets[0]
    assert "during" in str(e.value) and prod.address in tickets[0].error
    fetch(cons, refs_for(other, ok_descs), ok, device)  # others are served during the stall
    # After the stall: the same item loads (retrying, as a caller would, with a deadline).
    assert fetch_retrying(cons, refs_for(prod, descs), specs, stall + 15, pause=0.1, device=device), \
        "never recovered after the stall"
    timing(f"stalled producer ({timers} timers): first success after the stall ended",
           max(0.0, time.monotonic() - (t0 + stall)))
    # Read by its one reader; the pin that the stalled producer granted late to the lost session
    # expires after grant_lease_s, and the item goes then (not when its 60 s lease ends).
    t1 = time.monotonic()
    st = drained(prod, grant + 5)
    timing(f"stalled producer ({timers} timers): producer drained after the retry landed", time.monotonic() - t1)
    assert st["pool"]["used"] == 0 and prod.call("published") == [], prod.call("items")
    assert cons.pool.stats().used == 0


def test_idle_connection_is_not_declared_silent(make_peer, make_consumer, device):
    """A connection left idle for longer than peer_timeout_s (an unthreaded consumer nobody drove)
    is not declared dead the moment work starts: the silence clock starts with the work, so a
    healthy producer serves the load."""
    prod = make_peer()
    cons = make_consumer(mode="read", pool_bytes=SMALL, peer_timeout_s=1.0)
    specs = [("first", (8, 8), "float32", 1), ("second", (8, 8), "float32", 2)]
    descs = prod.call("publish", specs)
    set_peer_timeout(cons, 30.0)  # the first handshake may be slow on a loaded machine
    fetch(cons, refs_for(prod, descs[:1]), specs[:1], device, timeout=30)
    set_peer_timeout(cons, 1.0)
    time.sleep(1.3)  # longer than peer_timeout_s, and nobody drives the consumer
    fetch(cons, refs_for(prod, descs[1:]), specs[1:], device, timeout=10)


def test_lost_read_notification_pin_expires_item_freed(make_peer, make_consumer, device):
    """FAULT INJECTION: the consumer's read-done notifications are dropped (as if each were
    lost). The data is right; the producer's pin expires after grant_lease_s and the item is
    freed when its lease ends, with nothing else to do."""
    grant, lease = 1.0, 2.0
    prod = make_peer(grant_lease_s=grant, announce_lease_s=lease)
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    drop_read_done(cons)  # the fault: every read-done message lost
    cons.query_stats(prod.address, timeout=30)  # handshake first: the 2 s lease runs from publish
    specs = [("quiet", (256, 64), "bfloat16", 1), ("quiet2", (7, 3), "float32", 2)]
    fetch(cons, refs_for(prod, prod.call("publish", specs)), specs, device)
    t0 = time.monotonic()
    assert sorted(prod.call("published")) == ["quiet", "quiet2"], "freed without a notification?"
    assert wait_until(lambda: prod.call("stats")["counters"]["expired_pins"] >= 2, grant + 5, 0.05)
    timing("lost READ notification: pin expired after", time.monotonic() - t0)
    st = drained(prod, lease + 5)
    timing("lost READ notification: item freed after", time.monotonic() - t0)
    assert st["pool"]["used"] == 0 and prod.call("published") == [], st
