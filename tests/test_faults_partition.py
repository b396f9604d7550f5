"""The network between producer and consumer fails: E and PD on different hosts.

Producer and consumer are real processes (``peers``) in two network namespaces on a bridge
(``netns.Hosts``: two "hosts" with their own stacks and addresses), moving real bytes with NIXL.
UCX is held to TCP (``UCX_TLS=tcp``): between namespaces of one kernel it would otherwise take
shared memory or CMA, which no real cross-host link offers. Faults are made with ``ip`` alone: a
silent cut (packets dropped on arrival, both ways), one direction dropped, the producer host's
link down (its process runs on), the producer process killed (its host answers with RST).

The bound under test is the default one: a load waiting on a producer that became unreachable
fails within ``link_timeout_s`` (2 s) plus a quarter of it (the ping interval) — its request is
then encoded locally — and so does a load that arrives afterwards; a refused connection fails at
once; a producer that is merely busy (its Python holding the GIL longer than ``link_timeout_s``)
is not declared gone. ``SLACK_S`` covers scheduling on a loaded 2-core machine. Timings are
printed as ``[timing] ...`` (``pytest -s``); docs/RELIABILITY.md quotes them.
"""

from __future__ import annotations

import time

import pytest

import netns
from ec_nixl.config import EndpointConfig
from helpers import drained, timing, wait_until
from peers import ConsumerProcess, ProducerProcess

pytestmark = pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason()))

LINK_TIMEOUT_S = EndpointConfig(name="defaults").link_timeout_s
BOUND_S = 1.25 * LINK_TIMEOUT_S
SLACK_S = 0.5
GOAL_S = 3.0  # what issue 24 asks of the defaults; BOUND_S + SLACK_S must stay within it
TCP_ONLY = {"UCX_TLS": "tcp"}
SHAPE = (512, 1024)  # 2 MiB of float32


@pytest.fixture
def hosts():
    with netns.Hosts(["e", "pd"], tag="part", root=False) as h:
        yield h


@pytest.fixture
def pair(hosts):
    """A producer on host e and a consumer on host pd, defaults for every timeout, shaken hands."""
    prod = ProducerProcess(netns=hosts.ns["e"], env=TCP_ONLY, listen=f"{hosts.addr('e')}:0", mode="read",
                           pool_bytes=64 << 20)
    cons = ConsumerProcess(netns=hosts.ns["pd"], env=TCP_ONLY, mode="read", pool_bytes=64 << 20)
    try:
        assert prod.address.startswith(hosts.addr("e")), prod.address
        load_ok(cons, prod, "warm", seed=1)
        yield hosts, prod, cons
    finally:
        cons.kill()
        prod.kill()


def items(prod, name: str, seed: int, late_s: float = 0.0):
    """Publish one item (written ``late_s`` later: a load waits for it meanwhile)."""
    if late_s:
        desc = prod.call("publish_late", (name, SHAPE, "float32", seed, late_s))
    else:
        desc = prod.call("publish", [(name, SHAPE, "float32", seed)])[0]
    return [(desc, prod.address, 0, 1)]


def load_ok(cons, prod, name: str, seed: int) -> None:
    from peers import digest, make_item

    out = cons.call("load", (items(prod, name, seed), 10.0), timeout=30)
    assert [(h, s) for h, s, _, _ in out] == [(name, "landed")], out
    assert out[0][3] == digest(make_item(seed, SHAPE, "float32")), "bytes differ"


def load_fails_within(cons, args, bound_s: float, what: str, t0: float | None = None) -> str:
    """Start a load, wait for it to fail, check it failed within ``bound_s`` of ``t0`` (default:
    now); returns the failure reason."""
    t_send = time.monotonic()
    cons.send("load", (args, 30.0))
    start = t_send if t0 is None else t0
    out = cons.result("load", timeout=30)
    took = timing(what, time.monotonic() - start)
    (h, state, error, _), = out
    assert state != "landed", f"{what}: the load landed over a link that was cut: {out}"
    assert took <= bound_s, f"{what}: failed after {took:.2f}s, bound {bound_s:.2f}s ({state}: {error})"
    return error


def heal_and_load(hosts, prod, cons, name: str, seed: int) -> float:
    """After the network is back, loads land again without restarting anything (the back-off of
    the failed link is at most a few seconds)."""
    hosts.heal()
    t0 = time.monotonic()

    def lands() -> bool:
        try:
            load_ok(cons, prod, name, seed)
            return True
        except AssertionError:
            return False

    assert wait_until(lands, 15.0, 0.2), f"{name}: no load landed 15 s after the network came back"
    return timing(f"{name}: healed until a load landed again", time.monotonic() - t0)


