"""Loading items: the consumer side of an endpoint.

``load()`` reserves a pool slot per item and fetches it the way the link prefers: a READ of the
producer's slot (pull; at once when a Hold already told where it is, else after a Get/Grant), or a
Push asking the producer to WRITE into our slot. A round's items from one producer travel as one
NIXL request. ``LoadTicket``s report the outcome; ``LoadBarrier`` waits on them.

An ``ItemRef`` that names the producer incarnation whose Hold it came from is loaded from that
incarnation only: a link to another one is replaced (it may lead to a process that is gone), and
if the address then answers as another incarnation the item fails ``RESTARTED`` (retryable), so
the caller can get it elsewhere; nothing is ever asked of a process that did not hold it. A Get
that was never answered when its producer dropped our session (it says so, or the connection
broke right after this endpoint was paused long enough to be dropped) is asked again, once, on a
new connection: the producer cannot have acted on it, and failing it would cost a local encode.

Every failure goes through ``fail`` (``load_failures``), which alone decides what happens to the
slot: released when no DMA can touch it, quarantined (or kept with its transfer until NIXL lets go
of it) when one may. So a slot is never reused while a transfer might still write it, and never
leaked.

``Loader`` is the dispatcher and the face the endpoint and ``Links`` see; the work is done by
the parts it composes, one per concern, all sharing its per-link ``LinkWork``:

* ``ReadLane`` (``read_lane``) — READs: post, poll or drive, land, settle (the hot path);
* ``WriteLane`` (``write_lane``) — pushes: Push batches, WRITE-done notifications, CancelAcks;
* ``Failures`` (``load_failures``) — the one failure path and the transfers NIXL keeps;
* ``Clock`` (``load_clock``) — every deadline and retry, on the loop's tick.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Optional

from ec_nixl import protocol as P
from ec_nixl.config import EndpointConfig, split_address
from ec_nixl.errors import ECNixlError, ItemTooLarge, PoolExhausted
from ec_nixl.link_work import LinkWork, by_reader
from ec_nixl.links import Link, Links
from ec_nixl.load_clock import Clock
from ec_nixl.load_failures import RETRYABLE, Failures
from ec_nixl.loop import OwnerLoop
from ec_nixl.metrics import Metrics
from ec_nixl.pool import Pool
from ec_nixl.read_lane import ReadLane
from ec_nixl.states import LinkState, Phase
from ec_nixl.tickets import ItemRef, LoadTicket, wait_left
from ec_nixl.transport import Transport
from ec_nixl.write_lane import WriteLane

logger = logging.getLogger("ec_nixl")


class Loader:
    """Tickets and their transfers. Public calls (any thread): ``load``, ``cancel``; everything else
    runs on the owner thread. Never hands over an item before its bytes landed."""

    def __init__(self, cfg: EndpointConfig, pool: Pool, transport: Transport, metrics: Metrics,
                 loop: OwnerLoop, links: Links):
        self.cfg, self.pool, self.transport, self.metrics, self.loop, self.links = \
            cfg, pool, transport, metrics, loop, links
        self._work: dict[Link, LinkWork] = {}  # per link, shared with the parts below
        self._resend: dict[Link, list[LoadTicket]] = {}  # a lost link's unanswered Gets, until it is dropped
        self.failures = Failures(cfg, pool, transport, metrics, loop, links, self._work)
        self.reads = ReadLane(pool, transport, metrics, loop, links, self.failures)
        self.writes = WriteLane(pool, metrics, loop, links, self.failures, self._work)
        self.clock = Clock(cfg, pool, links, self.failures, self.reads, self._work, self._dispatch)
        # The parts' own bound methods, not wrappers: no extra Python frame on the hot path
        # (the barrier's ``drive``) nor on the loop's every round.
        self.fail = self.failures.fail
        self.drive = self.reads.drive
        self.poll = self.reads.poll
        self.settle = self.reads.settle
        self.tick = self.clock.tick
        self.on_write_done = self.writes.on_write_done
        links.listener = self
        loop.every_round(self.poll)
        loop.every_tick(self.tick)
        loop.at_round_end(self.flush)
        loop.idle_hint(self.clock.idle_hint)

    # --- public (any thread) ---------------------------------------------------------

    def load(self, refs: Iterable[ItemRef], timeout: Optional[float] = None,
             wait_s: float = 0.0) -> list[LoadTicket]:
        """Start loading ``refs``; returns one ticket each at once (see ``LoadBarrier``).

        On the owner thread, items whose place a Hold gave travel the direct path: a whole step from
        one producer is posted before any ticket exists (``ReadLane.post_step``); otherwise such
        items get their slots and READ first (``ReadLane.post_held``). Everything else is
        dispatched by ``_start``; its Get or Push lets the producer wait ``wait_s`` for items
        not published yet (see ``Endpoint.load``).
        """
        now = time.monotonic()
        deadline = now + (timeout if timeout is not None else self.cfg.load_timeout_s)
        wait_until = min(deadline, now + wait_s) if wait_s > 0 else 0.0  # (NaN: no wait)
        refs = list(refs)
        if refs and self.loop.is_owner:
            tickets = self.reads.post_step(refs, deadline)  # a step of held items: posted first
            if tickets is not None:
                if self.reads.unsettled:
                    self.reads.settle()  # earlier requests' read-done and telemetry, while this DMA runs
                return tickets
        pool = self.pool
        tickets = [LoadTicket(r, deadline, pool) for r in refs]
        if wait_until:
            for t in tickets:
                t.wait_until = wait_until
        producers: set[str] = set()  # addresses checked in this call
        find = self.links.find
        for t in tickets:
            try:
                P.validate_item(t.ref.desc)
                if t.ref.producer not in producers:
                    if find(t.ref.producer) is None:  # a link's address was checked when it was made
                        split_address(t.ref.producer)
                    producers.add(t.ref.producer)
            except ECNixlError as e:
                self.fail(t, str(e), "BAD_REQUEST")
        good = [t for t in tickets if t.pending]
        if not good:
            return tickets
        if self.loop.is_owner:
            # The caller drives the endpoint: post now, not at the end of a round.
            reads = self.reads
            rest = reads.post_held(good)
            if reads.unsettled and len(rest) < len(good):
                reads.settle()  # earlier requests' read-done and telemetry, while this DMA runs
            if rest:
                if not self.loop.threaded:
                    # Unthreaded: take in what happened since we last ran (a producer that went
                    # away left a disconnect in its link's monitor) before these pick a link.
                    self.loop.progress(0.0)
                self._start(rest)
                self.flush()
        else:
            self.loop.call(lambda: self._start(good))
        return tickets

    def cancel(self, tickets: list[LoadTicket], why: str = "cancelled by the caller") -> None:
        """Fail every still-pending ticket now (slots of possibly running DMAs go to quarantine)."""
        pending = [t for t in tickets if t.pending]
        if not pending:
            return

        def cancel_now():
            for t in pending:
                self.fail(t, f"item {t.mm_hash} from {t.ref.producer}: {why} (was in phase '{t.phase}')",
                          "CANCELLED", retryable=t.phase is not Phase.READ)

        self.loop.call(cancel_now)
        self.loop.wait_for(lambda: all(t.done for t in pending), 2.0)

    # --- dispatch (owner thread) -----------------------------------------------------

    def _start(self, tickets: list[LoadTicket]) -> None:
        links: dict[str, Link] = {}  # one look-up and wake-up per producer, not per item
        for t in tickets:
            if not t.pending:
                continue
            link = links.get(t.ref.producer)
            if link is None:
                link = links[t.ref.producer] = self.links.get(t.ref.producer)
                self.links.wake(link)
            if link.state is LinkState.READY and self._other_incarnation(t, link) and not self._in_use(link):
                link = links[t.ref.producer] = self.links.replace(
                    link, f"item {t.mm_hash} was held by incarnation {t.ref.incarnation}, "
                          f"the link leads to {link.incarnation}")
                self.links.wake(link)
            if link.state is LinkState.FAILED:
                self.fail(t, link.error, link.reason or "UNREACHABLE")
            elif link.state is LinkState.CONNECTING:
                t.enter(Phase.CONNECTING)
                self._work_on(link).waiting.append(t)
            else:
                self._dispatch(link, t)

    def _work_on(self, link: Link) -> LinkWork:
        work = self._work.get(link)
        if work is None:
            work = self._work[link] = LinkWork()
        return work

    @staticmethod
    def _other_incarnation(t: LoadTicket, link: Link) -> bool:
        return bool(t.ref.incarnation) and t.ref.incarnation != link.incarnation

    def _in_use(self, link: Link) -> bool:
        return self.links.busy(link) or any(t.pending and t.ref.producer == link.address
                                            for batch in self.reads.in_flight.values() for t in batch)

    def _dispatch(self, link: Link, t: LoadTicket) -> None:
        """Reserve the slot and ask for the item the way this link prefers."""
        if self._other_incarnation(t, link):
            return self.fail(t, f"item {t.mm_hash}: producer {t.ref.producer} restarted since it held the item "
                                f"(held by incarnation {t.ref.incarnation}, {link.incarnation} answers now)",
                             "RESTARTED", retryable=True)
        if t.slot is None:
            try:
                t.slot = self.pool.allocate(t.ref.desc.nbytes, tag=t.mm_hash)
            except ItemTooLarge as e:
                return self.fail(t, str(e), "TOO_LARGE")
            except PoolExhausted as e:
                t.enter(Phase.POOL)
                t.error = str(e)
                self.clock.retry.append(t)
                return
        t.mode = link.mode
        work = self._work_on(link)
        if link.mode == "write":
            t.enter(Phase.PUSH)
            work.push_queue.append(t)
        elif t.ref.block >= 0 and time.time() < t.ref.valid_until:
            t.enter(Phase.READ_QUEUED)
            work.read_queue.append((t, t.ref.block))
        else:
            t.enter(Phase.GRANT)
            work.get_queue.append(t)

    def flush(self) -> None:
        """Post this round's READs and send its Get and Push batches: one per producer and reader."""
        for link, work in list(self._work.items()):
            if link.state is not LinkState.READY or not (work.get_queue or work.push_queue or work.read_queue):
                continue
            if work.read_queue:
                self.reads.post_queued(link, work)
            gets, work.get_queue = work.get_queue, []
            for (reader, readers), batch in by_reader(gets).items():
                req = self.links.next_req()
                work.by_req[req] = batch
                self.links.send(link, P.Get(session=link.session, req=req, mm_hashes=[t.mm_hash for t in batch],
                                            reader=reader, readers=readers, wait_s=wait_left(batch)))
            if work.push_queue:
                self.writes.send(link, work)

    # --- link events (owner thread) --------------------------------------------------

    def has_work(self, link: Link) -> bool:
        """Work that needs the producer's control plane (READs in flight do not: NIXL completes them)."""
        return bool(self._work.get(link))

    def on_ready(self, link: Link) -> None:
        work = self._work.get(link)
        if work is None:
            return
        waiting, work.waiting = work.waiting, []
        for t in waiting:
            if t.pending:
                self._dispatch(link, t)

    def on_down(self, link: Link, error: str, reason: str) -> None:
        """Fail everything that depends on ``link`` (DMA targets are kept out of use by ``fail``)."""
        for batch in list(self.reads.in_flight.values()):
            for t in batch:
                if t.pending and t.ref.producer == link.address:
                    self.fail(t, error, reason)
        work = self._work.get(link)
        if work is None:
            return
        again = self._unanswered(work) if link.resend else []
        if again:
            self._resend[link] = again
        spared = set(map(id, again))
        for t in work.tickets():
            if id(t) not in spared:
                self.fail(t, error, reason)
        work.waiting, work.get_queue, work.push_queue, work.read_queue = [], [], [], []
        work.by_req.clear()
        work.pushed.clear()
        for slot, _ in work.zombies:
            self.pool.quarantine(slot, self.cfg.quarantine_s, reason=reason)
        work.zombies = []

    def on_dropped(self, link: Link) -> None:
        self._work.pop(link, None)
        again = self._resend.pop(link, None)
        if again:
            # The address is free again: these connect afresh (a new session; a restarted
            # producer is told apart by its incarnation in ``_dispatch``).
            logger.info("ec-nixl: asking %s again for %d item(s) on a new connection", link.address, len(again))
            self.metrics.count("resent", len(again))
            self._start(again)

    @staticmethod
    def _unanswered(work: LinkWork) -> list[LoadTicket]:
        """The tickets of a lost link whose Get was not answered yet (queued, or sent with no
        Grant back) and that were not sent again before, marked as sent again: they hold a slot
        no DMA can touch, so they may go out once more instead of failing."""
        asked = work.get_queue + [t for batch in work.by_req.values() for t in batch]
        again = [t for t in asked if t.pending and not t.resent]
        for t in again:
            t.resent = True
        return again

    def on_reply(self, link: Link, msg) -> None:
        work = self._work_on(link)
        if isinstance(msg, P.Grant):
            return self._on_grant(link, work, msg)
        if isinstance(msg, P.Refused):
            for t in work.by_req.pop(msg.req, []):
                self.fail(t, f"{msg.reason}: {msg.detail}", msg.reason)
            return
        if isinstance(msg, P.PushFailed):
            return self.writes.on_failed(work, msg)
        if isinstance(msg, P.CancelAck):
            return self.writes.on_cancel_ack(work, msg)
        if isinstance(msg, P.StatsReply):
            return  # a late answer to a query that already timed out
        logger.warning("unexpected %s from producer %s", type(msg).__name__, link.address)

    def _on_grant(self, link: Link, work: LinkWork, msg: P.Grant) -> None:
        batch = work.by_req.pop(msg.req, None)
        if batch is None:
            return  # a late answer for tickets already failed
        by_hash = {t.mm_hash: t for t in batch}
        for s in msg.items:
            t = by_hash.pop(s.mm_hash, None)
            if t is None or not t.pending:
                continue
            if s.status == "ready":
                try:
                    P.validate_state_matches(s, t.ref.desc, link.peer.arena)
                except ECNixlError as e:
                    self.fail(t, str(e), "BAD_GRANT")
                    continue
                t.enter(Phase.READ_QUEUED)
                work.read_queue.append((t, s.block))
            elif s.status in RETRYABLE:
                self.metrics.count("retries")
                t.enter(Phase.GRANT)
                t.retry_at = time.monotonic() + 0.0005
                self.clock.retry.append(t)
            else:
                self.metrics.count("nacks")
                self.fail(t, f"{s.status}: {s.detail}", s.status)
        for t in by_hash.values():
            self.fail(t, "producer's grant left this item out", "BAD_GRANT")
