"""A full producer pool: a publish waits for space that is on its way back, fails at once when
nothing is, and its error says what held the space.

Real processes and real NIXL READs (the producer in its own process, the consumer here). The
lag between "the consumer has read the item" and "the producer freed it" is held open on
purpose (fault injection: ``helpers.hold_read_done`` keeps the consumer's read-done messages
back until the test delivers them), so a publish is known to be waiting before the space comes
back: no sleep decides the order.
"""

from __future__ import annotations

import time

import pytest

from ec_nixl.barrier import LoadBarrier
from ec_nixl.config import EndpointConfig
from ec_nixl.endpoint import Endpoint
from ec_nixl.tickets import ItemRef
from helpers import check, fetch, hold_read_done, wait_until

ONE_MIB = ((512, 1024), "float16")  # 1 MiB: 16 blocks of 64 KiB
# The probe area (1 MiB) plus room for one 1 MiB item and a half: a second item fits only once
# the first is freed.
POOL = (1 << 20) + (3 << 19)


def _read(prod, cons, spec, device: str) -> None:
    """Hold, READ and hand over ``spec``, then release it (the read-done goes wherever the
    consumer's ``links.send`` sends it)."""
    (desc,) = prod.call("publish", [spec])
    st = cons.hold(prod.address, [desc.mm_hash], timeout=10)[desc.mm_hash]
    assert st.status == "ready", st
    ref = ItemRef(desc=desc, producer=prod.address, block=st.block, valid_until=time.time() + st.lease_s - 1)
    tickets = cons.load([ref])
    check(LoadBarrier(cons).wait(tickets, timeout=10), [spec], device)
    for t in tickets:
        t.release()


def _counters(obs, prod) -> dict:
    return obs.query_stats(prod.address, timeout=5)["counters"]


def test_publish_waits_for_space_a_consumer_is_about_to_free(make_producer, make_consumer, device):
    """The pool holds one item a consumer has read but not yet reported: the next publish waits
    (before ``reserve_wait_s`` it failed at once) and succeeds once the read-done arrives."""
    prod = make_producer(pool_bytes=POOL, reserve_wait_s=60.0)
    cons = make_consumer(mode="read")
    deliver = hold_read_done(cons)
    _read(prod, cons, ("first", *ONE_MIB, 1), device)
    second = ("second", *ONE_MIB, 2)
    prod.send("publish", [second])  # blocks in the producer: no room until "first" is freed
    with Endpoint(EndpointConfig(name="obs-pressure", pool_bytes=0, threaded=False, observer=True)) as obs:
        # The producer's I/O thread answers while its caller waits: it says it is waiting. (The
        # old behaviour answered the publish at once, with PoolExhausted.)
        waiting = wait_until(lambda: prod.answered() or _counters(obs, prod)["reserve_waits"] == 1, 30)
        assert waiting and not prod.answered(), f"the publish did not wait: {prod.result('publish')}"
        assert deliver() == 1  # the read-done goes out now: "first" is freed, "second" fits
        (desc,) = prod.result("publish", timeout=30)
        assert _counters(obs, prod)["reserve_failures"] == 0
    assert prod.call("published") == ["second"]
    fetch(cons, [ItemRef(desc=desc, producer=prod.address)], [second], device)


def test_publish_fails_at_once_when_nothing_is_on_its_way_back(make_producer, device):
    """Items nobody claimed come back only by lease or eviction: with eviction off the publish
    fails at once (no wait), and the error says the space is held by unclaimed items."""
    prod = make_producer(pool_bytes=POOL, reserve_wait_s=60.0, evict_unclaimed=False)
    prod.call("publish", [("idle", *ONE_MIB, 1)])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        prod.call("publish", [("next", *ONE_MIB, 2)])
    assert time.monotonic() - t0 < 30, "waited for space nothing would give back"
    msg = str(e.value)
    assert "PoolExhausted" in msg and "nothing was on its way back" in msg, msg
    assert "1 published item(s): 1 unclaimed" in msg and "oldest idle (unclaimed)" in msg, msg
    assert prod.call("published") == ["idle"], "the failed publish must leave the other item alone"
    st = prod.call("stats")
    assert st["counters"]["reserve_failures"] == 1 and st["counters"]["reserve_waits"] == 0


def test_publish_waits_a_bounded_time_then_says_what_held_the_space(make_producer, make_consumer, device):
    """A consumer that claimed the item and does not report reading it: the publish waits
    ``reserve_wait_s``, then fails naming the item being read; nothing of the failed publish stays,
    and the same publish fits once the read-done arrives."""
    prod = make_producer(pool_bytes=POOL, reserve_wait_s=0.5, evict_unclaimed=False)
    cons = make_consumer(mode="read")
    deliver = hold_read_done(cons)
    _read(prod, cons, ("claimed", *ONE_MIB, 1), device)
    used = prod.call("stats")["pool"]["used"]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        prod.call("publish", [("next", *ONE_MIB, 2)])
    waited = time.monotonic() - t0
    msg = str(e.value)
    assert waited >= 0.5 and "waited 0.5" in msg, (waited, msg)
    assert "1 published item(s): 1 being read" in msg and "oldest claimed (being read)" in msg, msg
    st = prod.call("stats")
    assert st["pool"]["used"] == used and st["counters"]["reserve_waits"] == 1
    assert deliver() == 1
    assert wait_until(lambda: prod.call("stats")["pool"]["used"] == 0, 10)
    prod.call("publish", [("next", *ONE_MIB, 2)])