def waiting_load_fails_after(prod, cons, fault, what: str, name: str, seed: int,
                             bound_s: float = BOUND_S + SLACK_S) -> list:
    """A load waits for an item not written yet when ``fault()`` strikes: it fails within
    ``bound_s`` of the fault (timed as ``what``). Returns the load's refs (for another try)."""
    args = items(prod, name, seed, late_s=3600.0)
    cons.send("load", (args, 30.0))
    time.sleep(0.3)
    t_fault = time.monotonic()
    fault()
    out = cons.result("load", timeout=30)
    took = timing(what, time.monotonic() - t_fault)
    assert out[0][1] != "landed" and took <= bound_s, (took, out)
    return args


def assert_pool_drains(prod) -> None:
    """Nothing stays pinned in the producer for the consumer that lost it (items unpublished)."""
    prod.call("unpublish_all")
    last = drained(prod, 20.0)
    assert last["items"] == 0 and last["pool"]["used"] == 0, f"producer pool not drained: {last}"


def test_defaults_meet_the_goal():
    assert BOUND_S + SLACK_S <= GOAL_S, "the default link_timeout_s no longer meets the 3 s goal"


def test_cut_while_waiting_then_new_request_then_heal(pair):
    """A load waits for an item (not written yet) when the hosts are cut apart: it fails within
    the bound; a load sent during the cut fails within it too, the next ones at once (back-off);
    after healing, loads land again."""
    hosts, prod, cons = pair
    waiting_load_fails_after(prod, cons, lambda: hosts.cut("e", "pd"),
                             "cut while waiting: load failed after the cut", "waiting", 2)
    during = items(prod, "during", 3)
    err = load_fails_within(cons, during, LINK_TIMEOUT_S + SLACK_S, "cut: a new load (fresh connect) failed")
    assert "unreachable" in err.lower() or "no connection" in err.lower(), err
    load_fails_within(cons, during, 0.3, "cut: the next load failed at once (back-off)")
    heal_and_load(hosts, prod, cons, "after-cut", 4)
    assert_pool_drains(prod)


def test_one_direction_dropped(pair):
    """Packets from E to PD are dropped, PD's reach E: E's answers never arrive, and the load
    fails within the same bound."""
    hosts, prod, cons = pair
    waiting_load_fails_after(prod, cons, lambda: hosts.drop("e", "pd"),
                             "E->PD dropped: waiting load failed after the drop", "one-way", 5)
    heal_and_load(hosts, prod, cons, "after-one-way", 6)
    assert_pool_drains(prod)


def test_producer_host_vanishes_silently(pair):
    """E's host goes off the network (its link down, the process runs on): the waiting load fails
    within the bound; when the link comes back, loads land again."""
    hosts, prod, cons = pair
    try:
        waiting_load_fails_after(prod, cons, lambda: hosts.link("e", up=False),
                                 "E host link down: waiting load failed after it", "vanish", 7)
        assert prod.proc.is_alive()
    finally:
        hosts.link("e", up=True)
    heal_and_load(hosts, prod, cons, "after-vanish", 8)
    assert_pool_drains(prod)


def test_killed_producer_is_known_at_once(pair):
    """E's process dies while its host stays up: the kernel closes its connections, so a waiting
    load fails well under a second, and a new load (connection refused) fails at once too."""
    hosts, prod, cons = pair
    args = waiting_load_fails_after(prod, cons, prod.kill, "producer killed: waiting load failed after the kill",
                                    "killed", 9, bound_s=1.0)
    time.sleep(0.1)
    err = load_fails_within(cons, args, 1.0, "producer killed: a new load (refused) failed")
    assert "refused" in err.lower() or "unreachable" in err.lower() or "lost" in err.lower(), err


def test_busy_producer_is_not_declared_gone(pair):
    """E's Python holds the GIL longer than link_timeout_s (a busy encoder): its event loop cannot
    answer, but its ZMQ I/O thread answers the pings, so the link stays and the load that waited
    lands once E is free again (peer_timeout_s and load_timeout_s, 5 s, bound that wait)."""
    hosts, prod, cons = pair
    hog_s = LINK_TIMEOUT_S + 1.0
    args = items(prod, "busy", 10)
    prod.send("hog_gil", hog_s)
    time.sleep(0.2)  # the hog runs: E answers no Python-level message from here
    from peers import digest, make_item

    t0 = time.monotonic()
    out = cons.call("load", (args, 30.0), timeout=60)
    held = prod.result("hog_gil", timeout=60)
    timing(f"busy producer (GIL held {held:.2f}s): load took", time.monotonic() - t0)
    assert held > LINK_TIMEOUT_S, f"the hog held the GIL only {held:.2f}s: nothing was tested"
    assert [(h, s) for h, s, _, _ in out] == [("busy", "landed")], out
    assert out[0][3] == digest(make_item(10, SHAPE, "float32"))


