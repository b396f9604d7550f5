"""Helpers shared by the data-plane tests: load and check bytes, wait, inspect pools and tickets.

Items are made from seeds (``peers.make_item``) on both sides, so a check compares every byte
without shipping data through a pipe. Two rules keep the tests stable while the endpoint's
internals are being reorganised:

* ticket, slot and link states are read only through ``state()``/``phase()``/``slot_state()``/
  ``connection_state()`` here, as plain lower-case names (``"read_queued"``), whatever the
  core represents them with (plain strings before, ``str`` Enums now);
* the few things a test cannot see through the public API are read in the section "endpoint
  internals" at the bottom, and only there: the one place to re-point when the parts move.

This module is imported by the test process and by the peer processes (``peers``); it never
imports pytest.
"""

from __future__ import annotations

import enum
import time
from typing import Callable, Optional

import torch

from ec_nixl import protocol as P
from ec_nixl.barrier import LoadBarrier
from ec_nixl.errors import LoadFailed, PoolExhausted
from ec_nixl.tickets import ItemRef
from peers import digest, make_item

MODES = ["read", "write"]
SMALL = 16 << 20  # pools of the fault tests: small, so that filling one is cheap
# UCX over TCP only (no CMA, no shared memory): a READ cannot finish while its producer is frozen,
# where CMA would have copied the bytes while the READ was being posted.
TCP_ONLY = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
NO_VRAM_TCP = ("UCX over TCP moves DRAM only (NIXL refuses UCX_TLS=tcp where GPUs are present), and "
               "between VRAM pools cuda_ipc completes without the frozen peer: this fault has no VRAM twin")


# --------------------------------------------------------------------------------------------
# loading and checking


def refs_for(prod, descs, **kw) -> list[ItemRef]:
    """One ``ItemRef`` per description, all from producer ``prod`` (anything with ``.address``)."""
    return [ItemRef(desc=d, producer=prod.address, **kw) for d in descs]


def check(out: dict, specs: list, device: str = "cpu") -> None:
    """Every item of ``specs`` = [(mm_hash, shape, dtype, seed)] is in ``out`` with exactly its bytes."""
    for mm_hash, shape, dtype, seed in specs:
        got = out[mm_hash]
        want = make_item(seed, shape, dtype, device)
        assert got.shape == want.shape and got.dtype == want.dtype, mm_hash
        assert digest(got) == digest(want), f"{mm_hash}: bytes differ"


def fetch(cons, refs, specs, device: str = "cpu", timeout: Optional[float] = None) -> None:
    """Load, wait at the barrier, check every byte, give the slots back."""
    tickets = cons.load(refs, timeout=timeout)
    check(LoadBarrier(cons).wait(tickets), specs, device)
    for t in tickets:
        t.release()


def fetch_retrying(cons, refs, specs, timeout: float, pause: float = 0.05, device: str = "cpu") -> bool:
    """Load ``refs`` again and again, as a caller would, until one attempt lands (its bytes are
    checked, its slots given back: True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tickets = cons.load(refs)
        try:
            out = LoadBarrier(cons).wait(tickets)
        except LoadFailed:
            cons.wait_for(lambda: False, pause)
            continue
        check(out, specs, device)
        for t in tickets:
            t.release()
        return True
    return False


def desc_of(mm_hash: str, shape, dtype: str = "float32") -> P.ItemDesc:
    n = 1
    for d in shape:
        n *= d
    return P.ItemDesc(mm_hash=mm_hash, shape=list(shape), dtype=dtype, nbytes=n * P.DTYPE_SIZES[dtype])


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' bytes share any address (e.g. two pool views)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


# --------------------------------------------------------------------------------------------
# states by name: tickets and pool slots


def _name(value) -> str:
    if isinstance(value, enum.Enum):
        value = value.value if isinstance(value.value, str) else value.name
    return str(value).lower().replace("-", "_")


def state(t) -> str:
    """A ticket's state as a plain name: 'pending', 'landed' or 'failed'."""
    return _name(t.state)


def phase(t) -> str:
    """A ticket's phase as a plain name ('connecting', 'grant', 'read_queued', 'read', 'push', 'done', ...)."""
    return _name(t.phase)


def landed(t) -> bool:
    return state(t) == "landed"


def slot_state(slot) -> str:
    """A pool slot's state as a plain name: 'live', 'deferred', 'quarantined' or 'free'."""
    return _name(slot.state)


# --------------------------------------------------------------------------------------------
# waiting and timing


def timing(what: str, seconds: float) -> float:
    """Print ``[timing] what: N s`` (``pytest -s`` shows it; docs/RELIABILITY.md quotes them)."""
    print(f"[timing] {what}: {seconds:.3f} s")
    return seconds


def wait_until(pred: Callable, timeout: float, interval: float = 0.02):
    """Poll ``pred`` until it is truthy (returned) or ``timeout`` passes (the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


def drained(prod, timeout: float = 10.0) -> dict:
    """Wait until producer process ``prod`` holds nothing (no item, empty pool); its last stats."""
    last = {}

    def empty():
        nonlocal last
        last = prod.call("stats")
        return last["items"] == 0 and last["pool"]["used"] == 0

    wait_until(empty, timeout, 0.05)
    return last


# --------------------------------------------------------------------------------------------
# pools


def fill_pool(pool) -> list:
    """Allocate every free block one by one; returns the slots (the caller releases them)."""
    got = []
    while True:
        try:
            got.append(pool.allocate(pool.block_size, tag="filler"))
        except PoolExhausted:
            return got


def overlaps(a, b) -> bool:
    """Whether two pool slots share a block."""
    return a.block < b.block + b.nblocks and b.block < a.block + a.nblocks


# --------------------------------------------------------------------------------------------
# endpoint internals: the ONLY place tests read or touch private state. Re-point these when the
# endpoint's parts move; keep each to what one test needs to see and cannot see otherwise.


def connection_state(ep, address: str) -> Optional[str]:
    """The consumer's link to ``address`` by name ('connecting', 'ready', 'failed', ...), or None."""
    link = ep.links.find(address)
    return None if link is None else _name(link.state)


