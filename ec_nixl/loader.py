"""Loading items: the consumer side of an endpoint.

``load()`` reserves a pool slot per item and fetches it the way the link prefers: a READ of the
producer's slot (pull; at once when a Hold already told where it is, else after a Get/Grant), or a
Push asking the producer to WRITE into our slot. A round's items from one producer travel as one
NIXL request. ``LoadTicket``s report the outcome; ``LoadBarrier`` waits on them.

An ``ItemRef`` that names the producer incarnation whose Hold it came from is loaded from that
incarnation only: a link to another one is replaced (it may lead to a process that is gone), and
if the address then answers as another incarnation the item fails ``RESTARTED`` (retryable), so
the caller can get it elsewhere; nothing is ever asked of a process that did not hold it.

Every failure goes through ``fail``, which alone decides what happens to the slot: released when
no DMA can touch it, quarantined (or kept with its transfer until NIXL lets go of it) when one
may. So a slot is never reused while a transfer might still write it, and never leaked.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Optional

from ec_nixl import protocol as P
from ec_nixl.config import EndpointConfig, split_address
from ec_nixl.errors import ECNixlError, ItemTooLarge, PoolExhausted, TransferFailed
from ec_nixl.links import Link, Links
from ec_nixl.loop import OwnerLoop
from ec_nixl.metrics import Metrics
from ec_nixl.pool import Pool, Slot
from ec_nixl.states import IN_DMA, LinkState, Phase, TicketState
from ec_nixl.tickets import ItemRef, LoadTicket
from ec_nixl.transport import Transport, Xfer

logger = logging.getLogger("ec_nixl")

_PENDING, _READ = TicketState.PENDING, Phase.READ
_RETRYABLE = frozenset({P.Nack.NOT_READY.value, P.Nack.BUSY.value})
ROUND_EVERY_S = 0.001
"""While a waiter polls its own READs, it still runs a full loop round this often (heartbeats,
grants and messages of other work must not starve)."""


class _Lane:
    """The loader's work on one link, by stage."""

    __slots__ = ("waiting", "get_queue", "push_queue", "read_queue", "by_req", "pushed", "zombies")

    def __init__(self):
        self.waiting: list[LoadTicket] = []  # until the handshake completes
        self.get_queue: list[LoadTicket] = []  # to send in the next Get
        self.push_queue: list[LoadTicket] = []  # to send in the next Push
        self.read_queue: list[tuple[LoadTicket, int]] = []  # (ticket, producer block) to READ this round
        self.by_req: dict[int, list[LoadTicket]] = {}  # Get req -> tickets awaiting the Grant
        self.pushed: dict[str, LoadTicket] = {}  # mm_hash -> ticket awaiting the WRITE notification
        self.zombies: list[tuple[Slot, float]] = []  # push targets awaiting a CancelAck

    def __bool__(self) -> bool:
        return bool(self.waiting or self.get_queue or self.push_queue or self.read_queue or self.by_req
                    or self.pushed or self.zombies)

    def tickets(self) -> list[LoadTicket]:
        """Every ticket on the lane, whatever its stage."""
        out = self.waiting + self.get_queue + self.push_queue + [t for t, _ in self.read_queue]
        for batch in self.by_req.values():
            out.extend(batch)
        return out + list(self.pushed.values())


def _all_reading(tickets: list[LoadTicket]) -> bool:
    for t in tickets:
        if t.phase is not _READ:
            return False
    return True


def _by_reader(tickets: list[LoadTicket]) -> dict[tuple[int, int], list[LoadTicket]]:
    out: dict[tuple[int, int], list[LoadTicket]] = {}
    for t in tickets:
        out.setdefault((t.ref.reader, t.ref.readers), []).append(t)
    return out


