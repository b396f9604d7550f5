"""The producer's table of published items: what is pinned, for whom, until when.

``publish`` pins encoder outputs in the registered pool (one pack per step, or zero-copy when
written in place through ``reserve``). Each ``Item`` then records who declared interest (consumer
groups and how many readers each), who holds a READ grant (pins), which pushes use it, and its
lease. An item is freed when every reader of every interested group is done, when its lease
ends, or when it is unpublished — and never while a grant or push still uses its slot, nor while
a Hold's answer still promises a holder its place (a holder READs there without asking again).

A full pool does not fail a publish at once while space is on its way back: a consumer's
read-done message, a fence or a quarantine can lag the read by a step, and the allocator is
first-fit, so ``publish``/``reserve`` wait up to ``reserve_wait_s`` for it (``_allocate``), then
evict unclaimed items, then fail with an error that says what held the space.

The table is shared: caller threads publish, the owner thread serves. One lock guards it; no
NIXL or socket call is made under it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Protocol

import torch

from ec_nixl import protocol as P
from ec_nixl.config import EndpointConfig
from ec_nixl.errors import ConfigError, PoolExhausted, ProtocolError
from ec_nixl.metrics import Metrics
from ec_nixl.pool import Fence, Pool, Slot
from ec_nixl.states import PUSH_NEXT, PushState, advance
from ec_nixl.tensors import Both, describe, dtype_name

logger = logging.getLogger("ec_nixl")


class TableListener(Protocol):
    """Hears each item that enters the table and each that leaves it (freed, evicted, expired,
    unpublished), without the table's lock held: a producer pool's encoder-cache events."""

    def stored(self, desc: P.ItemDesc) -> None: ...

    def removed(self, mm_hash: str) -> None: ...


class _Unheard:
    """The listener of a table nobody listens to."""

    def stored(self, desc: P.ItemDesc) -> None:
        pass

    def removed(self, mm_hash: str) -> None:
        pass


class Push:
    """One consumer reader's request that we WRITE an item into its slot ``block``."""

    __slots__ = ("session", "reader", "block", "nbytes", "req", "xfer", "state", "native", "t_asked")

    def __init__(self, session: str, reader: int, block: int, nbytes: int, req: int):
        self.t_asked = time.monotonic()  # the server read the Push (its ``push_post`` phase starts here)
        self.session = session
        self.reader = reader
        self.block = block
        self.nbytes = nbytes
        self.req = req
        self.xfer = None
        self.state = PushState.QUEUED
        self.native = False  # started by the publish through the native hand-off (native_push)

    def posted(self, xfer) -> None:
        self.xfer = xfer
        self.state = advance(self.state, PushState.POSTED, PUSH_NEXT)


class Item:
    """One published item and everything that keeps it alive."""

    __slots__ = ("desc", "slot", "ready", "expires_at", "interest", "done", "pins", "pushes", "held",
                 "t_pub", "promised", "withdrawn", "orphaned_until")

    def __init__(self, desc: P.ItemDesc, slot: Slot, ready: Optional[Fence], lease_s: float):
        self.desc = desc
        self.slot = slot
        self.ready = ready
        self.t_pub = time.monotonic()
        self.expires_at = self.t_pub + lease_s
        self.interest: dict[str, int] = {}  # consumer group -> readers expected
        self.done: dict[str, set[int]] = {}  # consumer group -> readers that finished
        self.pins: dict[tuple[str, int], float] = {}  # (session, reader) -> pin expiry
        self.pushes: dict[tuple[str, int], Push] = {}
        self.held = False
        self.promised = 0.0
        """Until when (monotonic) some consumer was told the item stays where it is (the lease in a
        ready answer): it may READ the place without asking again until then."""
        self.withdrawn = False
        """Unpublished: no new Hold, Get or push finds it; it waits only for its promises."""
        self.orphaned_until = 0.0
        """Until when (monotonic) a reader whose session was dropped may still be reading it
        (0: none): its memory is not reused before."""

    def is_ready(self) -> bool:
        if self.ready is None:
            return True
        if self.ready.query():
            self.ready = None
            return True
        return False

    def satisfied(self) -> bool:
        """Every group that declared interest has had all its readers read the item."""
        return bool(self.interest) and all(
            len(self.done.get(s, ())) >= n for s, n in self.interest.items()
        )

    def busy(self) -> bool:
        return bool(self.pins or self.pushes) or self.orphaned_until > 0.0


