"""A consumer that asks for items before they exist: Holds that wait (``protocol.Hold.wait_s``).

This is what lets a proxy send a request to prefill/decode while the encoder still runs it: the
consumer's Hold is parked at the producer and answered the moment the item is published, so its
READ starts as soon as the bytes exist. Real producer processes, real NIXL reads; the tests
order events by the producer's own counters, never by sleeps.
"""

from __future__ import annotations

import time

from ec_nixl import protocol as P
from helpers import fetch
from peers import ProducerProcess

SPEC = ("late-item", (64, 256), "bfloat16", 11)


def _parked(prod) -> int:
    return prod.call("stats")["counters"].get("holds_parked", 0)


def _wait_parked(prod, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _parked(prod) < n:
        assert time.monotonic() < deadline, f"the producer never parked {n} Hold(s)"
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
    # What the answer says is where the bytes are: a READ of it gets exactly them.
    from ec_nixl.tickets import ItemRef

    fetch(cons, [ItemRef(desc=desc, producer=prod.address, block=st.block, incarnation=hold.incarnation)],
          [SPEC], device)


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
    prod.call("publish", [SPEC])
    cons = make_consumer(threaded=True)
    states = cons.hold(prod.address, [SPEC[0]], timeout=5.0)
    assert states[SPEC[0]].status == "ready", states


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
