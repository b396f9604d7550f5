"""The loader's work on one link, by stage: the record its parts share.

The loader's parts (``loader`` dispatching, ``read_lane``, ``write_lane``, ``load_failures``,
``load_clock``) each move tickets through some of these queues. One record per link, rather than
queues spread over the parts, is what lets a link that goes down be emptied in one place
(``Loader.on_down``) and lets "does this link still need its producer" be one test (``has_work``).
"""

from __future__ import annotations

from ec_nixl.pool import Slot
from ec_nixl.tickets import LoadTicket


class LinkWork:
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
        """Every ticket on the link, whatever its stage."""
        out = self.waiting + self.get_queue + self.push_queue + [t for t, _ in self.read_queue]
        for batch in self.by_req.values():
            out.extend(batch)
        return out + list(self.pushed.values())


def by_reader(tickets: list[LoadTicket]) -> dict[tuple[int, int], list[LoadTicket]]:
    """Tickets grouped by (reader, readers): one Get or Push message per group."""
    out: dict[tuple[int, int], list[LoadTicket]] = {}
    for t in tickets:
        out.setdefault((t.ref.reader, t.ref.readers), []).append(t)
    return out