def awaiting_push(ep, address: str) -> bool:
    """Whether the consumer waits on ``address``'s control plane (e.g. for a push it asked for)."""
    link = ep.links.find(address)
    return link is not None and bool(ep.loader.has_work(link))


def ticket_slot(t):
    """The pool slot a ticket reserved (None once failed or released)."""
    return t.slot


def quarantined_until(pool, slot) -> float:
    """When ``slot``'s quarantine may end at the earliest (monotonic clock)."""
    return next(until for s, until, _, _ in pool._quarantine if s is slot)


def set_peer_timeout(ep, seconds: float) -> None:
    """Change a live endpoint's peer timeout (first handshakes may be slow on a loaded machine)."""
    ep.cfg.peer_timeout_s = seconds


def run_on_owner(ep, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the endpoint's owner (I/O) thread, as its own loop would."""
    ep.loop.call(fn)


def publish_before(ep, what: str, publish: Callable[[], None]) -> None:
    """FAULT INJECTION: the next time the producer's server hands a parked request to the native
    hand-off (``what``: "note" a Hold, "arm" a Push), ``publish()`` runs first: the item appears
    after the server saw it missing and before the hand-off knows the request (a publish racing
    the park from another thread). And the loop's tick is made to have just run, as it often has
    on a busy producer: the round's own tick does not look at the request then. Once only."""
    from ec_nixl.loop import TICK_S

    target = ep.items.answers if what == "note" else ep.items.native
    real = getattr(target, what)

    def first(*a, **k):
        setattr(target, what, real)
        publish()
        ep.loop._next_tick = time.monotonic() + TICK_S
        return real(*a, **k)

    setattr(target, what, first)


def drop_read_done(ep) -> None:
    """FAULT INJECTION: every read-done message this consumer sends is lost from now on."""
    send = ep.links.send
    ep.links.send = lambda link, msg: None if isinstance(msg, P.ReadDone) else send(link, msg)


def hold_read_done(ep) -> Callable[[], int]:
    """FAULT INJECTION: this consumer's read-done messages are kept back until the returned
    ``deliver()`` (owner thread) sends them and stops holding: a read-done that lags behind the
    read, as on a loaded host. ``deliver`` returns how many it sent."""
    send = ep.links.send
    held: list = []

    def hold(link, msg):
        if isinstance(msg, P.ReadDone):
            held.append((link, msg))
        else:
            send(link, msg)

    def deliver() -> int:
        ep.links.send = send
        for link, msg in held:
            send(link, msg)
        return len(held)

    ep.links.send = hold
    return deliver


def refuse_session(ep, address: str, req: int) -> None:
    """FAULT INJECTION: the producer at ``address`` answers request ``req`` of our ready link with
    ``Refused UNKNOWN_SESSION`` (as one that dropped our session would); the link is lost."""
    link = ep.links.find(address)
    assert connection_state(ep, address) == "ready", link
    ep.links._on_message(link, P.Refused(reason=P.Nack.UNKNOWN_SESSION.value, detail="injected", req=req))
    assert _name(link.state) == "lost" and ep.links.find(address) is not link


def unanswered_gets(ep, address: str) -> list[int]:
    """The request ids of the Gets our link to ``address`` sent and has no Grant for yet."""
    link = ep.links.find(address)
    work = None if link is None else ep.loader._work.get(link)
    return [] if work is None else list(work.by_req)


def producer_pushes(ep) -> list[tuple[str, str]]:
    """The pushes a producer is working on, as (mm_hash, 'queued' | 'posted')."""
    return [(h, _name(st)) for h, st in ep.server.pusher.active()]


def producer_items(ep) -> dict:
    """What keeps each published item alive (pins, pushes, interest, readers done, lease left)."""
    return ep.items.inspect()


def get_only(ep, producer: str, mm_hashes: list[str], timeout: float) -> dict:
    """Take READ grants (pins) on ``producer`` and never READ: a reader that dies after its Get.
    Returns {mm_hash: (status, block)}."""
    from ec_nixl.queries import HoldRequest

    class GetRequest(HoldRequest):
        __slots__ = ()
        kind = "get"

        def message(self, session: str):
            return P.Get(session=session, req=self.req, mm_hashes=self.mm_hashes)

    g = GetRequest(producer, list(mm_hashes), 1, ep.links.next_req(), time.monotonic() + timeout)
    ep.loop.call(lambda: ep.links.ask(g))
    ep.wait_for(lambda: g.done, timeout + 0.05)
    if not g.done:
        g.finish("TIMEOUT", "no grant")
    return {h: (s.status, s.block) for h, s in g.states.items()}


def report_arrived(sched, timeout: float) -> bool:
    """vLLM < 0.32: a worker's step report waits in the scheduler's report socket
    (``report_channel``: ipc delivers asynchronously; the scheduler takes it when it builds its next
    step). Polls up to ``timeout`` s; takes nothing."""
    import zmq

    inbox = sched.stand_ins._inbox
    return inbox is not None and bool(inbox._sock.poll(int(timeout * 1000), zmq.POLLIN))
