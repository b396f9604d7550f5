"""Pushing items: the producer WRITEs into consumers' reserved slots.

A consumer whose link prefers WRITE sends ``Push`` (its slot per item); the server records it in
the items table and hands it here. Each round, the pusher posts one NIXL WRITE per consumer
session and reader carrying every ready item (the notification names them all, so the consumer
lands the batch at once), then polls posted WRITEs and ends each push in the table: done for the
reader, or failed with a ``PushFailed`` reply. A WRITE that NIXL cannot release yet stays polled.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from ec_nixl import protocol as P
from ec_nixl.errors import TransferFailed
from ec_nixl.handshake import Session
from ec_nixl.loop import OwnerLoop, has_spare_cpus
from ec_nixl.metrics import Metrics
from ec_nixl.published import Item, Published, Push
from ec_nixl.states import PushState
from ec_nixl.transport import Transport

PUSH_POLL_S = (0.0002, 0.002)
"""Sleep between polls of a posted WRITE: (when just posted, at most)."""
PUSH_SPIN_S = 0.0005 if has_spare_cpus() else 0.0
"""How long after a post the loop polls the WRITE without sleeping (a GPU WRITE of one image takes
~20-100 us, which a 0.2 ms sleep would triple). Only where the process has spare CPUs
(``loop.SPARE_CPUS``): on a small host the spinning loop would take the core the consumer's UCX needs."""


class Pusher:
    """The producer's WRITE queue (owner thread only)."""

    def __init__(self, published: Published, transport: Transport, metrics: Metrics, loop: OwnerLoop,
                 session: Callable[[str], Optional[Session]], reply: Callable[[bytes, object], None]):
        self.published, self.transport, self.metrics = published, transport, metrics
        self._session, self._reply = session, reply
        self._active: list[tuple[Item, Push]] = []
        loop.every_round(self.poll)
        loop.idle_hint(self._idle_hint)

    def _idle_hint(self) -> Optional[float]:
        """Poll posted WRITEs without spinning for long: their completion needs the consumer's
        UCX (and NIXL's thread) to run, on CPUs that may be scarce. Spin for ``PUSH_SPIN_S`` after
        a post (hosts with spare CPUs only), then sleep 0.2 ms between polls, growing with the
        WRITE's age to 2 ms; pushes still waiting for their item's fence poll every 1 ms."""
        if not self._active:
            return None
        posted = [p.xfer.t_posted for _, p in self._active if p.state is PushState.POSTED]
        if not posted:
            return 0.001
        age = time.monotonic() - max(posted)
        if age < PUSH_SPIN_S:
            return 0.0
        lo, hi = PUSH_POLL_S
        return min(hi, max(lo, age / 4))

    def add(self, pushes: list[tuple[Item, Push]]) -> None:
        self._active.extend(pushes)
        self.poll()

    def active(self) -> list[tuple[str, str]]:
        """(mm_hash, state) of every push being worked on (for status and tests)."""
        return [(item.desc.mm_hash, str(push.state)) for item, push in self._active]

    def still_running(self, push: Push) -> bool:
        """A posted WRITE that NIXL reports in progress and will not cancel."""
        return (push.state is PushState.POSTED and push.xfer is not None
                and self.transport.poll(push.xfer) == "PROC" and not self.transport.release(push.xfer))

    def _current(self, item: Item, push: Push) -> bool:
        return item.pushes.get((push.session, push.reader)) is push

    def poll(self) -> None:
        """Post queued pushes whose item is ready; finish the ones NIXL reports done."""
        if self.published.native is not None:  # pushes their publish started natively: ours to end
            self._active.extend(self.published.native.take_fired())
        if not self._active:
            return
        groups: dict[tuple[str, int], list[tuple[Item, Push]]] = {}
        for item, push in self._active:
            if push.state is PushState.QUEUED and self._current(item, push) \
                    and self._session(push.session) is not None and item.is_ready():
                groups.setdefault((push.session, push.reader), []).append((item, push))
        for (sid, reader), batch in groups.items():
            s = self._session(sid)
            notif = P.encode_notif(P.NOTIF_WRITE_DONE, sid, [it.desc.mm_hash for it, _ in batch], reader)
            try:
                # The item's blocks, as the consumer sized its slot: a slot reserved larger than
                # the item (reserve + publish_slot) would overrun the consumer's slot if written whole.
                bs = self.transport.block_size
                ranges = [(it.slot.block, p.block, P.blocks_for(it.desc.nbytes, bs)) for it, p in batch]
                x = self.transport.post_many("WRITE", s.peer, ranges, notif)
            except TransferFailed as e:
                for it, p in batch:
                    self._failed(s, it, p, str(e))
                continue
            now = time.monotonic()
            for it, p in batch:
                p.posted(x)
                # From the later of the ask and the publish to the WRITE posted: the producer's own
                # share of a consumer's load (where its Python waited, for the GIL or its I/O thread)
                self.metrics.phase("push_post", now - max(p.t_asked, it.t_pub))
        still = []
        for item, push in self._active:
            s = self._session(push.session)
            if not self._current(item, push):
                continue  # cancelled, failed or done
            if s is None:  # the consumer went away: release its WRITE; until NIXL lets go, it keeps our slot
                if push.state is PushState.POSTED and not self.transport.release(push.xfer):
                    still.append((item, push))
                    continue
                self.published.push_ended(item, push, None)
                continue
            if push.state is PushState.QUEUED:
                still.append((item, push))
                continue
            x = push.xfer
            st = self.transport.poll(x)
            if st == "PROC":
                still.append((item, push))
            elif st == "DONE":
                if not x.released:
                    tel = self.transport.telemetry(x)
                    self.transport.release(x)
                    if tel is not None:
                        self.metrics.transfer(x.nbytes, tel[0] * 1e-6, tel[1] * 1e-6, tel[3])
                self.published.push_ended(item, push, s.group)
            else:
                if not x.released:
                    self.metrics.count("failed_transfers")
                if not self.transport.release(x):
                    still.append((item, push))  # keep polling until NIXL lets it go
                    continue
                self._failed(s, item, push, f"WRITE to {s.name} failed (NIXL ERR)")
        self._active = still

    def _failed(self, s: Session, item: Item, push: Push, detail: str) -> None:
        self.published.push_ended(item, push, None)
        self._reply(s.identity, P.PushFailed(req=push.req, items=[
            P.ItemState(mm_hash=item.desc.mm_hash, status="XFER_ERR", detail=detail)]))
