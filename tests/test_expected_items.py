"""A consumer that asks for items before they exist: Holds, Gets and Pushes that wait (``wait_s``).

This is what lets a proxy send a request to prefill/decode while the encoder still runs it: the
consumer's Hold is parked at the producer and answered the moment the item is published, so its
READ starts as soon as the bytes exist. A load may wait the same way (``Endpoint.load(wait_s=)``):
its Get is granted at the publish, and on a WRITE link its Push is parked and the WRITE into the
consumer's slot starts at the publish, with no round trip after it. Real producer processes, real
NIXL transfers; the tests order events by the producer's own counters, never by sleeps.
"""

from __future__ import annotations

import time

import pytest

from ec_nixl import protocol as P
from ec_nixl.barrier import LoadBarrier
from ec_nixl.errors import LoadFailed
from ec_nixl.loop import IDLE_POLL_S
from ec_nixl.tickets import ItemRef
from helpers import check, desc_of, fetch, landed, ticket_slot, wait_until
from peers import ProducerProcess

SPEC = ("late-item", (64, 256), "bfloat16", 11)


def _parked(prod) -> int:
    return prod.call("stats")["counters"].get("holds_parked", 0)


def _wait_parked(prod, n: int, timeout: float = 20.0, what: str = "holds_parked") -> None:
    deadline = time.monotonic() + timeout
    while prod.call("stats")["counters"].get(what, 0) < n:
        assert time.monotonic() < deadline, f"the producer never parked {n} request(s) ({what})"
        time.sleep(0.01)


def test_a_waiting_hold_is_answered_when_the_item_is_published(make_peer, make_consumer, device):
    prod = make_peer(ProducerProcess)
    cons = make_consumer(threaded=True)
    hold = cons.hold_async(prod.address, [SPEC[0]], timeout=5.0, wait_s=8.0)
    _wait_parked(prod, 1)
    assert not hold.done, f"answered before the item existed: {hold.states}"
    t_pub = time.monotonic()
    (desc,) = prod.call("publish", [SPEC])
    assert cons.wait_for(lambda: hold.done, 10), "the waiting Hold was not answered after the publish"
    st = hold.states[SPEC[0]]
    assert st.status == "ready", st
    assert hold.t_answered - t_pub < 4.0, "answered at the end of its wait, not at the publish"
    # Where the library is built the publish answered it, off the GIL (native_answers).
    want = 1 if _native_built() else 0
    assert wait_until(lambda: _native_answers(prod) == want, 5.0), prod.call("stats")
    # What the answer says is where the bytes are: a READ of it gets exactly them.
    fetch(cons, [ItemRef(desc=desc, producer=prod.address, block=st.block, incarnation=hold.incarnation)],
          [SPEC], device)


def _native_built() -> bool:
    from ec_nixl.handoff import load_library

    return load_library()[0] is not None


def _native_answers(prod) -> int:
    return prod.call("stats")["counters"].get("native_answers", 0)


