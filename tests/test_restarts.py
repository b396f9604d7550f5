"""Restarts and late failures: a new producer incarnation is a new peer everywhere at once, a load
that fails after admission is encoded locally when its request carries the media, and a consumer
that stops answering loses its sessions, holds and leases in bounded time.

Producers and killed consumers are real processes (``peers``) moving real bytes over NIXL DRAM.
The consumer under test usually runs here unthreaded, like a vLLM consumer worker (it runs only
when a load asks it to). The vLLM adapter's side (a load failing after admission is encoded in
the same step) is in tests/test_vllm_restarts.py. Timings print as ``[timing] what: N s``
(``pytest -s``; docs/RELIABILITY.md quotes them).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import aiohttp
import pytest

from ec_nixl.barrier import LoadBarrier
from ec_nixl.config import EndpointConfig
from ec_nixl.endpoint import Endpoint
from ec_nixl.errors import LoadFailed
from ec_nixl.handshake import agent_name
from ec_nixl.tickets import ItemRef
from peers import ConsumerProcess, digest, make_item
from helpers import SMALL, timing, wait_until  # noqa: F401


@pytest.fixture
def procs(make_peer):
    """Peer processes of a test (the shared ``make_peer`` factory)."""
    return make_peer



@pytest.fixture
def control():
    """A threaded control-only endpoint: what vLLM's scheduler process uses to hold items."""
    made = []

    def make(**kw):
        kw.setdefault("name", f"sched-{len(made)}-{time.monotonic_ns() % 10**9}")
        ep = Endpoint(EndpointConfig(pool_bytes=0, **kw))
        made.append(ep)
        return ep

    yield make
    for ep in made:
        ep.close()


