"""The loader's clock: every deadline and retry of a load, checked on the loop's tick.

A load can wait at many stages (a handshake, a Grant, a WRITE notification, a READ in flight, pool
space, a NOT_READY retry, a CancelAck); each has a deadline, and what is overdue goes to the
failure path. Checking them all here, in one pass per tick, keeps the stages themselves free of
timer code and makes "nothing waits past its deadline" one method to read.
"""

from __future__ import annotations

from typing import Callable, Optional

from ec_nixl.config import EndpointConfig
from ec_nixl.link_work import LinkWork
from ec_nixl.links import Link, Links
from ec_nixl.load_failures import Failures, timeout_error
from ec_nixl.pool import Pool
from ec_nixl.read_lane import ReadLane
from ec_nixl.states import LinkState
from ec_nixl.tickets import LoadTicket


class Clock:
    """Deadlines, retries, push cancellations and transfer zombies (owner thread)."""

    def __init__(self, cfg: EndpointConfig, pool: Pool, links: Links, failures: Failures, reads: ReadLane,
                 work: dict[Link, LinkWork], dispatch: Callable[[Link, LoadTicket], None]):
        self.cfg, self.pool, self.links, self.failures, self.reads = cfg, pool, links, failures, reads
        self.fail = failures.fail
        self.work = work  # the loader's per-link work (shared)
        self.dispatch = dispatch  # the loader's: a retry is dispatched again as new
        self.retry: list[LoadTicket] = []  # waiting for pool space or a NOT_READY retry

    def tick(self, now: float) -> None:
        """Deadlines, retries, push cancellations and transfer zombies."""
        fail = self.fail
        for link, work in list(self.work.items()):
            if link.state is not LinkState.READY:
                continue
            for req, batch in list(work.by_req.items()):
                if all(not t.pending for t in batch):
                    del work.by_req[req]
                    continue
                for t in batch:
                    if now >= t.deadline:
                        fail(t, timeout_error(t), "TIMEOUT", retryable=True)
            for h, t in list(work.pushed.items()):
                if not t.pending:
                    work.pushed.pop(h, None)
                elif now >= t.deadline:
                    fail(t, timeout_error(t), "TIMEOUT", retryable=True)
            if work.zombies:
                keep = []
                for slot, until in work.zombies:
                    if now >= until + self.cfg.quarantine_s:
                        self.pool.quarantine(slot, 0.0)  # no ack for long: producer must be gone
                    else:
                        keep.append((slot, until))
                work.zombies = keep
        for batch in list(self.reads.in_flight.values()):
            for t in batch:
                if t.pending and now >= t.deadline:
                    fail(t, timeout_error(t), "TIMEOUT")
        if self.retry:
            retry, self.retry = self.retry, []
            for t in retry:
                if not t.pending:
                    continue
                if now >= t.deadline:
                    fail(t, timeout_error(t), "TIMEOUT", retryable=True)
                elif now < t.retry_at:
                    self.retry.append(t)
                else:
                    link = self.links.find(t.ref.producer)
                    if link is None or link.state is not LinkState.READY:
                        fail(t, f"producer {t.ref.producer} lost", "PEER_LOST")
                    else:
                        self.dispatch(link, t)
        for work in self.work.values():
            for t in work.waiting:
                if t.pending and now >= t.deadline:
                    fail(t, timeout_error(t), "TIMEOUT", retryable=True)
            work.waiting = [t for t in work.waiting if t.pending]
        self.failures.reap()

    def idle_hint(self) -> Optional[float]:
        """How soon the loop must run again for the loader: at once while READs are in flight
        (only polling completes them), every 1 ms while retries wait."""
        if self.reads.in_flight:
            return 0.0
        return 0.001 if self.retry else None