@pytest.mark.parametrize("flow", ["hold", "read", "write"])
def test_the_publish_answers_while_the_producer_holds_its_gil(make_peer, make_consumer, device, flow):
    """The hand-off off the GIL (issue 40): a producer that goes on in Python right after it
    publishes (a vLLM runner) holds its GIL for 2 s, its I/O thread kept busy meanwhile (a fault
    injection: a Python answer would have to wait for it), and still the waiting Hold is answered,
    the waiting Get answered and READ, the waiting Push written, during that time: the publish
    hands them to the native thread, which needs no Python to send the Grant or post the WRITE.
    Nor does the publish wake the producer's I/O thread (it would take the GIL from the runner):
    the hand-off tells the server afterwards."""
    if not _native_built():
        pytest.skip("the native hand-off library is not built here (setup.py needs a C++ compiler)")
    prod = make_peer(ProducerProcess)
    cons = make_consumer(threaded=True, mode="write" if flow == "write" else "read")
    if flow == "hold":
        hold = cons.hold_async(prod.address, [SPEC[0]], timeout=10.0, wait_s=8.0)
        _wait_parked(prod, 1)
        prod.call("stall", 3.0)
        prod.send("publish_and_hog", (SPEC, 2.0))
        assert cons.wait_for(lambda: hold.done, 10), "the waiting Hold was never answered"
        t_done = hold.t_answered
        assert hold.states[SPEC[0]].status == "ready", hold.states
    else:
        tickets = cons.load([ItemRef(desc=_expected(SPEC), producer=prod.address)], timeout=20.0, wait_s=8.0)
        _wait_parked(prod, 1, what="pushes_parked" if flow == "write" else "holds_parked")
        prod.call("stall", 3.0)
        prod.send("publish_and_hog", (SPEC, 2.0))
        out = LoadBarrier(cons).wait(tickets, timeout=15.0)
        t_done = time.monotonic()
        check(out, [SPEC], device)
        tickets[0].release()
    t_hog, held = prod.result("publish_and_hog", timeout=30)
    assert held >= 1.9, f"the producer held its GIL only {held:.2f}s"
    assert t_done < t_hog + held, (f"{flow}: answered {t_done - t_hog:.3f}s after the publish, when the "
                                   f"producer's Python let go ({held:.2f}s): the answer waited for its GIL or its I/O thread")
    counter = "native_pushes" if flow == "write" else "native_answers"
    assert wait_until(lambda: prod.call("stats")["counters"].get(counter, 0) == 1, 5.0), prod.call("stats")
    assert wait_until(lambda: prod.call("stats").get("native_noted", 0) == 0, 5.0), prod.call("stats")
    assert prod.call("stats")["counters"].get("publish_wakes", 0) == 0, prod.call("stats")


@pytest.mark.parametrize("flow", ["hold", "write"])
def test_an_item_published_while_its_request_parks_is_served_at_once(make_peer, make_consumer, device, flow):
    """A race (fault injection): the item is published after the server found it missing and
    before the hand-off knew the request, so that publish could not answer it natively (nor wake
    the loop: nothing parked was the server's yet). The server must see that and serve it within
    a tick, not when the loop next wakes for something else (IDLE_POLL_S) or its wait runs out."""
    if not _native_built():
        pytest.skip("the native hand-off library is not built here (setup.py needs a C++ compiler)")
    prod = make_peer(ProducerProcess)
    cons = make_consumer(threaded=True, mode="write" if flow == "write" else "read")
    cons.query_stats(prod.address)  # (the link is up first: the time measured is the request's)
    prod.call("publish_while_parking", (SPEC, "note" if flow == "hold" else "arm"))  # (in place before the request)
    if flow == "hold":
        hold = cons.hold_async(prod.address, [SPEC[0]], timeout=10.0, wait_s=8.0)
        assert cons.wait_for(lambda: hold.done, 10) and hold.states[SPEC[0]].status == "ready", hold.states
        t_done = hold.t_answered
    else:
        tickets = cons.load([ItemRef(desc=_expected(SPEC), producer=prod.address)], timeout=20.0, wait_s=8.0)
        check(LoadBarrier(cons).wait(tickets, timeout=15.0), [SPEC], device)
        t_done = time.monotonic()
        tickets[0].release()
    t_pub = prod.call("parking_published_at", 30.0)
    assert t_pub is not None, "the fault injection never ran: no request reached the hand-off"
    parked = "pushes_parked" if flow == "write" else "holds_parked"
    assert prod.call("stats")["counters"].get(parked, 0) == 1, prod.call("stats")  # (it did park)
    assert t_done - t_pub < IDLE_POLL_S / 2, (f"served {t_done - t_pub:.3f}s after its item was published: "
                                              "when the loop woke for something else")


