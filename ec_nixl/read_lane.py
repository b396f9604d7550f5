"""The READ lane: pulling items from a producer's slots into ours, and the hand-over.

This is the hot path of a load (post → complete → land): a READ posted as one NIXL request per
producer and round, its completion polled by the waiter itself (``drive``) or by the loop
(``poll``), its tickets landed at once, and everything else (telemetry, releasing the request,
telling the producer we are done) left for ``settle``, off the hand-over. It lives in one class
so that those steps stay plain method calls on one object, with no per-ticket indirection.
"""

from __future__ import annotations

import time
from typing import Optional

from ec_nixl import protocol as P
from ec_nixl.errors import ECNixlError, TransferFailed
from ec_nixl.link_work import LinkWork
from ec_nixl.links import Link, Links
from ec_nixl.load_failures import Failures, timeout_error
from ec_nixl.loop import OwnerLoop, has_spare_cpus
from ec_nixl.metrics import Metrics
from ec_nixl.protocol import MAX_ITEM_BYTES, validate_item
from ec_nixl.pool import Pool
from ec_nixl.states import LinkState, Phase, TicketState
from ec_nixl.tickets import ItemRef, LoadTicket
from ec_nixl.transport import Transport, Xfer

_PENDING, _READ = TicketState.PENDING, Phase.READ
ROUND_EVERY_S = 0.001
"""While a waiter polls its own READs, it still runs a full loop round this often (heartbeats,
grants and messages of other work must not starve)."""
SPIN_S = 0.02 if has_spare_cpus() else 0.0005
"""While a waiter's tickets wait for a message (a Grant, a WRITE's notification), it spins this
long, then blocks in the poller between rounds (``OwnerLoop.wait_round``). A WRITE's notification has
no file descriptor to wake the poller, and a round that blocked sees it 1-2 ms late; an item being
pushed lands within the 20 ms, and the runner waits in the barrier meanwhile anyway. On a host with
few cores (``loop.SPARE_CPUS``) 0.5 ms: a PD worker spinning for its Grant took the core its
producer needed to answer it."""


def _all_reading(tickets: list[LoadTicket]) -> bool:
    for t in tickets:
        if t.phase is not _READ:
            return False
    return True


