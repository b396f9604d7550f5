"""Peers that go away and come back: a producer's address down then served again, a producer
restarted with a new NIXL agent under the same name and port. Requests during the outage fail
cleanly; afterwards the consumer uses only the new incarnation's metadata, arena and blocks.

Peers are real processes (``peers``) moving real bytes over NIXL DRAM; the consumer under test
runs here, unthreaded, so that the test drives its progress.
"""

from __future__ import annotations

import time

import pytest

from ec_nixl.barrier import LoadBarrier
from ec_nixl.errors import LoadFailed
from ec_nixl.handshake import agent_name
from ec_nixl.tickets import ItemRef
from helpers import (MODES, SMALL, connection_state, fetch, fetch_retrying, refs_for, set_peer_timeout,
                     timing)


def test_side_channel_down_then_back(make_peer, make_consumer, device):
    """The producer's address stops answering (killed), then a new producer listens on the SAME
    port: requests during the outage fail cleanly within the peer timeout, later ones succeed."""
    peer_timeout = 1.0
    first = make_peer()
    port = int(first.address.rsplit(":", 1)[1])
    cons = make_consumer(mode="read", pool_bytes=SMALL, peer_timeout_s=peer_timeout, load_timeout_s=3.0)
    specs = [("a", (32, 32), "float32", 1)]
    set_peer_timeout(cons, 30.0)  # the first handshake may be slow on a loaded machine
    fetch(cons, refs_for(first, first.call("publish", specs)), specs, device, timeout=30)
    set_peer_timeout(cons, peer_timeout)
    desc = first.call("publish", [("b", (32, 32), "float32", 2)])[0]
    first.kill()
    for i in range(3):
        t0 = time.monotonic()
        tickets = cons.load([ItemRef(desc=desc, producer=first.address)])
        with pytest.raises(LoadFailed):
            LoadBarrier(cons).wait(tickets)
        waited = timing(f"side channel down: request {i} failed after", time.monotonic() - t0)
        assert waited < peer_timeout + 2.0
        assert tickets[0].reason in ("UNREACHABLE", "PEER_LOST", "TIMEOUT"), tickets[0]
        assert first.address in tickets[0].error
    assert cons.pool.stats().used == 0
    second = make_peer(listen=f"127.0.0.1:{port}")
    assert second.address == first.address
    specs = [("b", (32, 32), "float32", 22)]
    desc = second.call("publish", specs)[0]
    t0 = time.monotonic()
    assert fetch_retrying(cons, [ItemRef(desc=desc, producer=second.address)], specs, 10, device=device)
    timing("side channel back: first success after the new listener was up", time.monotonic() - t0)
    assert cons.pool.stats().used == 0


@pytest.mark.parametrize("mode", MODES)
def test_producer_restarted_with_new_agent_same_name_and_port(make_peer, make_consumer, device, mode):
    """A producer is replaced by a new process with the same name and port (a restart; its NIXL
    agent has a new name): the consumer must use the new agent's metadata and arena only, and
    drops the old agent's. The new producer holds the same
    hash with other bytes at another block, and a block learned from the OLD producer's Hold is
    not trusted against the new one."""
    first = make_peer(name="phoenix")
    port = int(first.address.rsplit(":", 1)[1])
    cons = make_consumer(mode=mode, pool_bytes=SMALL)
    old = [("x", (100, 100), "float32", 1)]
    fetch(cons, refs_for(first, first.call("publish", old)), old, device)
    peer = cons.transport.peers[agent_name("phoenix", first.incarnation)]
    assert peer.incarnation == first.incarnation
    old_dlist = peer.dlist
    desc = first.call("publish", [("y", (100, 100), "float32", 5)])[0]
    h = cons.hold_async(first.address, ["y"], timeout=10)
    assert cons.wait_for(lambda: h.done, 10) and h.states["y"].status == "ready"
    assert h.incarnation == first.incarnation
    stale = ItemRef(desc=desc, producer=first.address, block=h.states["y"].block,
                    valid_until=time.time() + 60, incarnation=h.incarnation)
    first.kill()
    assert cons.wait_for(lambda: connection_state(cons, first.address) is None, 10), "disconnect not seen"
    second = make_peer(name="phoenix", listen=f"127.0.0.1:{port}")
    assert second.incarnation != first.incarnation
    # The new producer's pool: a decoy where 'y' used to be, then x and y with other bytes.
    second.call("publish", [("decoy", (100, 100), "float32", 66)])
    new = [("x", (100, 100), "float32", 2), ("y", (100, 100), "float32", 6)]
    second.call("publish", new)
    fetch(cons, refs_for(second, [d for d in second.call("publish", new[:1])]), new[:1], device)
    peer = cons.transport.peers[agent_name("phoenix", second.incarnation)]
    assert peer.incarnation == second.incarnation and peer.dlist is not old_dlist
    assert agent_name("phoenix", first.incarnation) not in cons.transport.peers, "the old agent stayed loaded"
    tickets = cons.load([stale])  # held by the old incarnation: never asked of the new one
    with pytest.raises(LoadFailed):
        LoadBarrier(cons).wait(tickets)
    assert tickets[0].reason == "RESTARTED" and first.incarnation in tickets[0].error, tickets[0]
    assert cons.pool.stats().used == 0