def hold(ep: Endpoint, producer: str, h: str, timeout: float = 20.0):
    """Hold ``h`` until the producer says it is ready (a restarted one may need a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        q = ep.hold_async(producer, [h], timeout=5.0)
        ep.wait_for(lambda: q.done, 6.0)
        if q.done and q.states[h].status == "ready":
            return q
        assert time.monotonic() < deadline, q.states
        time.sleep(0.05)


def ref_from(desc, producer: str, q) -> ItemRef:
    s = q.states[desc.mm_hash]
    return ItemRef(desc=desc, producer=producer, block=s.block, valid_until=time.time() + s.lease_s - 1.0,
                   incarnation=q.incarnation)


def landed(cons: Endpoint, refs: list[ItemRef], seed: int, shape, dtype="float32") -> None:
    tickets = cons.load(refs)
    out = LoadBarrier(cons).wait(tickets)
    assert digest(out[refs[0].mm_hash]) == digest(make_item(seed, shape, dtype)), "bytes differ"
    for t in tickets:
        t.release()


def held_by_a_warm_link(cons: Endpoint, prod, h: str):
    """A ready link (one item loaded over it), then item ``h`` (256 x 256 float32, seed 5)
    published and held by ``cons`` itself: its description and the answered hold."""
    warm = prod.call("publish", [("warm", (16, 16), "float32", 4)])[0]
    landed(cons, [ItemRef(desc=warm, producer=prod.address)], 4, (16, 16))
    desc = prod.call("publish", [(h, (256, 256), "float32", 5)])[0]
    q = cons.hold_async(prod.address, [h], timeout=10)
    assert cons.wait_for(lambda: q.done, 10) and q.states[h].status == "ready"
    return desc, q


# --------------------------------------------------------------------------------------------
# (1) a new incarnation is a new peer everywhere at once


@pytest.mark.parametrize("mode", ["read", "write"])
def test_unthreaded_consumer_follows_a_restarted_producer(procs, make_consumer, control, device, mode):
    """The scenario of issue 14: the scheduler's (threaded) endpoint sees the producer die and
    holds the item from its restarted incarnation; the worker's (unthreaded) endpoint still has
    a ready link to the dead one when the load arrives. The load must reach the new incarnation,
    through a new NIXL peer, and land its bytes."""
    first = procs(device=device, name="phoenix-r")
    address = first.address
    port = int(address.rsplit(":", 1)[1])
    sched = control()
    cons = make_consumer(mode=mode, pool_bytes=SMALL)
    desc = first.call("publish", [("a", (64, 64), "float32", 1)])[0]
    landed(cons, [ref_from(desc, address, hold(sched, address, "a"))], 1, (64, 64))
    stale = cons.links.find(address)
    assert stale is not None and stale.incarnation == first.incarnation
    old_dlist = cons.transport.peers[agent_name("phoenix-r", first.incarnation)].dlist

    first.kill()
    second = procs(device=device, name="phoenix-r", listen=f"127.0.0.1:{port}")
    desc = second.call("publish", [("b", (64, 64), "float32", 2)])[0]
    q = hold(sched, address, "b")
    assert q.incarnation == second.incarnation != first.incarnation
    assert cons.links.find(address) is stale and stale.state == "ready", "the worker has not looked yet"

    t0 = time.monotonic()
    landed(cons, [ref_from(desc, address, q)], 2, (64, 64))
    timing(f"unthreaded consumer, producer restarted ({mode}): first load landed after", time.monotonic() - t0)
    peer = cons.transport.peers[agent_name("phoenix-r", second.incarnation)]
    assert peer.incarnation == second.incarnation and peer.dlist is not old_dlist
    assert agent_name("phoenix-r", first.incarnation) not in cons.transport.peers, "the old agent stayed loaded"
    assert cons.links.find(address).incarnation == second.incarnation
    assert cons.pool.stats().used == 0


def test_a_ref_held_by_another_incarnation_is_never_asked_of_this_one(procs, make_consumer, device):
    """A ref whose hold came from an incarnation the address no longer runs: the ready link is
    replaced (it might lead to a dead process), the address answers as the same other
    incarnation, and the load fails RESTARTED naming both; nothing is asked of that process.
    The next load on the new link works."""
    prod = procs(device=device)
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    desc = prod.call("publish", [("x", (32, 32), "float32", 3)])[0]
    landed(cons, [ItemRef(desc=desc, producer=prod.address)], 3, (32, 32))
    link = cons.links.find(prod.address)
    gone = "0123456789abcdef"
    tickets = cons.load([ItemRef(desc=desc, producer=prod.address, block=0, valid_until=time.time() + 60,
                                 incarnation=gone)])
    with pytest.raises(LoadFailed):
        LoadBarrier(cons).wait(tickets)
    t = tickets[0]
    assert t.reason == "RESTARTED" and t.retryable, t
    assert gone in t.error and prod.incarnation in t.error, t.error
    assert cons.links.find(prod.address) is not link, "the link was not replaced"
    desc = prod.call("publish", [("x2", (32, 32), "float32", 33)])[0]
    landed(cons, [ItemRef(desc=desc, producer=prod.address, incarnation=prod.incarnation)], 33, (32, 32))
    assert cons.pool.stats().used == 0


def test_a_held_step_whose_producer_died_fails_retryable_at_once(procs, make_consumer, device):
    """The producer of a held item dies before the load, and our unthreaded consumer has not run
    since: its link still says ready, the disconnect waits unread in the link's monitor. The held
    step takes the direct path (the monitor is looked at after the post, while a READ would run;
    here NIXL may refuse the post already), and nothing of it is handed over: the item fails
    PEER_LOST, retryable (the caller gets it elsewhere), naming the producer, within a second,
    and its slot comes back."""
    prod = procs(device=device)
    cons = make_consumer(mode="read", pool_bytes=SMALL, quarantine_s=0.2)
    desc, q = held_by_a_warm_link(cons, prod, "gone")
    link = cons.links.find(prod.address)
    prod.kill()
    assert wait_until(lambda: cons.links.unread(link), 10), "the disconnect never reached the monitor"
    assert link.state == "ready", "the consumer has not looked yet"

    t0 = time.monotonic()
    tickets = cons.load([ref_from(desc, prod.address, q)], timeout=5)
    with pytest.raises(LoadFailed):
        LoadBarrier(cons).wait(tickets)
    took = time.monotonic() - t0
    t = tickets[0]
    assert t.reason == "PEER_LOST" and t.retryable and prod.address in t.error, t
    assert took < 1.0, f"took {took:.2f} s"
    print(f"[info] held step of a dead producer failed in {took * 1e3:.1f} ms with: {t.error}")
    assert cons.wait_for(lambda: cons.pool.stats().used == 0 and cons.pool.stats().quarantined == 0, 5)


def test_read_seen_done_after_its_deadline_is_not_handed_over(procs, make_consumer, device):
    """A consumer that was stopped (or starved) past a load's deadline may see its READ done only
    then; by that time the producer may have reclaimed the slot (its session timed out) and
    reused it. Such bytes are not handed over: the load fails TIMEOUT."""
    prod = procs(device=device)
    cons = make_consumer(mode="read", pool_bytes=SMALL, quarantine_s=0.2)
    desc, q = held_by_a_warm_link(cons, prod, "late")
    tickets = cons.load([ref_from(desc, prod.address, q)], timeout=0.3)
    assert tickets[0].phase == "read", tickets[0]  # the owner posts at once; nobody has polled it
    time.sleep(0.5)  # "stopped" past the deadline
    cons.progress(0.0)  # back: the first round sees the READ's outcome
    t = tickets[0]
    assert t.state == "failed" and t.reason == "TIMEOUT", t
    with pytest.raises(LoadFailed):
        LoadBarrier(cons).wait(tickets)
    print(f"[info] late READ failed with: {t.error}")
    assert cons.wait_for(lambda: cons.pool.stats().used == 0 and cons.pool.stats().quarantined == 0, 5)


def test_idle_link_to_a_producer_that_stops_answering_is_dropped(procs, control, device):
    """A producer frozen (SIGSTOP: its sockets stay open) answers no ping: an idle consumer drops
    its link after ``link_timeout_s``, so no later load is sent into the frozen process's session."""
    timeout = 1.0
    prod = procs(device=device, link_timeout_s=timeout, heartbeat_s=0.2)
    sched = control(link_timeout_s=timeout, heartbeat_s=0.2)
    prod.call("publish", [("p", (16, 16), "float32", 1)])
    hold(sched, prod.address, "p")
    assert sched.links.find(prod.address) is not None
    prod.stop()
    t0 = time.monotonic()
    try:
        assert wait_until(lambda: sched.links.find(prod.address) is None, 10 * timeout + 10)
        timing("producer SIGSTOP: idle consumer dropped its link after", time.monotonic() - t0)
    finally:
        prod.cont()