def test_a_consumer_not_on_the_answer_socket_is_answered_from_python(make_peer, make_consumer, device,
                                                                     monkeypatch):
    """The publish's native answer finds no route to a consumer that did not connect to the
    producer's answer socket (an older client, a firewall on that port): the send fails, the
    request goes back to the server, which answers it on the link as before; nothing is left noted."""
    from ec_nixl.links import Link

    monkeypatch.setattr(Link, "listen_for_answers", lambda self, ctx, address, cfg: False)
    prod = make_peer(ProducerProcess)
    cons = make_consumer(threaded=True)
    hold = cons.hold_async(prod.address, [SPEC[0]], timeout=5.0, wait_s=8.0)
    _wait_parked(prod, 1)
    if _native_built():
        assert prod.call("stats")["native_noted"] == 1
    t_pub = time.monotonic()
    (desc,) = prod.call("publish", [SPEC])
    assert cons.wait_for(lambda: hold.done, 10), "the waiting Hold was not answered after the publish"
    assert hold.t_answered - t_pub < 4.0, "answered at the end of its wait, not at the publish"
    st = hold.states[SPEC[0]]
    assert st.status == "ready", st
    fetch(cons, [ItemRef(desc=desc, producer=prod.address, block=st.block, incarnation=hold.incarnation)],
          [SPEC], device)
    assert _native_answers(prod) == 0
    assert wait_until(lambda: prod.call("stats").get("native_noted", 0) == 0, 5.0), prod.call("stats")
    if _native_built():  # the publish tried, found no route, and said so
        assert prod.call("stats")["counters"].get("native_answers_unsent", 0) == 1, prod.call("stats")


def test_native_answers_off_opens_no_second_socket_and_answers_from_python(make_peer, make_consumer, device):
    """``native_answers=False``: the producer offers no answer socket (``Welcome.answers`` empty),
    notes nothing, and its I/O thread answers the waiting Hold at the publish as before."""
    prod = make_peer(ProducerProcess, native_answers=False)
    cons = make_consumer(threaded=True)
    hold = cons.hold_async(prod.address, [SPEC[0]], timeout=5.0, wait_s=8.0)
    _wait_parked(prod, 1)
    assert "native_noted" not in prod.call("stats")
    assert all(link.answers is None for link in cons.links.all()), "a socket was offered anyway"
    t_pub = time.monotonic()
    prod.call("publish", [SPEC])
    assert cons.wait_for(lambda: hold.done, 10)
    assert hold.t_answered - t_pub < 4.0 and hold.states[SPEC[0]].status == "ready", hold.states
    assert _native_answers(prod) == 0


def test_a_waiting_hold_for_an_item_never_published_answers_missing_after_its_wait(make_peer, make_consumer,
                                                                                    device):
    prod = make_peer(ProducerProcess)
    cons = make_consumer(threaded=True)
    t0 = time.monotonic()
    states = cons.hold(prod.address, ["never"], timeout=5.0, wait_s=0.6)
    took = time.monotonic() - t0
    assert states["never"].status == P.Nack.MISSING.value, states
    assert took >= 0.55, f"answered after {took:.2f}s: the wait was not kept"
    assert took < 5.0, f"answered after {took:.2f}s: the wait was not bounded"
    assert _parked(prod) == 1
    assert prod.call("stats").get("native_noted", 0) == 0  # its note went with its Python answer


def test_a_hold_without_wait_is_answered_at_once(make_peer, make_consumer, device):
    prod = make_peer(ProducerProcess)
    cons = make_consumer(threaded=True)
    t0 = time.monotonic()
    states = cons.hold(prod.address, ["never"], timeout=5.0)
    assert states["never"].status == P.Nack.MISSING.value, states
    assert time.monotonic() - t0 < 4.0
    assert _parked(prod) == 0


def test_one_ready_item_does_not_answer_a_hold_that_waits_for_two(make_peer, make_consumer, device):
    """A request's items are answered together: the Hold waits for the last of them."""
    prod = make_peer(ProducerProcess)
    cons = make_consumer(threaded=True)
    other = ("early-item", (8, 256), "bfloat16", 12)
    prod.call("publish", [other])
    hold = cons.hold_async(prod.address, [other[0], SPEC[0]], timeout=5.0, wait_s=8.0)
    _wait_parked(prod, 1)
    assert not hold.done, hold.states
    prod.call("publish", [SPEC])
    assert cons.wait_for(lambda: hold.done, 10)
    assert {h: s.status for h, s in hold.states.items()} == {other[0]: "ready", SPEC[0]: "ready"}