def _pack(pool: Pool, copies: list, allocate, ready: Optional[Fence]) -> Optional[Fence]:
    """Give each ``(desc, None, bytes)`` of ``copies`` a slot (in place) and copy them in with ONE
    ``native.pack``; returns the fence of the copy. The slots are one run where the pool has one
    (a consumer loading the step then moves it as one descriptor), else ``allocate``d one by one,
    waiting; what raises leaves the slots taken so far in ``copies`` for the caller to free."""
    from ec_nixl import native

    slots = pool.try_allocate_many([c[0].nbytes for c in copies], [c[0].mm_hash for c in copies])
    copies[:] = [(desc, slot, src) for (desc, _, src), slot in zip(copies, slots)]
    for i, (desc, slot, src) in enumerate(copies):
        if slot is None:
            copies[i] = (desc, allocate(desc.nbytes, desc.mm_hash), src)
    native.pack([c[2] for c in copies], pool.arena.bytes, [c[1].offset for c in copies])
    if pool.arena.device.type != "cuda":
        return ready
    ev = torch.cuda.Event()
    ev.record()
    return Both(ready, ev) if ready is not None else ev


def _keeps(item: Item) -> str:
    """What keeps ``item`` (for ``space_report``)."""
    if item.pushes:
        return "pushed"
    if item.pins or item.orphaned_until:  # (a dropped reader's pin lasts until its deadline)
        return "pinned by a READ grant"
    if item.withdrawn:
        return "withdrawn, promised"
    if not item.interest:
        return "unclaimed"
    return "read, kept" if item.satisfied() else "being read"


def space_report(kept: list[tuple[str, str]], pool: Pool) -> str:
    """What keeps the pool's space, in one line: the items (hash, what keeps it; oldest first)
    by what keeps them, the pool's deferred and quarantined slots, and how the free space is split."""
    kinds = dict.fromkeys(("being read", "pinned by a READ grant", "pushed", "withdrawn, promised", "read, kept",
                           "unclaimed"), 0)
    for _, k in kept:
        kinds[k] += 1
    n = len(kept)
    st = pool.stats()
    parts = [f"{n} published item(s)" + (": " + ", ".join(f"{v} {k}" for k, v in kinds.items() if v) if n else "")]
    if kept:
        parts.append("oldest " + ", ".join(f"{h} ({k})" for h, k in kept[:3]))
    parts.append(f"{st.deferred} slot(s) behind a fence, {st.quarantined} quarantined")
    runs = pool.free_runs()
    parts.append(f"free space in {len(runs)} run(s), largest {max(runs, default=0) * pool.block_size} B")
    return "; ".join(parts)