# --------------------------------------------------------------------------------------------
# (3) a consumer that stops answering


@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_producer_reclaims_a_consumer_that_stops_answering(procs, device, how):
    """A consumer holds items (one also held by a live consumer, one only by itself, one pinned
    by a READ grant) and then stops answering (frozen: its sockets stay open) or dies. The
    producer ends its session within ``link_timeout_s`` (ZMQ pings it; a dead one closes at
    once), frees what only it held a grace period later, and the live consumer is untouched. The
    item it was granted a READ of is kept until that READ's deadline has passed (grant time plus
    ``load_timeout_s``): a frozen reader may wake with its READ still running and trust it."""
    timeout = 1.0
    load_timeout = 4.0
    prod = procs(device=device, link_timeout_s=timeout, heartbeat_s=0.2, announce_lease_s=120.0,
                 grant_lease_s=120.0, load_timeout_s=load_timeout)
    address = prod.address
    gone = procs(ConsumerProcess, device=device, mode="read")
    live = procs(ConsumerProcess, device=device, mode="read")
    specs = [("shared", (64, 64), "float32", 1), ("only", (128, 128), "float32", 2),
             ("pinned", (128, 128), "float32", 3)]
    descs = {d.mm_hash: d for d in prod.call("publish", specs)}
    for c in (gone, live):
        assert c.call("hold", (address, ["shared"], 10))["shared"][0] == "ready"
    assert gone.call("hold", (address, ["only"], 10))["only"][0] == "ready"
    assert gone.call("get_only", (address, ["pinned"], 10))["pinned"][0] == "ready"
    t_grant = time.monotonic()
    st = prod.call("stats")
    assert st["sessions"] == 2 and st["items"] == 3, st

    (gone.stop if how == "SIGSTOP" else gone.kill)()
    t0 = time.monotonic()
    assert wait_until(lambda: prod.call("stats")["sessions"] == 1, 10 * timeout + 10), prod.call("stats")
    reclaimed = timing(f"consumer {how}: producer ended its session after", time.monotonic() - t0)
    time.sleep(timeout + 0.5)  # past the grace of what only it held: "only" may go, "pinned" may not yet
    if time.monotonic() < t_grant + load_timeout - 0.5:  # (a loaded machine may get here late)
        assert "pinned" in prod.call("published"), "a dropped reader's READ target was freed before its deadline"
    assert wait_until(lambda: prod.call("published") == ["shared"], 10 * timeout + 10), prod.call("items")
    freed = timing(f"consumer {how}: items only it held freed after", time.monotonic() - t0)
    st = prod.call("stats")
    assert st["counters"]["reclaimed_sessions"] == 1, st["counters"]
    assert st["counters"]["expired_pins"] == 0, "the pin went with the session, not by its 120 s lease"
    bound = max((timeout + 1.0) * (2 if how == "SIGSTOP" else 1) + timeout, load_timeout) + 2.0  # detect, grace, slack
    assert freed < bound, f"reclaim took {freed:.2f}s (bound {bound:.1f}s)"
    assert how == "SIGSTOP" or reclaimed < 2.0, "a closed connection is seen at once"

    got = live.call("load", ([(descs["shared"], address, 0, 1)], 10))
    assert got[0][1] == "landed" and got[0][3] == digest(make_item(1, (64, 64), "float32")), got
    st = wait_until(lambda: (s := prod.call("stats"))["items"] == 0 and s["pool"]["used"] == 0 and s, 10)
    assert st, prod.call("stats")
    assert st["sessions"] == 1, "the live consumer keeps its session"
    gone.kill()