def test_a_consumer_that_leaves_while_its_hold_waits_costs_the_producer_nothing(make_peer, make_consumer, device):
    """Its parked Hold goes with its session; the item published afterwards is unclaimed (it may
    be evicted or expire like any other), and the producer answers others as before."""
    prod = make_peer(ProducerProcess)
    gone = make_consumer(threaded=True, name="leaving-consumer")
    gone.hold_async(prod.address, [SPEC[0]], timeout=5.0, wait_s=8.0)
    _wait_parked(prod, 1)
    gone.close()
    deadline = time.monotonic() + 20
    while prod.call("stats").get("sessions", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prod.call("stats").get("native_noted", 0) == 0  # its note went with its session
    prod.call("publish", [SPEC])
    assert _native_answers(prod) == 0
    cons = make_consumer(threaded=True)
    states = cons.hold(prod.address, [SPEC[0]], timeout=5.0)
    assert states[SPEC[0]].status == "ready", states


def _expected(spec) -> ItemRef:
    return desc_of(spec[0], spec[1], spec[2])


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_load_that_waits_lands_when_the_item_is_published(make_peer, make_consumer, device, mode):
    """A load of an item not published yet (``wait_s``): its Get (READ link) or its Push (WRITE
    link: the producer WRITEs at the publish) waits at the producer; the item lands after the
    publish, long before the wait runs out, with the producer's bytes."""
    prod = make_peer(ProducerProcess)
    cons = make_consumer(threaded=True, mode=mode)
    tickets = cons.load([ItemRef(desc=_expected(SPEC), producer=prod.address)], timeout=20.0, wait_s=8.0)
    _wait_parked(prod, 1, what="pushes_parked" if mode == "write" else "holds_parked")
    assert not tickets[0].done, tickets
    t_pub = time.monotonic()
    prod.call("publish", [SPEC])
    out = LoadBarrier(cons).wait(tickets, timeout=15.0)
    assert time.monotonic() - t_pub < 4.0, "landed at the end of its wait, not at the publish"
    check(out, [SPEC], device)
    tickets[0].release()
    if mode == "write":  # the publish itself started the WRITE, off the GIL, where the library is built
        native = prod.call("stats")["counters"].get("native_pushes", 0)
        assert native == (1 if _native_built() else 0), native


def test_a_consumer_that_leaves_while_its_push_waits_is_never_written_to(make_peer, make_consumer, device):
    """Its parked Push (armed for the native hand-off where the library is built) goes with its
    session: the publish afterwards starts no WRITE, and the item is not kept as pushed."""
    prod = make_peer(ProducerProcess)
    gone = make_consumer(threaded=True, mode="write", name="leaving-consumer")
    gone.load([ItemRef(desc=_expected(SPEC), producer=prod.address)], timeout=20.0, wait_s=8.0)
    _wait_parked(prod, 1, what="pushes_parked")
    st = prod.call("stats")
    if _native_built():
        assert st["native_handoff"] == "on" and st["native_armed"] == 1, st
    gone.close()
    assert wait_until(lambda: prod.call("stats").get("sessions", 0) == 0, 20.0), "the session was never reclaimed"
    assert prod.call("stats").get("native_armed", 0) == 0
    prod.call("publish", [SPEC])
    time.sleep(0.2)
    st = prod.call("stats")
    assert st["counters"].get("native_pushes", 0) == 0, st
    assert st["holding"][SPEC[0]]["pushes"] == 0, st
    cons = make_consumer(threaded=True, mode="write")  # others are served as before
    check(LoadBarrier(cons).wait(cons.load([ItemRef(desc=_expected(SPEC), producer=prod.address)], timeout=20.0),
                                 timeout=15.0), [SPEC], device)


def test_a_waiting_push_for_an_item_never_published_fails_missing_after_its_wait(make_peer, make_consumer,
                                                                                  device):
    """The wait is kept, and bounded: MISSING then (as without a wait), and the slot goes back
    (the producer said no WRITE will touch it)."""
    prod = make_peer(ProducerProcess)
    cons = make_consumer(threaded=True, mode="write")
    t0 = time.monotonic()
    tickets = cons.load([ItemRef(desc=_expected(SPEC), producer=prod.address)], timeout=20.0, wait_s=0.6)
    with pytest.raises(LoadFailed, match="MISSING"):
        LoadBarrier(cons).wait(tickets, timeout=15.0)
    took = time.monotonic() - t0
    assert 0.55 <= took < 5.0, f"failed after {took:.2f}s: its wait was not kept, or not bounded"
    assert tickets[0].reason == P.Nack.MISSING.value, tickets
    assert wait_until(lambda: cons.pool.stats().used == 0, 5.0), cons.pool.stats()


def test_a_cancelled_waiting_push_never_writes_the_slot_it_gave_back(make_peer, make_consumer, device):
    """A Cancel takes a parked push out: its CancelAck frees the slot, and the publish that
    follows writes nothing there (the arena keeps its poison), while a second parked push,
    published in the same call, still lands."""
    prod = make_peer(ProducerProcess)
    cons = make_consumer(threaded=True, mode="write")
    other = ("second-item", (64, 256), "bfloat16", 13)
    gone = cons.load([ItemRef(desc=_expected(SPEC), producer=prod.address)], timeout=20.0, wait_s=8.0)
    _wait_parked(prod, 1, what="pushes_parked")
    slot = ticket_slot(gone[0])
    at, n = slot.block * cons.pool.block_size, slot.nbytes
    cons.cancel(gone, "the request was aborted")
    assert gone[0].state.value == "failed", gone
    # The CancelAck says the producer will never write it: the slot is free again.
    assert wait_until(lambda: cons.pool.stats().used == 0, 5.0), cons.pool.stats()
    # Its blocks stay ours (untouched) while the second push, elsewhere, lands.
    blocker = cons.pool.allocate(n, tag="blocker")
    assert blocker.block == slot.block, (blocker, slot)
    kept = cons.load([ItemRef(desc=_expected(other), producer=prod.address)], timeout=20.0, wait_s=8.0)
    _wait_parked(prod, 2, what="pushes_parked")
    prod.call("publish", [SPEC, other])  # one publish: both parked pushes are looked at in one pass
    check(LoadBarrier(cons).wait(kept, timeout=15.0), [other], device)
    assert bool((cons.pool.arena.bytes[at : at + n] == 0xAB).all()), \
        "the cancelled push was written after its CancelAck"
    assert not landed(gone[0])
    cons.pool.release(blocker)


def test_expect_params_are_checked_like_any_other_input():
    """``ec_nixl_expect`` comes from the request body: anything malformed names the problem and
    is not used (the PD then encodes the media itself, or fails a request without media)."""
    from ec_nixl.params import EXPECT_KEY, announced_producer, build_expect, parse_expect

    assert parse_expect(build_expect("10.0.0.1:15600")) == ("10.0.0.1:15600", "")
    assert parse_expect({"h": {"ec_nixl": {}}}) == (None, "")  # not an overlapped request
    assert parse_expect(None) == (None, "")
    for bad in ({EXPECT_KEY: "x"}, {EXPECT_KEY: {"v": 2, "producer": "a:1"}}, {EXPECT_KEY: {"v": 1}},
                {EXPECT_KEY: {"v": 1, "producer": 5}}, {EXPECT_KEY: {"v": 1, "producer": "no-port"}},
                {EXPECT_KEY: {"v": 1, "producer": "h:99999"}}):
        producer, why = parse_expect(bad)
        assert producer is None and why.startswith(f"bad {EXPECT_KEY}"), (bad, why)
    assert announced_producer({"h": {"ec_nixl": {"producer": "e:1"}}}) == "e:1"
    assert announced_producer({"h": {"other": 1}}) is None and announced_producer([1]) is None