class Published:
    """The items table. Public calls (any thread): ``publish``/``publish_many``, ``reserve``/
    ``publish_slot``, ``unpublish``, ``hashes``; the rest is for the server (owner thread)."""

    def __init__(self, cfg: EndpointConfig, pool: Pool, metrics: Metrics,
                 wait_for: Optional[Callable[[Callable[[], bool], float], bool]] = None,
                 on_free: Callable[[], None] = lambda: None, on_publish: Callable[[bool], None] = lambda back: None):
        """``wait_for(pred, timeout)`` blocks a publisher until ``pred()`` (the endpoint's: it drives
        the owner loop when the caller is the owner); ``on_free()`` wakes such waiters;
        ``on_publish(back)`` runs after each publish (``back``: the server must look at what waits)."""
        self.cfg, self.pool, self.metrics = cfg, pool, metrics
        self._wait_for, self._on_free, self._on_publish = wait_for, on_free, on_publish
        self._lock = threading.Lock()
        self._items: dict[str, Item] = {}
        self.native = None  # native_push.NativePushes: parked pushes the publish starts (server sets it)
        self.answers = None  # native_answers.NativeAnswers: parked Holds and Gets the publish answers
        self.listener: TableListener = _Unheard()  # (ec_nixl.vllm.cache_events sets its own)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def any_published(self, hashes) -> bool:
        """Whether any of ``hashes`` is in the table now (withdrawn or not)."""
        with self._lock:
            return any(h in self._items for h in hashes)

    def hashes(self) -> list[str]:
        with self._lock:
            return [h for h, item in self._items.items() if not item.withdrawn]

    # --- publishing (any thread) -----------------------------------------------------

    def publish_many(self, items: list[tuple[str, torch.Tensor]], ready: Optional[Fence] = None) -> list[P.ItemDesc]:
        """Pin a step's encoder outputs for transfer; returns their descriptions.

        A tensor that starts a pool slot (written there through ``reserve()``) is adopted as is,
        taking a hold on its slot. All others are copied into new slots by ONE ``native.pack``
        (a single kernel launch on CUDA, on the current stream, guarded by one event: the copy
        never blocks the host), each counted as a staging copy. Publishing a hash that is already
        published only renews its lease. On error nothing of the batch stays allocated.
        """
        pool = self.pool
        descs: list[P.ItemDesc] = []
        copies: list[tuple[P.ItemDesc, Optional[Slot], torch.Tensor]] = []
        seen: dict[str, P.ItemDesc] = {}
        back = False  # something waiting natively went back to the server
        try:
            for mm_hash, tensor in items:
                if mm_hash in seen:
                    descs.append(seen[mm_hash])
                    continue
                desc = describe(mm_hash, tensor)
                P.validate_item(desc)
                with self._lock:
                    item = self._items.get(mm_hash)
                    if item is not None:
                        item.expires_at = max(item.expires_at, time.monotonic() + self.cfg.announce_lease_s)
                        item.withdrawn = False  # published again (same hash, same bytes)
                        desc = item.desc
                        back = True  # (no native path sees a renewal: the server looks at what waits)
                if item is None:
                    if tensor.device != pool.arena.device:
                        raise ConfigError(f"item {mm_hash} is on {tensor.device}, the pool on {pool.arena.device}")
                    tensor = tensor.contiguous()
                    slot = pool.slot_at(tensor.data_ptr()) if pool.arena.contains(tensor) else None
                    if slot is not None:  # written straight into the pool (see reserve()): no copy
                        pool.hold(slot)
                        back = self._add(desc, slot, ready) or back
                    else:
                        copies.append((desc, None, tensor.reshape(-1).view(torch.uint8)))
                seen[mm_hash] = desc
                descs.append(desc)
            if copies:
                fence = _pack(pool, copies, self._allocate, ready)
        except Exception:
            for _, slot, _ in copies:
                if slot is not None:
                    pool.release(slot)
            raise
        for desc, slot, _ in copies:
            back = self._add(desc, slot, fence) or back
            self.metrics.count("staging_copies")
            self.metrics.count("staging_bytes", desc.nbytes)
        if descs:
            self._on_publish(back)
        return descs

    def reserve(self, nbytes: int, tag: str = "") -> Slot:
        """A pool slot to write an item into directly (zero-copy publish with ``publish_slot``)."""
        return self._allocate(nbytes, tag)

    def _allocate(self, nbytes: int, tag: str) -> Slot:
        """A slot now; else, while space is on its way back (``releasing``), wait for it up to
        ``reserve_wait_s``; then evict unclaimed items; then fail naming what held the space."""
        pool = self.pool
        slot = pool.try_allocate(nbytes, tag)
        if slot is not None:
            return slot
        waited = 0.0
        if self.cfg.reserve_wait_s > 0 and self._wait_for is not None and self.releasing():
            self.metrics.count("reserve_waits")
            got: list[Slot] = []

            def fits_or_hopeless() -> bool:
                slot = pool.try_allocate(nbytes, tag)
                if slot is not None:
                    got.append(slot)
                    return True
                return not self.releasing()

            t0 = time.monotonic()
            self._wait_for(fits_or_hopeless, self.cfg.reserve_wait_s)
            waited = time.monotonic() - t0
            if got:
                return got[0]
        try:
            return pool.allocate(nbytes, tag=tag, evict=self._evictor())
        except PoolExhausted as e:
            self.metrics.count("reserve_failures")
            why = f"waited {waited:.2f}s for space on its way back" if waited else "nothing was on its way back"
            raise PoolExhausted(f"{e}; {why}; the space is held by {self.held_by()}") from None

    def releasing(self) -> bool:
        """Whether pool space may come back without a new request: an item a consumer claimed and
        has not finished reading, one pinned, pushed or withdrawn under a promise, a slot behind
        a fence or in quarantine. (Unclaimed items come back only by lease or eviction.)"""
        pool = self.pool.stats()
        if pool.deferred or pool.quarantined:
            return True
        consumed_frees = self.cfg.free_when_consumed
        with self._lock:
            for item in self._items.values():
                if item.busy() or item.withdrawn or (consumed_frees and item.interest and not item.satisfied()):
                    return True
        return False

    def held_by(self) -> str:
        """What keeps the pool's space, in one line (for errors and status): ``space_report``."""
        with self._lock:  # (the pool's own lock is taken after this one is let go: _evict nests them)
            kept = [(h, _keeps(item)) for h, item in sorted(self._items.items(), key=lambda kv: kv[1].t_pub)]
        return space_report(kept, self.pool)

    def publish_slot(self, mm_hash: str, slot: Slot, shape, dtype: torch.dtype,
                     ready: Optional[Fence] = None) -> P.ItemDesc:
        """Publish bytes already written (or being written: ``ready``) into ``slot``; no copy."""
        desc = P.ItemDesc(mm_hash=mm_hash, shape=list(shape), dtype=dtype_name(dtype),
                          nbytes=int(torch.Size(shape).numel()) * P.DTYPE_SIZES[dtype_name(dtype)])
        P.validate_item(desc)
        if desc.nbytes > slot.nblocks * self.pool.block_size:
            raise ProtocolError(f"item {mm_hash} of {desc.nbytes} B does not fit its slot of {slot.nbytes} B")
        with self._lock:
            if mm_hash in self._items:
                raise ProtocolError(f"item {mm_hash} is already published")
        self._on_publish(self._add(desc, slot, ready))
        return desc

    def unpublish(self, mm_hash: str) -> bool:
        """Withdraw an item: from now on no Hold, Get or push finds it. Its memory goes at once,
        unless a transfer is using it or a Hold answer still promises a holder its place; then
        when that transfer ends and every such holder has read it or its promise ran out."""
        now = time.monotonic()
        with self._lock:
            item = self._items.get(mm_hash)
            if item is None or item.withdrawn:
                return False
            item.withdrawn = True
            item.expires_at = min(item.expires_at, item.promised)
            if not self._gone(item, now):
                return True
            del self._items[mm_hash]
        self._release(item)
        return True

    def _gone(self, item: Item, now: float) -> bool:
        """Nothing keeps ``item``'s memory any more (lock held): no transfer uses it, and it is
        withdrawn with no promise left unread (or consumed, when ``free_when_consumed``)."""
        if item.busy():
            return False
        if item.withdrawn:
            return now >= item.promised or item.satisfied()
        return self.cfg.free_when_consumed and item.satisfied()

    def _release(self, item: Item) -> None:
        """The table let go of ``item``: its slot goes back (a publisher waiting for space is woken)."""
        self.pool.release(item.slot)
        self._on_free()
        self.listener.removed(item.desc.mm_hash)

    def _add(self, desc: P.ItemDesc, slot: Slot, ready: Optional[Fence]) -> bool:
        """Add the item, start off the GIL what waited for it natively; True if some went back to the server."""
        fired, answers, back = [], [], False
        with self._lock:
            item = self._items[desc.mm_hash] = Item(desc, slot, ready, self.cfg.announce_lease_s)
            if self.native is not None:
                fired, back = self.native.take_armed(item, self._claim, time.monotonic())
            answering = self.answers  # (read once: the server may let go of it at close)
            if answering is not None:
                answers, answers_back = answering.take(item, self._grant)
                back = back or answers_back
        self.metrics.count("published")
        self.listener.stored(desc)
        if fired:  # parked pushes of this item: their WRITEs start now, off the GIL
            back = not self.native.fire(item, fired) or back
            self.metrics.count("native_pushes", len(fired))
        if answers:  # parked Holds and Gets it completes: their Grants go now, off the GIL
            back = not answering.send(answers) or back
        return back

    def _evictor(self) -> Optional[Callable[[int], int]]:
        return self._evict if self.cfg.evict_unclaimed else None

    def _evict(self, nbytes: int) -> int:
        """Drop published items nobody has held or pinned, oldest first, until ``nbytes`` fit."""
        freed = 0
        victims = []
        with self._lock:
            for h, item in sorted(self._items.items(), key=lambda kv: kv[1].t_pub):
                if freed >= nbytes:
                    break
                if not item.held and not item.busy():
                    victims.append(item)
                    freed += item.slot.nblocks * self.pool.block_size
                    del self._items[h]
        for item in victims:
            logger.info("evicting unclaimed item %s (%d B) to make room", item.desc.mm_hash, item.desc.nbytes)
            self._release(item)
        return len(victims)

    # --- serving (owner thread) ------------------------------------------------------

    def _missing(self, mm_hash: str) -> P.ItemState:
        return P.ItemState(mm_hash=mm_hash, status=P.Nack.MISSING.value,
                           detail=f"{self.cfg.name} does not hold {mm_hash}")

    def _claim(self, item: Item, group: str, readers: int, now: float) -> None:
        """A consumer group wants ``item``: it stays until that group's readers are done."""
        item.held = True
        item.interest[group] = max(item.interest.get(group, 1), readers)
        item.expires_at = max(item.expires_at, now + self.cfg.announce_lease_s)

    def grant(self, sid: str, group: str, mm_hashes: list[str], readers: int, reader: int,
              pin: bool) -> list[P.ItemState]:
        """Answer a Hold (``pin=False``: lease + where) or a Get (``pin=True``: a READ grant)."""
        with self._lock:
            return self._grant(sid, group, mm_hashes, readers, reader, pin, time.monotonic())

    def _grant(self, sid: str, group: str, mm_hashes: list[str], readers: int, reader: int, pin: bool,
               now: float, fresh: Optional[Item] = None) -> list[P.ItemState]:
        """``grant`` with the lock held. ``fresh``: the item being published, counted as ready (the
        native answer is sent once its copy is complete: ``native_answers``)."""
        out = []
        for h in mm_hashes:
            item = self._items.get(h)
            if item is None or item.withdrawn:
                out.append(self._missing(h))
                continue
            self._claim(item, group, readers, now)
            if item is not fresh and not item.is_ready():
                out.append(P.ItemState(mm_hash=h, status=P.Nack.NOT_READY.value, detail="still being written"))
                continue
            if pin:
                item.pins[(sid, reader)] = now + self.cfg.grant_lease_s
            d = item.desc
            item.promised = max(item.promised, item.expires_at)
            out.append(P.ItemState(mm_hash=h, status="ready", block=item.slot.block, nbytes=d.nbytes,
                                   shape=d.shape, dtype=d.dtype, lease_s=item.expires_at - now))
        return out

    def claim_pushes(self, sid: str, group: str, arena: P.ArenaInfo,
                     msg: P.Push) -> tuple[list[tuple[Item, Push]], list[P.ItemState]]:
        """Record a Push request: the new pushes to post, and the items refused (with why)."""
        now = time.monotonic()
        accepted, failed = [], []
        with self._lock:
            for it in msg.items:
                item = self._items.get(it.mm_hash)
                if item is None or item.withdrawn:
                    failed.append(self._missing(it.mm_hash))
                    continue
                n = P.blocks_for(item.desc.nbytes, arena.block)
                if it.nbytes != item.desc.nbytes:
                    failed.append(P.ItemState(mm_hash=it.mm_hash, status=P.Nack.BAD_REQUEST.value,
                                              detail=f"asked for {it.nbytes} B, item has {item.desc.nbytes} B"))
                    continue
                if it.block < 0 or (it.block + n) * arena.block > arena.size:
                    failed.append(P.ItemState(mm_hash=it.mm_hash, status=P.Nack.BAD_REQUEST.value,
                                              detail=f"destination block {it.block} outside your arena"))
                    continue
                self._claim(item, group, max(1, msg.readers), now)
                old = item.pushes.get((sid, msg.reader))
                if old is not None and old.state is PushState.POSTED:
                    failed.append(P.ItemState(mm_hash=it.mm_hash, status=P.Nack.BUSY.value,
                                              detail="a push to this reader is still in flight"))
                    continue
                push = Push(sid, msg.reader, it.block, item.desc.nbytes, msg.req)
                item.pushes[(sid, msg.reader)] = push
                accepted.append((item, push))
        return accepted, failed

    def push_ended(self, item: Item, push: Push, group: Optional[str]) -> None:
        """A push finished (``group``: the reader's group when it succeeded, else None)."""
        with self._lock:
            item.pushes.pop((push.session, push.reader), None)
            if group is not None:
                item.done.setdefault(group, set()).add(push.reader)
        self.maybe_free(item)

    def cancel_pushes(self, sid: str, mm_hashes: list[str],
                      still_running: Callable[[Push], bool]) -> tuple[list[str], list[str]]:
        """Drop a session's pushes of these items: (safe, in_flight) by whether a WRITE may still run."""
        safe, in_flight = [], []
        with self._lock:
            for h in mm_hashes:
                item = self._items.get(h)
                pushes = [] if item is None else [p for k, p in item.pushes.items() if k[0] == sid]
                busy = False
                for p in pushes:
                    if still_running(p):
                        busy = True
                        continue
                    item.pushes.pop((sid, p.reader), None)
                (in_flight if busy else safe).append(h)
        return safe, in_flight

    def read_done(self, sid: str, group: str, mm_hashes: list[str], reader: int) -> None:
        """A consumer's reader finished READing these items: free each once all readers did."""
        for mm_hash in mm_hashes:
            with self._lock:
                item = self._items.get(mm_hash)
                if item is None:
                    continue
                item.pins.pop((sid, reader), None)
                item.done.setdefault(group, set()).add(reader)
            self.maybe_free(item)

    def drop_session(self, sid: str, group: str, group_left: bool) -> None:
        """A session ended: its pins go, and its group's interest unless the group lives on.

        An item that only this (now gone) group held has nobody left to read it: its lease is cut
        to ``link_timeout_s`` (a reconnecting consumer that claims it again keeps it). A pin
        (a granted READ) goes, but its memory is kept until the reader's load deadline has passed
        (grant time plus ``load_timeout_s``): a connection dropped for silence may be a frozen
        reader whose READ still runs when it wakes, and it trusts a READ it sees done before its
        deadline, so the slot must not be reused under it until then (a closed connection costs
        only that wait)."""
        now = time.monotonic()
        until = now + self.cfg.link_timeout_s
        with self._lock:
            items = list(self._items.values())
            for item in items:
                if not group_left and item.interest.pop(group, None) is not None and not item.interest:
                    item.expires_at = min(item.expires_at, until)
                for k in [k for k in item.pins if k[0] == sid]:
                    reading_until = item.pins.pop(k) - self.cfg.grant_lease_s + self.cfg.load_timeout_s
                    if reading_until > now:
                        item.orphaned_until = max(item.orphaned_until, reading_until)
        for item in items:
            self.maybe_free(item)

    def maybe_free(self, item: Item) -> None:
        with self._lock:
            if not self._gone(item, time.monotonic()) or self._items.get(item.desc.mm_hash) is not item:
                return
            del self._items[item.desc.mm_hash]
        self._release(item)

    def expire(self, now: float) -> None:
        """End pins and leases that ran out (items nobody read are counted, then freed)."""
        if not self._items:
            return
        expired, unorphaned = [], []
        with self._lock:
            for item in self._items.values():
                for k, until in list(item.pins.items()):
                    if now >= until:
                        del item.pins[k]
                        self.metrics.count("expired_pins")
                if item.orphaned_until and now >= item.orphaned_until:
                    item.orphaned_until = 0.0
                    unorphaned.append(item)
                if now >= item.expires_at and not item.busy():
                    expired.append(item)
            for item in expired:
                del self._items[item.desc.mm_hash]
        for item in unorphaned:
            if item not in expired:
                self.maybe_free(item)  # read by all who could, and the dropped reader is past its deadline
        for item in expired:
            if not item.satisfied():
                self.metrics.count("expired_leases")
                logger.info("ec-nixl: lease of %s expired unread", item.desc.mm_hash)
            self._release(item)

    def inspect(self) -> dict[str, dict]:
        """What keeps each item alive, as plain data (for status output and test messages)."""
        with self._lock:
            return {h: _keeping(it, time.monotonic()) for h, it in self._items.items()}


def _keeping(it: Item, now: float) -> dict:
    """What keeps ``it`` alive (``Published.inspect``)."""
    return {"pins": {f"{k[0]}/{k[1]}": round(v - now, 3) for k, v in it.pins.items()},
            "pushes": len(it.pushes), "interest": dict(it.interest), "done": {g: sorted(r) for g, r in it.done.items()},
            "lease_left": round(it.expires_at - now, 3), "withdrawn": it.withdrawn}