def test_idle_consumer_keeps_its_session(procs, make_consumer, device):
    """An unthreaded consumer that does not run at all for several ``link_timeout_s`` (a vLLM
    worker between requests) keeps its session: ZMQ answers the pings, not the endpoint."""
    prod = procs(device=device, link_timeout_s=0.5, heartbeat_s=0.1)
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    desc = prod.call("publish", [("i", (32, 32), "float32", 6)])[0]
    landed(cons, [ItemRef(desc=desc, producer=prod.address)], 6, (32, 32))
    link = cons.links.find(prod.address)
    time.sleep(2.0)
    st = prod.call("stats")
    assert st["sessions"] == 1 and st["counters"]["reclaimed_sessions"] == 0, st
    desc = prod.call("publish", [("j", (32, 32), "float32", 7)])[0]
    landed(cons, [ItemRef(desc=desc, producer=prod.address)], 7, (32, 32))
    assert cons.links.find(prod.address) is link, "the link survived the idle time"


def test_consumer_whose_session_was_reclaimed_reconnects(procs, make_consumer, device):
    """A consumer frozen past ``link_timeout_s`` comes back: the producer dropped its
    connection and session, so its link is lost and the next load connects afresh."""
    prod = procs(device=device, link_timeout_s=0.5, heartbeat_s=0.1)
    cons = procs(ConsumerProcess, device=device, mode="read")
    desc = prod.call("publish", [("k", (32, 32), "float32", 8)])[0]
    assert cons.call("load", ([(desc, prod.address, 0, 1)], 10))[0][1] == "landed"
    cons.stop()
    assert wait_until(lambda: prod.call("stats")["counters"]["reclaimed_sessions"] == 1, 15)
    cons.cont()
    desc = prod.call("publish", [("l", (32, 32), "float32", 9)])[0]
    got = cons.call("load", ([(desc, prod.address, 0, 1)], 20))
    assert got[0][1] == "landed" and got[0][3] == digest(make_item(9, (32, 32), "float32")), got


def test_a_get_the_producer_dropped_unanswered_goes_out_once_more_on_a_new_connection(procs, make_consumer,
                                                                                       device):
    """The producer says it no longer knows our session while our Get is unanswered (what a
    consumer paused past ``link_timeout_s`` meets: its first request after the pause goes out on a
    connection the producer already closed). The Refused is **injected** (a fault; the producer
    itself still serves): the Get goes out again on a new connection and the items land; a ticket
    is sent again once only, then fails naming the producer, and no slot leaks."""
    from helpers import check, connection_state, fetch, refs_for, refuse_session, unanswered_gets

    prod = procs(device=device)
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    specs = [("a", (64, 64), "float32", 3), ("b", (32, 16), "float32", 4)]
    warm = [("warm", (8, 8), "float32", 1)]
    fetch(cons, refs_for(prod, prod.call("publish", warm)), warm, device)  # a ready link: Gets go out in load()
    refs = refs_for(prod, prod.call("publish", specs))

    def drop_session_under_the_get():
        """Our unthreaded consumer sent the Get and has not run since: its Grant is still unread."""
        reqs = unanswered_gets(cons, prod.address)
        assert len(reqs) == 1, reqs
        refuse_session(cons, prod.address, reqs[0])

    tickets = cons.load(refs)
    drop_session_under_the_get()
    check(LoadBarrier(cons).wait(tickets), specs, device)
    assert cons.metrics.counters["resent"] == 2
    for t in tickets:
        t.release()

    # Dropped again after the new connection's Get went out: sent again once already, so they fail.
    tickets = cons.load(refs)
    assert not any(t.resent for t in tickets), "each load may be sent again once"
    drop_session_under_the_get()
    assert cons.wait_for(lambda: connection_state(cons, prod.address) == "ready"
                         and bool(unanswered_gets(cons, prod.address)), 10)
    drop_session_under_the_get()
    assert all(t.reason == "PEER_LOST" and prod.address in t.error for t in tickets), tickets
    assert cons.metrics.counters["resent"] == 4
    assert cons.wait_for(lambda: cons.pool.stats().used == 0, 5), cons.pool.stats()
    later = [("later", (8, 8), "float32", 5)]
    fetch(cons, refs_for(prod, prod.call("publish", later)), later, device)  # and the producer still serves us