def test_cut_while_a_transfer_is_in_flight(hosts):
    """The hosts are cut apart while a 256 MiB READ runs (UCX over TCP moves it in a few hundred
    ms here): the load fails within the bound, nothing is handed over, the slot it was reading
    into is quarantined (the READ's outcome is unknown), and after healing the same item loads
    byte-exact and the producer drains. On a loaded machine the READ can end between being seen
    in flight and the cut taking effect; then the attempt proves nothing and is made again (at
    most three times)."""
    from peers import digest, make_bytes_item

    big = (256 << 20,)
    prod = ProducerProcess(netns=hosts.ns["e"], env=TCP_ONLY, listen=f"{hosts.addr('e')}:0", mode="read",
                           pool_bytes=300 << 20)
    cons = ConsumerProcess(netns=hosts.ns["pd"], env=TCP_ONLY, mode="read", pool_bytes=900 << 20,
                           quarantine_s=1.0)
    try:
        load_ok(cons, prod, "warm", seed=1)
        for attempt in range(3):
            name = f"big{attempt}"
            (desc, want), = prod.call("publish_bytes", [(name, big, "uint8", 11 + attempt)])
            cons.call("load_async", ([(desc, prod.address, 0, 1)], 30.0))
            deadline = time.monotonic() + 10
            while cons.call("phases")[name] != ("pending", "read") and time.monotonic() < deadline:
                time.sleep(0.001)
            phase = cons.call("phases")[name]
            if phase != ("pending", "read"):
                pytest.fail(f"the READ was never seen in flight (now {phase}): the cut would test nothing")
            t_cut = time.monotonic()
            hosts.cut("e", "pd")
            state = wait_until(lambda: (p := cons.call("phases")[name])[0] != "pending" and p, 30.0, 0.01)
            took = time.monotonic() - t_cut
            if state and state[0] == "landed":
                print(f"attempt {attempt}: the READ ended before the cut took effect; again")
                hosts.heal()
                prod.call("unpublish_all")
                continue
            timing("cut during a 256 MiB READ: load failed after the cut", took)
            assert state and state[0] == "failed", f"the load ended {state}"
            assert took <= BOUND_S + SLACK_S, f"failed after {took:.2f}s"
            assert cons.call("stats")["counters"]["quarantined"] >= 1, "the READ's target slot was not quarantined"
            break
        else:
            pytest.fail("three 256 MiB READs all ended before the cut took effect: nothing was tested")
        heal_and_load(hosts, prod, cons, "after-inflight", 20)
        out = cons.call("load", ([(desc, prod.address, 0, 1)], 30.0), timeout=60)
        seed = 11 + attempt
        assert out[0][1] == "landed" and out[0][3] == want == digest(make_bytes_item(seed, big, "uint8")), out[0][:3]
        assert_pool_drains(prod)
    finally:
        cons.kill()
        prod.kill()


def test_producer_restarted_after_refusals_is_served_at_once(pair):
    """While E is down on a live host, every connection is refused; those failures cost nothing,
    so they do not grow the retry back-off (only silent ones do). Loads keep being refused for a
    few seconds and while a new producer starts on the same address; once it listens, a load
    lands within the fixed 0.5 s back-off (plus handshake). With a back-off doubled by every
    refusal the wait would be up to 4 s."""
    import threading

    hosts, prod, cons = pair
    address = prod.address
    port = int(address.rsplit(":", 1)[1])
    args = items(prod, "before", 13)
    prod.kill()
    t_end = time.monotonic() + 3.0
    while time.monotonic() < t_end:
        load_fails_within(cons, args, 1.0, "producer down: a refused load")
        time.sleep(0.1)
    box: dict = {}
    starting = threading.Thread(target=lambda: box.setdefault("p", ProducerProcess(
        netns=hosts.ns["e"], env=TCP_ONLY, listen=f"{hosts.addr('e')}:{port}", mode="read", pool_bytes=64 << 20)))
    starting.start()
    while starting.is_alive():  # refused until it listens (or served, if it already does)
        cons.call("load", (args, 5.0), timeout=30)
        time.sleep(0.1)
    again = box["p"]
    try:
        assert again.address == address, (again.address, address)
        t0 = time.monotonic()

        def lands() -> bool:
            try:
                load_ok(cons, again, "after-restart", 14)
                return True
            except AssertionError:
                return False

        assert wait_until(lands, 10.0, 0.05), "no load landed from the restarted producer"
        took = timing("producer restarted after refusals: first load landed after", time.monotonic() - t0)
        assert took <= 0.5 + 1.0, f"first load from the restarted producer after {took:.2f}s"
    finally:
        again.kill()