class ReadLane:
    """READs in flight and landed, by NIXL request (owner thread)."""

    def __init__(self, pool: Pool, transport: Transport, metrics: Metrics, loop: OwnerLoop, links: Links,
                 failures: Failures):
        self.pool, self.transport, self.metrics, self.loop, self.links = pool, transport, metrics, loop, links
        self.fail = failures.fail
        self.in_flight: dict[Xfer, list[LoadTicket]] = {}  # READs in flight: request -> its tickets
        self.unsettled: list[tuple[Xfer, list[LoadTicket]]] = []  # landed requests to settle

    # --- posting ---------------------------------------------------------------------

    def post_held(self, tickets: list[LoadTicket]) -> list[LoadTicket]:
        """The direct path (owner thread): post at once the READs of items whose place a valid
        Hold gave, on a ready READ link to the incarnation that held them, as one request per
        producer. Returns the tickets that need the general path (``Loader._start``): no place, a
        link not ready or in another mode, another incarnation, no pool space now, or a link with
        a disconnect that must be taken in first."""
        rest: list[LoadTicket] = []
        groups: dict[str, tuple[Optional[Link], list[LoadTicket]]] = {}
        wall = time.time()
        find = self.links.find
        for t in tickets:
            ref = t.ref
            if ref.block < 0 or wall >= ref.valid_until:
                rest.append(t)
                continue
            group = groups.get(ref.producer)
            if group is None:
                link = find(ref.producer)
                if link is not None and (link.state is not LinkState.READY or link.mode != "read"
                                         or self.links.unread(link)):
                    link = None
                group = groups[ref.producer] = (link, [])
            link = group[0]
            if link is None or (ref.incarnation and ref.incarnation != link.incarnation):
                rest.append(t)
            else:
                group[1].append(t)
        for link, batch in groups.values():
            if not batch:
                continue
            # One pool lock for the step; an item that does not fit now takes the general path
            # (Loader._dispatch retries it, waits for space or fails it with the reason).
            slots = self.pool.try_allocate_many([t.ref.desc.nbytes for t in batch], [t.ref.desc.mm_hash for t in batch])
            ready = []
            for t, slot in zip(batch, slots):
                if slot is None:
                    rest.append(t)
                else:
                    t.slot, t.mode = slot, "read"
                    ready.append(t)
            if ready:
                self.post(link, ready, [(t.slot.block, t.ref.block, t.slot.nblocks) for t in ready])
                self.links.wake(link)  # bookkeeping (the silence clock), after the DMA started
        return rest

    def post_step(self, refs: list[ItemRef], deadline: float) -> Optional[list[LoadTicket]]:
        """The direct path of a whole step from ONE producer whose items a valid Hold placed, on
        a ready READ link to the incarnation that held them (a PD worker's usual step): check the
        places and sizes, cut one run of our pool, post the READ, and only then make the slots and
        tickets and check the rest of each description, while the DMA runs. Nothing per item but
        those checks stands before the post (on the H200, 32 items spent 139 of 233 us of Python
        before it on the per-item path). None, with nothing done, for any other step:
        ``Loader.load``'s general path takes it (and names what is wrong).

        The link's disconnect monitor is looked at after the post, while the DMA runs (one
        ``getsockopt``, ~2.5 us on the dev box, was the largest single cost before it): a
        disconnect found there means the producer may have dropped our session or restarted
        since its Hold, so the step's bytes are not trusted and its items fail ``PEER_LOST``
        (retryable) once the READ is final; a READ only reads, so posting it harmed nothing."""
        producer = refs[0].producer
        link = self.links.find(producer)
        if link is None or link.state is not LinkState.READY or link.mode != "read":
            return None
        wall, incarnation, bs = time.time(), link.incarnation, self.pool.block_size
        # Sizes, and the step as runs contiguous on both sides (ours is one run, at offset 0
        # until the pool gives its first block): one descriptor per run, no second pass.
        ns: list[int] = []
        runs: list[list[int]] = []
        here = 0
        there = -1  # the producer's block that would continue the last run
        for r in refs:
            nbytes = r.desc.nbytes
            if r.producer != producer or r.block < 0 or wall >= r.valid_until \
                    or (r.incarnation and r.incarnation != incarnation) \
                    or type(nbytes) is not int or not 0 < nbytes <= MAX_ITEM_BYTES:
                return None
            n = -(-nbytes // bs)
            ns.append(n)
            if r.block == there:
                runs[-1][2] += n
            else:
                runs.append([here, r.block, n])
            here += n
            there = r.block + n
        pool = self.pool
        at = pool.try_reserve_run(here)
        if at is None:
            return None
        for run in runs:
            run[0] += at
        t_post = time.perf_counter()
        error: Optional[TransferFailed] = None
        try:
            x = self.transport.post_many("READ", link.peer, runs)
        except TransferFailed as e:
            x, error = None, e
        except BaseException:
            for slot in pool.slots_in_run(at, ns, [r.desc.nbytes for r in refs], ["" for _ in refs]):
                pool.release(slot)
            raise
        # The DMA runs: now the per-item bookkeeping.
        lost = self.links.unread(link)
        slots = pool.slots_in_run(at, ns, [r.desc.nbytes for r in refs], [r.desc.mm_hash for r in refs])
        tickets = []
        for r, slot in zip(refs, slots):
            t = LoadTicket(r, deadline, pool)
            t.slot, t.mode = slot, "read"
            tickets.append(t)
        if lost:  # marked the way a bad description is (below): failed when the READ is final
            why = f"the link to {producer} saw a disconnect as its READ was posted (the producer may " \
                  f"have restarted or dropped the session since its Hold)" + (f": {error}" if error else "")
            for t in tickets:
                t.error, t.reason, t.retryable = f"item {t.mm_hash}: {why}", "PEER_LOST", True
        if error is not None:
            for t in tickets:
                if t.reason:
                    self.fail(t, t.error, t.reason, t.retryable)
                else:
                    self.fail(t, str(error), error.reason)
            return tickets
        self._track(x, tickets, t_post)
        if lost:
            return tickets
        # The rest of each description is checked while its bytes move (the READ needed only
        # the size, and lands in our own slot). A bad one is marked, and failed once its request
        # is final (``complete``): failing it now would cancel the request, and with it the
        # step's good items; its slot is the DMA's until then. Nothing of it is handed over.
        for t in tickets:
            try:
                validate_item(t.ref.desc)
            except ECNixlError as e:
                t.error, t.reason = str(e), "BAD_REQUEST"
        # (No ``Links.wake``: READs are no work for the link's silence clock, ``Links.busy``;
        # the clock starts with the first control-plane work, at its tick.)
        return tickets

    def post_queued(self, link: Link, work: LinkWork) -> None:
        """Post the round's queued READs of ``link`` (granted, or held but queued behind a handshake)."""
        batch = [(t, b) for t, b in work.read_queue if t.pending]
        work.read_queue = []
        if batch:
            self.post(link, [t for t, _ in batch], [(t.slot.block, b, t.slot.nblocks) for t, b in batch])

    def post(self, link: Link, tickets: list[LoadTicket], ranges: list[tuple[int, int, int]]) -> None:
        """Post the READs of ``tickets`` (``ranges[i]`` = (our block, the producer's block, blocks)
        of ``tickets[i]``) as ONE request; the bookkeeping follows the post, while the DMA runs.
        (Their tensor views are built by a waiter while the DMA runs, see ``drive``, or at landing.)"""
        # No notification rides the READ: NIXL would report DONE only once the producer's side
        # has taken it, which needs the producer's progress. A ReadDone message is sent after
        # DONE instead (settle), off the hand-over.
        t_post = time.perf_counter()
        try:
            x = self.transport.post_many("READ", link.peer, ranges)
        except TransferFailed as e:
            for t in tickets:
                self.fail(t, str(e), e.reason)
            return
        self._track(x, tickets, t_post)

    def _track(self, x: Xfer, tickets: list[LoadTicket], t_post: float) -> None:
        """``tickets``' READ ``x`` is posted: in flight until NIXL reports it final (``complete``
        lands them then, never before). Both posting paths end here."""
        for t in tickets:
            t.xfer, t.t_post = x, t_post
            t.enter(_READ)
        self.in_flight[x] = tickets

    # --- the waiter drives its own transfers -------------------------------------------

    def drive(self, tickets: list[LoadTicket], deadline: float, settle: bool = True) -> bool:
        """Wait for ``tickets`` as their owner: poll their READs in a tight loop and run a full
        round of the loop (messages, timers, other work) only when something else is needed or
        every ``ROUND_EVERY_S``. True when all are done, False at ``deadline`` (monotonic).

        This is the hot path of a consumer that drives its own endpoint (vLLM's PD worker): no
        thread hand-off, no socket poll between a READ's completion and its hand-over.
        ``settle=False`` leaves the after-completion work to the caller's next round.
        """
        # (``t.state is _PENDING``, not the ``pending`` property: a property call per ticket per
        # round costs ~5.5 us more for 32 tickets on the 2-core dev box, on the spin loop's path)
        pending = [t for t in tickets if t.state is _PENDING]
        start = time.monotonic()
        spin_until, next_round = start + SPIN_S, start + ROUND_EVERY_S
        while pending:
            now = time.monotonic()
            if now >= deadline:
                return False
            if now < next_round and _all_reading(pending):
                xfers = list({t.xfer: None for t in pending})
                views = [t for t in pending if not t.has_view and not t.reason]
                finished = self.transport.finished
                while True:  # NIXL status checks until one is final or a round is due
                    done = finished(xfers)
                    if done:
                        self.complete(done)
                        break
                    if views:  # the DMA is running: build a view meanwhile, not after it landed
                        views.pop().prepare_view()
                    elif self.unsettled:  # and settle earlier requests (read-done, telemetry)
                        self.settle()
                    elif time.monotonic() >= next_round:
                        break
            else:
                if now < spin_until:
                    self.loop.progress(0.0)
                else:
                    self.loop.wait_round(min(ROUND_EVERY_S, deadline - now))
                next_round = time.monotonic() + ROUND_EVERY_S
            pending = [t for t in pending if t.state is _PENDING]
        if settle:
            self.settle()
        return True

    # --- completions -----------------------------------------------------------------

    def poll(self) -> None:
        """Finish the READs NIXL reports done, then settle their requests (every round)."""
        if self.in_flight:
            for x in [x for x, batch in self.in_flight.items() if not any(t.pending for t in batch)]:
                del self.in_flight[x]  # every ticket failed: ``fail`` took care of the request and slots
            done = self.transport.finished(list(self.in_flight))
            if done:
                self.complete(done)
        if self.unsettled:
            self.settle()

    def complete(self, xfers: list[Xfer]) -> None:
        """Requests NIXL reports final: land their tickets (at once: nothing else stands between
        completion and hand-over) or fail them (ERR)."""
        now = time.monotonic()
        for x in xfers:
            tickets = self.in_flight.pop(x, ())
            if x.state != "DONE":
                for t in tickets:
                    if t.reason:  # a description (or the link) found bad after the post (``post_step``)
                        self.fail(t, t.error, t.reason, t.retryable)
                    else:
                        self.fail(t, f"READ from {t.ref.producer} failed (NIXL ERR)", "XFER_ERR")
                continue
            landed, t_done = [], time.perf_counter()
            for t in tickets:
                if t.state is not _PENDING:
                    continue
                t.xfer = None
                if t.reason:  # a description (or the link) found bad after the post: the DMA is over
                    self.fail(t, t.error, t.reason, t.retryable, settled=True)
                elif now > t.deadline:
                    # Seen done only after its deadline (this process was stopped or starved):
                    # the producer may have reclaimed the slot and reused it before the READ ran.
                    self.fail(t, f"{timeout_error(t)}: its READ was seen done only after the deadline, "
                                 f"its bytes are not trusted", "TIMEOUT", retryable=True, settled=True)
                else:
                    t.land(t_done)
                    landed.append(t)
            # Counted here, not in ``settle``: a step's stats may be read before it settles.
            self.metrics.count("loads_landed", len(landed))
            self.unsettled.append((x, landed))
        self.loop.changed()

    def settle(self) -> None:
        """After-completion work kept off the hand-over: telemetry, releasing the request, and
        telling each producer its readers are done (it frees the items then)."""
        settle, self.unsettled = self.unsettled, []
        for x, tickets in settle:
            self._record(x, tickets[0].t_post if tickets else time.perf_counter())
            if tickets:
                self._notify_read(tickets)

    def _record(self, x: Xfer, t_post: float) -> None:
        """Telemetry of one finished request (all its items), then release it."""
        tel = self.transport.telemetry(x)
        self.transport.release(x)
        if tel is not None:
            self.metrics.transfer(x.nbytes, tel[0] * 1e-6, tel[1] * 1e-6, tel[3])
        else:
            self.metrics.transfer(x.nbytes, 0.0, time.perf_counter() - t_post)

    def _notify_read(self, tickets: list[LoadTicket]) -> None:
        """Tell the producer these readers are done with the items (it frees each after all readers)."""
        link = self.links.find(tickets[0].ref.producer)
        if link is None or link.state is not LinkState.READY:
            return  # producer gone: its lease expiry frees the items
        by_reader: dict[int, list[str]] = {}
        for t in tickets:
            by_reader.setdefault(t.ref.reader, []).append(t.mm_hash)
        for reader, hashes in by_reader.items():
            self.links.send(link, P.ReadDone(session=link.session, mm_hashes=hashes, reader=reader))