def test_a_hold_the_producer_dropped_unanswered_is_asked_once_more_on_a_new_connection(procs, make_consumer,
                                                                                       device):
    """The same for a Hold (a vLLM scheduler's question; failing it encodes the request locally):
    the producer says it no longer knows our session while the Hold waits there for an item not
    published yet (**injected** Refused, as above); it is asked again on a new connection and
    answered once the item is published; dropped again, it fails UNREACHABLE naming the producer."""
    from ec_nixl.states import LinkState
    from helpers import fetch, refs_for, refuse_session

    prod = procs(device=device)
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    warm = [("warm", (8, 8), "float32", 1)]
    fetch(cons, refs_for(prod, prod.call("publish", warm)), warm, device)  # a ready link

    def drop_session_under(h):
        assert h.req in cons.links.find(prod.address).queries and not h.done, h.states
        refuse_session(cons, prod.address, h.req)

    def parked(h):
        """The new link is ready and the Hold went out on it; it waits there (item not published)."""
        link = cons.links.find(prod.address)
        assert cons.wait_for(lambda: link.state is LinkState.READY, 10) and not h.done, h.states

    h = cons.hold_async(prod.address, ["h1"], timeout=10, wait_s=8)
    drop_session_under(h)
    parked(h)
    prod.call("publish", [("h1", (16, 16), "float32", 2)])
    assert cons.wait_for(lambda: h.done, 10)
    assert h.states["h1"].status == "ready" and h.incarnation, h.states
    assert cons.metrics.counters["resent"] == 1

    h = cons.hold_async(prod.address, ["h2"], timeout=10, wait_s=8)
    drop_session_under(h)
    parked(h)
    drop_session_under(h)  # asked again once already: now it fails
    assert h.states["h2"].status == "UNREACHABLE" and prod.address in h.states["h2"].detail, h.states


# --------------------------------------------------------------------------------------------
# the proxy: an encoder that is down costs latency, not errors


def test_proxy_sends_to_pd_without_params_when_the_encoder_is_down():
    """An encoder being restarted (refusing connections, or answering 5xx): the request goes to
    the PD without ec_transfer_params, marked X-EC-Fallback naming the encoder; a 4xx from the
    encoder (a bad request) is still the client's answer."""
    from aiohttp import web

    from test_proxy import Stub, dead_url, encoder_ok, pd_echo, start_proxy
    from test_proxy import IMAGE_CHAT

    def answering(status: int):
        async def handler(stub, request, body):
            return web.json_response({"error": f"what a {status} says"}, status=status)
        return handler

    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            pd = await Stub("pd", pd_echo).start(stack)
            ok = await Stub("e", encoder_ok).start(stack)
            failing = await Stub("fail", answering(500)).start(stack)
            rejecting = await Stub("reject", answering(400)).start(stack)
            gone = dead_url()
            for enc, status, fallback in [(gone, 200, gone), (failing.url, 200, failing.url),
                                          (ok.url, 200, None), (rejecting.url, 400, None)]:
                proxy = await start_proxy(stack, [enc], [pd.url], connect_timeout_s=0.5, encode_timeout_s=0.5)
                async with s.post(proxy + "/v1/chat/completions", json=IMAGE_CHAT) as r:
                    answer = await r.json()
                    assert r.status == status, (enc, r.status, answer)
                    header = r.headers.get("X-EC-Fallback")
                if fallback is None:
                    assert header is None, header
                else:
                    assert header and fallback in header, header
                    assert answer["served_by"] == "pd" and "ec_transfer_params" not in answer["received"]
                    assert answer["received"]["messages"] == IMAGE_CHAT["messages"], "media forwarded unchanged"

    asyncio.run(main())
