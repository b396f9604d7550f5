"""The WRITE lane: asking a producer to push items into our slots, and what it answers.

On a link in WRITE mode the consumer never moves bytes itself: it sends a Push naming its slots,
and the producer WRITEs into them and notifies. So this lane is all control plane: the Push
batches, the WRITE-done notifications that land tickets, the producer's PushFailed, and the
CancelAck that finally frees a push target the failure path had to keep out of use.
"""

from __future__ import annotations

import time

from ec_nixl import protocol as P
from ec_nixl.link_work import LinkWork, by_reader
from ec_nixl.links import Link, Links
from ec_nixl.load_failures import RETRYABLE, Failures
from ec_nixl.loop import OwnerLoop
from ec_nixl.metrics import Metrics
from ec_nixl.pool import Pool
from ec_nixl.tickets import LoadTicket, wait_left

class WriteLane:
    """Pushes asked of producers and their outcomes (owner thread)."""

    def __init__(self, pool: Pool, metrics: Metrics, loop: OwnerLoop, links: Links, failures: Failures,
                 work: dict[Link, LinkWork]):
        self.pool, self.metrics, self.loop, self.links = pool, metrics, loop, links
        self.fail = failures.fail
        self.work = work  # the loader's per-link work (shared)

    def send(self, link: Link, work: LinkWork) -> None:
        """Send the round's queued pushes of ``link``: one Push per reader group."""
        pushes, work.push_queue = work.push_queue, []
        for (reader, readers), batch in by_reader(pushes).items():
            for t in batch:
                work.pushed[t.mm_hash] = t
                t.t_post = time.perf_counter()
            self.links.send(link, P.Push(session=link.session, req=self.links.next_req(), reader=reader,
                                         readers=readers, wait_s=wait_left(batch),
                                         items=[P.PushItem(mm_hash=t.mm_hash, block=t.slot.block,
                                                           nbytes=t.ref.desc.nbytes) for t in batch]))

    def on_write_done(self, agent: str, sid: str, mm_hashes: list[str]) -> None:
        """A producer's WRITE into our pool finished: those items landed."""
        link = self.links.by_session(sid)
        work = self.work.get(link) if link is not None else None
        if work is None or link.peer is None or link.peer.name != agent:
            return
        for mm_hash in mm_hashes:
            t = work.pushed.pop(mm_hash, None)
            if t is not None and t.pending:
                # the producer timed the WRITE; we see post -> notification
                self._landed(t, nbytes=t.ref.desc.nbytes)

    def _landed(self, t: LoadTicket, nbytes: int = 0) -> None:
        """The item's bytes are in our pool (the producer's WRITE notification)."""
        t.land()
        if nbytes:
            self.metrics.transfer(nbytes, 0.0, t.t_done - t.t_post)
        self.metrics.count("loads_landed")
        self.loop.changed()

    def on_failed(self, work: LinkWork, msg: P.PushFailed) -> None:
        """The producer could not push these items: no WRITE will touch their slots."""
        for s in msg.items:
            t = work.pushed.pop(s.mm_hash, None)
            if t is not None:
                self.fail(t, f"producer could not push: {s.status}: {s.detail}", s.status,
                          retryable=s.status in RETRYABLE, settled=True)

    def on_cancel_ack(self, work: LinkWork, msg: P.CancelAck) -> None:
        """Push targets the producer says no WRITE will touch any more are free again."""
        safe = set(msg.safe)
        keep = []
        for slot, until in work.zombies:
            if slot.tag in safe:
                self.pool.quarantine(slot, 0.0)
            else:
                keep.append((slot, until))
        work.zombies = keep