class Loader:
    """Tickets and their transfers. Public calls (any thread): ``load``, ``cancel``; everything else
    runs on the owner thread. Never hands over an item before its bytes landed."""

    def __init__(self, cfg: EndpointConfig, pool: Pool, transport: Transport, metrics: Metrics,
                 loop: OwnerLoop, links: Links):
        self.cfg, self.pool, self.transport, self.metrics, self.loop, self.links = \
            cfg, pool, transport, metrics, loop, links
        self._lanes: dict[Link, _Lane] = {}
        self._reads: dict[Xfer, list[LoadTicket]] = {}  # READs in flight: request -> its tickets
        self._retry: list[LoadTicket] = []  # waiting for pool space or a NOT_READY retry
        self._zombies: list[tuple[Xfer, Slot]] = []  # transfers NIXL could not cancel yet
        self._settle: list[tuple[Xfer, list[LoadTicket]]] = []  # landed requests to settle
        links.listener = self
        loop.every_round(self.poll)
        loop.every_tick(self.tick)
        loop.at_round_end(self.flush)
        loop.idle_hint(self._idle_hint)

    # --- public (any thread) ---------------------------------------------------------

    def load(self, refs: Iterable[ItemRef], timeout: Optional[float] = None) -> list[LoadTicket]:
        """Start loading ``refs``; returns one ticket each at once (see ``LoadBarrier``).

        On the owner thread, items whose place a Hold gave travel the direct path (``_post_held``):
        slot, READ posted, nothing else first. Everything else is dispatched by ``_start``.
        """
        deadline = time.monotonic() + (timeout if timeout is not None else self.cfg.load_timeout_s)
        pool = self.pool
        tickets = [LoadTicket(r, deadline, pool) for r in refs]
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
            rest = self._post_held(good)
            if self._settle and len(rest) < len(good):
                self.settle()  # earlier requests' read-done and telemetry, while this DMA runs
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

    # --- the one failure path --------------------------------------------------------

    def fail(self, t: LoadTicket, error: str, reason: str, retryable: bool = False, settled: bool = False) -> None:
        """Fail a pending ticket and decide its slot's fate.

        ``settled``: the caller knows no transfer can touch the slot any more (e.g. the producer
        reported its WRITE failed). Otherwise a ticket in a DMA phase keeps its slot out of use:
        a READ that NIXL cannot cancel yet stays with its request (``_zombies``); a cancelled one,
        or a push target of a producer we can no longer reach, goes to quarantine; a push target
        of a reachable producer waits for its CancelAck.
        """
        if not t.pending:
            return
        slot, t.slot = t.slot, None
        if slot is not None:
            if settled or t.phase not in IN_DMA:
                self.pool.release(slot)
            elif t.phase is Phase.READ:
                self.metrics.count("failed_transfers")
                x, t.xfer = t.xfer, None
                if x is not None and not self.transport.release(x):
                    self._zombies.append((x, slot))
                else:
                    self._quarantine(slot, reason)
            else:  # PUSH
                link = self.links.find(t.ref.producer)
                lane = self._lanes.get(link) if link is not None else None
                if lane is not None and link.state is LinkState.READY:
                    lane.pushed.pop(t.mm_hash, None)
                    lane.zombies.append((slot, time.monotonic() + self.cfg.quarantine_s))
                    self.metrics.count("quarantined")
                    self.links.send(link, P.Cancel(session=link.session, req=self.links.next_req(),
                                                   mm_hashes=[t.mm_hash]))
                else:
                    self._quarantine(slot, reason)
        t.fail(error, reason, retryable)
        self.metrics.count("loads_failed")
        self.metrics.fail(reason)
        self.loop.changed()

    def _quarantine(self, slot: Slot, reason: str) -> None:
        self.pool.quarantine(slot, self.cfg.quarantine_s, reason=reason)
        self.metrics.count("quarantined")

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
                self._lane(link).waiting.append(t)
            else:
                self._dispatch(link, t)

    def _lane(self, link: Link) -> _Lane:
        lane = self._lanes.get(link)
        if lane is None:
            lane = self._lanes[link] = _Lane()
        return lane

    @staticmethod
    def _other_incarnation(t: LoadTicket, link: Link) -> bool:
        return bool(t.ref.incarnation) and t.ref.incarnation != link.incarnation

    def _in_use(self, link: Link) -> bool:
        return self.links.busy(link) or any(t.pending and t.ref.producer == link.address
                                            for batch in self._reads.values() for t in batch)

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
                self._retry.append(t)
                return
        t.mode = link.mode
        lane = self._lane(link)
        if link.mode == "write":
            t.enter(Phase.PUSH)
            lane.push_queue.append(t)
        elif t.ref.block >= 0 and time.time() < t.ref.valid_until:
            t.enter(Phase.READ_QUEUED)
            lane.read_queue.append((t, t.ref.block))
        else:
            t.enter(Phase.GRANT)
            lane.get_queue.append(t)

    def flush(self) -> None:
        """Post this round's READs and send its Get and Push batches: one per producer and reader."""
        for link, lane in list(self._lanes.items()):
            if link.state is not LinkState.READY or not (lane.get_queue or lane.push_queue or lane.read_queue):
                continue
            if lane.read_queue:
                self._post_reads(link, lane)
            gets, lane.get_queue = lane.get_queue, []
            for (reader, readers), batch in _by_reader(gets).items():
                req = self.links.next_req()
                lane.by_req[req] = batch
                self.links.send(link, P.Get(session=link.session, req=req, mm_hashes=[t.mm_hash for t in batch],
                                            reader=reader, readers=readers))
            pushes, lane.push_queue = lane.push_queue, []
            for (reader, readers), batch in _by_reader(pushes).items():
                for t in batch:
                    lane.pushed[t.mm_hash] = t
                    t.t_post = time.perf_counter()
                self.links.send(link, P.Push(session=link.session, req=self.links.next_req(), reader=reader,
                                             readers=readers,
                                             items=[P.PushItem(mm_hash=t.mm_hash, block=t.slot.block,
                                                               nbytes=t.ref.desc.nbytes) for t in batch]))

    def _post_reads(self, link: Link, lane: _Lane) -> None:
        batch = [(t, b) for t, b in lane.read_queue if t.pending]
        lane.read_queue = []
        if batch:
            self._post(link, batch)

    def _post_held(self, tickets: list[LoadTicket]) -> list[LoadTicket]:
        """The direct path (owner thread): post at once the READs of items whose place a valid
        Hold gave, on a ready READ link to the incarnation that held them, as one request per
        producer. Returns the tickets that need the general path (``_start``): no place, a link
        not ready or in another mode, another incarnation, no pool space now, or a link with
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
            # (_dispatch retries it, waits for space or fails it with the reason).
            slots = self.pool.try_allocate_many([t.ref.desc.nbytes for t in batch], [t.mm_hash for t in batch])
            ready = []
            for t, slot in zip(batch, slots):
                if slot is None:
                    rest.append(t)
                else:
                    t.slot, t.mode = slot, "read"
                    ready.append((t, t.ref.block))
            if ready:
                self._post(link, ready)
                self.links.wake(link)  # bookkeeping (the silence clock), after the DMA started
        return rest

    def _post(self, link: Link, batch: list[tuple[LoadTicket, int]]) -> None:
        """Post ``(ticket, producer block)`` pairs as ONE READ request. (Their tensor views are
        built by a waiter while the DMA runs, see ``drive``, or at landing.)"""
        # No notification rides the READ: NIXL would report DONE only once the producer's side
        # has taken it, which needs the producer's progress. A ReadDone message is sent after
        # DONE instead (settle), off the hand-over.
        t_post = time.perf_counter()
        try:
            x = self.transport.post_many("READ", link.peer, [(t.slot.block, b, t.slot.nblocks) for t, b in batch])
        except TransferFailed as e:
            for t, _ in batch:
                self.fail(t, str(e), e.reason)
            return
        tickets = [t for t, _ in batch]
        self._reads[x] = tickets
        for t in tickets:
            t.xfer, t.t_post = x, t_post
            t.enter(Phase.READ)

    # --- the waiter drives its own transfers (owner thread) ----------------------------

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
        next_round = time.monotonic() + ROUND_EVERY_S
        while pending:
            now = time.monotonic()
            if now >= deadline:
                return False
            if now < next_round and _all_reading(pending):
                xfers = list({t.xfer: None for t in pending})
                views = [t for t in pending if not t.has_view]
                finished = self.transport.finished
                while True:  # NIXL status checks until one is final or a round is due
                    done = finished(xfers)
                    if done:
                        self._complete(done)
                        break
                    if views:  # the DMA is running: build a view meanwhile, not after it landed
                        views.pop().prepare_view()
                    elif self._settle:  # and settle earlier requests (read-done, telemetry)
                        self.settle()
                    elif time.monotonic() >= next_round:
                        break
            else:
                self.loop.progress(0.0)
                next_round = time.monotonic() + ROUND_EVERY_S
            pending = [t for t in pending if t.state is _PENDING]
        if settle:
            self.settle()
        return True

    # --- link events (owner thread) --------------------------------------------------

    def has_work(self, link: Link) -> bool:
        """Work that needs the producer's control plane (READs in flight do not: NIXL completes them)."""
        return bool(self._lanes.get(link))

    def on_ready(self, link: Link) -> None:
        lane = self._lanes.get(link)
        if lane is None:
            return
        waiting, lane.waiting = lane.waiting, []
        for t in waiting:
            if t.pending:
                self._dispatch(link, t)

    def on_down(self, link: Link, error: str, reason: str) -> None:
        """Fail everything that depends on ``link`` (DMA targets are kept out of use by ``fail``)."""
        for batch in list(self._reads.values()):
            for t in batch:
                if t.pending and t.ref.producer == link.address:
                    self.fail(t, error, reason)
        lane = self._lanes.get(link)
        if lane is None:
            return
        for t in lane.tickets():
            self.fail(t, error, reason)
        lane.waiting, lane.get_queue, lane.push_queue, lane.read_queue = [], [], [], []
        lane.by_req.clear()
        lane.pushed.clear()
        for slot, _ in lane.zombies:
            self.pool.quarantine(slot, self.cfg.quarantine_s, reason=reason)
        lane.zombies = []

    def on_dropped(self, link: Link) -> None:
        self._lanes.pop(link, None)

    def on_reply(self, link: Link, msg) -> None:
        lane = self._lane(link)
        if isinstance(msg, P.Grant):
            return self._on_grant(link, lane, msg)
        if isinstance(msg, P.Refused):
            for t in lane.by_req.pop(msg.req, []):
                self.fail(t, f"{msg.reason}: {msg.detail}", msg.reason)
            return
        if isinstance(msg, P.PushFailed):
            for s in msg.items:
                t = lane.pushed.pop(s.mm_hash, None)
                if t is not None:
                    self.fail(t, f"producer could not push: {s.status}: {s.detail}", s.status,
                              retryable=s.status in _RETRYABLE, settled=True)
            return
        if isinstance(msg, P.CancelAck):
            safe = set(msg.safe)
            keep = []
            for slot, until in lane.zombies:
                if slot.tag in safe:
                    self.pool.quarantine(slot, 0.0)
                else:
                    keep.append((slot, until))
            lane.zombies = keep
            return
        if isinstance(msg, P.StatsReply):
            return  # a late answer to a query that already timed out
        logger.warning("unexpected %s from producer %s", type(msg).__name__, link.address)

    def _on_grant(self, link: Link, lane: _Lane, msg: P.Grant) -> None:
        batch = lane.by_req.pop(msg.req, None)
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
                lane.read_queue.append((t, s.block))
            elif s.status in _RETRYABLE:
                self.metrics.count("retries")
                t.enter(Phase.GRANT)
                t.retry_at = time.monotonic() + 0.0005
                self._retry.append(t)
            else:
                self.metrics.count("nacks")
                self.fail(t, f"{s.status}: {s.detail}", s.status)
        for t in by_hash.values():
            self.fail(t, "producer's grant left this item out", "BAD_GRANT")

    def on_write_done(self, agent: str, sid: str, mm_hashes: list[str]) -> None:
        """A producer's WRITE into our pool finished: those items landed."""
        link = self.links.by_session(sid)
        lane = self._lanes.get(link) if link is not None else None
        if lane is None or link.peer is None or link.peer.name != agent:
            return
        for mm_hash in mm_hashes:
            t = lane.pushed.pop(mm_hash, None)
            if t is not None and t.pending:
                # the producer timed the WRITE; we see post -> notification
                self._landed(t, nbytes=t.ref.desc.nbytes)

    # --- completions (owner thread) --------------------------------------------------

    def poll(self) -> None:
        """Finish the READs NIXL reports done, then settle their requests (every round)."""
        if self._reads:
            for x in [x for x, batch in self._reads.items() if not any(t.pending for t in batch)]:
                del self._reads[x]  # every ticket failed: ``fail`` took care of the request and slots
            done = self.transport.finished(list(self._reads))
            if done:
                self._complete(done)
        if self._settle:
            self.settle()

    def _complete(self, xfers: list[Xfer]) -> None:
        """Requests NIXL reports final: land their tickets (at once: nothing else stands between
        completion and hand-over) or fail them (ERR)."""
        now = time.monotonic()
        for x in xfers:
            tickets = self._reads.pop(x, ())
            if x.state != "DONE":
                for t in tickets:
                    self.fail(t, f"READ from {t.ref.producer} failed (NIXL ERR)", "XFER_ERR")
                continue
            landed = []
            for t in tickets:
                if not t.pending:
                    continue
                t.xfer = None
                if now > t.deadline:
                    # Seen done only after its deadline (this process was stopped or starved):
                    # the producer may have reclaimed the slot and reused it before the READ ran.
                    self.fail(t, f"{self._timeout_msg(t)}: its READ was seen done only after the deadline, "
                                 f"its bytes are not trusted", "TIMEOUT", retryable=True, settled=True)
                else:
                    t.land()
                    landed.append(t)
            self.metrics.count("loads_landed", len(landed))
            self._settle.append((x, landed))
        self.loop.changed()

    def settle(self) -> None:
        """After-completion work kept off the hand-over: telemetry, releasing the request, and
        telling each producer its readers are done (it frees the items then)."""
        settle, self._settle = self._settle, []
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

    def _landed(self, t: LoadTicket, nbytes: int = 0) -> None:
        """The item's bytes are in our pool (READ done, or the producer's WRITE notification)."""
        t.land()
        if nbytes:
            self.metrics.transfer(nbytes, 0.0, t.t_done - t.t_post)
        self.metrics.count("loads_landed")
        self.loop.changed()

    # --- timers (owner thread) -------------------------------------------------------

    def _timeout_msg(self, t: LoadTicket) -> str:
        waited = time.perf_counter() - t.t_start
        return (f"item {t.mm_hash} from {t.ref.producer} not landed after {waited:.2f}s "
                f"(stuck in phase '{t.phase}')")

    def tick(self, now: float) -> None:
        """Deadlines, retries, push cancellations and transfer zombies."""
        for link, lane in list(self._lanes.items()):
            if link.state is not LinkState.READY:
                continue
            for req, batch in list(lane.by_req.items()):
                if all(not t.pending for t in batch):
                    del lane.by_req[req]
                    continue
                for t in batch:
                    if now >= t.deadline:
                        self.fail(t, self._timeout_msg(t), "TIMEOUT", retryable=True)
            for h, t in list(lane.pushed.items()):
                if not t.pending:
                    lane.pushed.pop(h, None)
                elif now >= t.deadline:
                    self.fail(t, self._timeout_msg(t), "TIMEOUT", retryable=True)
            if lane.zombies:
                keep = []
                for slot, until in lane.zombies:
                    if now >= until + self.cfg.quarantine_s:
                        self.pool.quarantine(slot, 0.0)  # no ack for long: producer must be gone
                    else:
                        keep.append((slot, until))
                lane.zombies = keep
        for batch in list(self._reads.values()):
            for t in batch:
                if t.pending and now >= t.deadline:
                    self.fail(t, self._timeout_msg(t), "TIMEOUT")
        if self._retry:
            retry, self._retry = self._retry, []
            for t in retry:
                if not t.pending:
                    continue
                if now >= t.deadline:
                    self.fail(t, self._timeout_msg(t), "TIMEOUT", retryable=True)
                elif now < t.retry_at:
                    self._retry.append(t)
                else:
                    link = self.links.find(t.ref.producer)
                    if link is None or link.state is not LinkState.READY:
                        self.fail(t, f"producer {t.ref.producer} lost", "PEER_LOST")
                    else:
                        self._dispatch(link, t)
        for lane in self._lanes.values():
            for t in lane.waiting:
                if t.pending and now >= t.deadline:
                    self.fail(t, self._timeout_msg(t), "TIMEOUT", retryable=True)
            lane.waiting = [t for t in lane.waiting if t.pending]
        if self._zombies:
            keep = []
            for x, slot in self._zombies:
                if self.transport.release(x):
                    self.pool.quarantine(slot, self.cfg.quarantine_s, reason="ZOMBIE")
                else:
                    keep.append((x, slot))
            self._zombies = keep

    def _idle_hint(self) -> Optional[float]:
        if self._reads:
            return 0.0
        return 0.001 if self._retry else None
