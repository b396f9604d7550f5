"""The loader's one failure path: what happens to a failed ticket's slot.

Every failure of a load, wherever it is found (a bad request, a Refused, a link gone down, a
deadline, a NIXL error), goes through ``Failures.fail``, which alone decides the slot's fate:
released when no DMA can touch it, quarantined (or kept with its transfer until NIXL lets go of
it) when one may. Keeping that decision in one place is what makes "a slot is never reused while
a transfer might still write it, and never leaked" checkable by reading one method.
"""

from __future__ import annotations

import time

from ec_nixl import protocol as P
from ec_nixl.config import EndpointConfig
from ec_nixl.link_work import LinkWork
from ec_nixl.links import Link, Links
from ec_nixl.loop import OwnerLoop
from ec_nixl.metrics import Metrics
from ec_nixl.pool import Pool, Slot
from ec_nixl.states import IN_DMA, LinkState, Phase
from ec_nixl.tickets import LoadTicket
from ec_nixl.transport import Transport, Xfer

RETRYABLE = frozenset({P.Nack.NOT_READY.value, P.Nack.BUSY.value})
"""Producer statuses that say "not now" rather than "never": the caller may try again."""


def timeout_error(t: LoadTicket) -> str:
    """The error of a ticket that missed its deadline: how long it waited, and where it was stuck."""
    waited = time.perf_counter() - t.t_start
    return (f"item {t.mm_hash} from {t.ref.producer} not landed after {waited:.2f}s "
            f"(stuck in phase '{t.phase}')")


class Failures:
    """Fails tickets and keeps their slots out of use while a DMA may touch them (owner thread)."""

    def __init__(self, cfg: EndpointConfig, pool: Pool, transport: Transport, metrics: Metrics,
                 loop: OwnerLoop, links: Links, work: dict[Link, LinkWork]):
        self.cfg, self.pool, self.transport, self.metrics, self.loop, self.links = \
            cfg, pool, transport, metrics, loop, links
        self.work = work  # the loader's per-link work (shared): a push target waits there for its CancelAck
        self.zombies: list[tuple[Xfer, Slot]] = []  # READs NIXL could not cancel yet, with their target

    def fail(self, t: LoadTicket, error: str, reason: str, retryable: bool = False, settled: bool = False) -> None:
        """Fail a pending ticket and decide its slot's fate.

        ``settled``: the caller knows no transfer can touch the slot any more (e.g. the producer
        reported its WRITE failed). Otherwise a ticket in a DMA phase keeps its slot out of use:
        a READ that NIXL cannot cancel yet stays with its request (``zombies``); a cancelled one,
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
                    self.zombies.append((x, slot))
                else:
                    self.quarantine(slot, reason)
            else:  # PUSH
                link = self.links.find(t.ref.producer)
                work = self.work.get(link) if link is not None else None
                if work is not None and link.state is LinkState.READY:
                    work.pushed.pop(t.mm_hash, None)
                    work.zombies.append((slot, time.monotonic() + self.cfg.quarantine_s))
                    self.metrics.count("quarantined")
                    self.links.send(link, P.Cancel(session=link.session, req=self.links.next_req(),
                                                   mm_hashes=[t.mm_hash]))
                else:
                    self.quarantine(slot, reason)
        t.fail(error, reason, retryable)
        self.metrics.count("loads_failed")
        self.metrics.fail(reason)
        self.loop.changed()

    def quarantine(self, slot: Slot, reason: str) -> None:
        self.pool.quarantine(slot, self.cfg.quarantine_s, reason=reason)
        self.metrics.count("quarantined")

    def reap(self) -> None:
        """Quarantine the targets of READs NIXL has let go of since (every tick)."""
        if self.zombies:
            keep = []
            for x, slot in self.zombies:
                if self.transport.release(x):
                    self.pool.quarantine(slot, self.cfg.quarantine_s, reason="ZOMBIE")
                else:
                    keep.append((x, slot))
            self.zombies = keep
