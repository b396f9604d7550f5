"""Every state machine of the core, with its allowed transitions written down once.

Slots (``pool``), load tickets and their phases (``tickets``), consumer links to producers
(``links``) and producer pushes (``pusher``) each move through a few named states. The states
are ``str`` Enums (so they compare equal to, print as, and pickle like their plain names), and
every change goes through ``advance``, which refuses a transition the table does not list: a
bug shows up where it happens, not later as a leaked slot or a hung wait.
"""

from __future__ import annotations

from enum import Enum
from typing import Mapping, TypeVar


class State(str, Enum):
    """Base of the state Enums: equal to and formatted as its value ("landed", not "Phase.LANDED")."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


S = TypeVar("S", bound=State)


def advance(current: S, new: S, table: Mapping[S, frozenset]) -> S:
    """``new`` if the table allows ``current -> new``; otherwise a RuntimeError (a bug)."""
    if new not in table[current]:
        raise RuntimeError(f"illegal {type(current).__name__} transition {current} -> {new}")
    return new


class SlotState(State):
    LIVE = "live"  # held by someone (item table, ticket, transfer)
    DEFERRED = "deferred"  # no holds left, a fence (e.g. a reading kernel's event) still pending
    QUARANTINED = "quarantined"  # a DMA may still touch it: unusable until its deadline and check
    FREE = "free"  # back on the free list


SLOT_NEXT = {
    SlotState.LIVE: frozenset({SlotState.DEFERRED, SlotState.QUARANTINED, SlotState.FREE}),
    SlotState.DEFERRED: frozenset({SlotState.FREE}),
    SlotState.QUARANTINED: frozenset({SlotState.FREE}),
    SlotState.FREE: frozenset(),
}


class TicketState(State):
    PENDING = "pending"
    LANDED = "landed"  # bytes are in our pool; the only state whose tensor may be handed over
    FAILED = "failed"


TICKET_NEXT = {
    TicketState.PENDING: frozenset({TicketState.LANDED, TicketState.FAILED}),
    TicketState.LANDED: frozenset(),
    TicketState.FAILED: frozenset(),
}


class Phase(State):
    """Where a pending ticket is: it decides how a failure frees the slot (see ``Loader.fail``)."""

    QUEUED = "queued"  # created, not yet on the owner thread
    CONNECTING = "connecting"  # waiting for the producer's handshake
    POOL = "pool"  # waiting for pool space
    GRANT = "grant"  # asked for a READ grant (or waiting to ask again after NOT_READY)
    READ_QUEUED = "read-queued"  # READ goes out with this round's batch (nothing posted yet)
    READ = "read"  # READ posted: a DMA may be writing the slot
    PUSH = "push"  # producer asked to WRITE into the slot: a DMA may be writing it
    DONE = "done"  # landed or failed


_DISPATCHED = frozenset({Phase.POOL, Phase.GRANT, Phase.READ_QUEUED, Phase.PUSH, Phase.DONE})
PHASE_NEXT = {
    Phase.QUEUED: _DISPATCHED | {Phase.CONNECTING, Phase.READ},  # READ: a held item, posted at once
    Phase.CONNECTING: _DISPATCHED,
    Phase.POOL: _DISPATCHED,
    # CONNECTING: a Get the producer never answered, sent again on a new connection (``Loader.on_down``)
    Phase.GRANT: frozenset({Phase.GRANT, Phase.CONNECTING, Phase.READ_QUEUED, Phase.PUSH, Phase.DONE}),
    Phase.READ_QUEUED: frozenset({Phase.READ, Phase.DONE}),
    Phase.READ: frozenset({Phase.DONE}),
    Phase.PUSH: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}

IN_DMA = frozenset({Phase.READ, Phase.PUSH})
"""Phases in which a transfer may be writing the ticket's slot: failing one quarantines it."""


class LinkState(State):
    CONNECTING = "connecting"  # Hello sent, no Welcome yet
    READY = "ready"  # handshake done, NIXL peer added, mode chosen
    FAILED = "failed"  # refused or unreachable; kept briefly so callers fail fast
    LOST = "lost"  # was ready, then the producer went away; dropped at once


LINK_NEXT = {
    LinkState.CONNECTING: frozenset({LinkState.READY, LinkState.FAILED}),
    LinkState.READY: frozenset({LinkState.FAILED, LinkState.LOST}),
    LinkState.FAILED: frozenset(),
    LinkState.LOST: frozenset(),
}


class PushState(State):
    QUEUED = "queued"  # accepted, WRITE not posted yet (item not ready, or next round)
    POSTED = "posted"  # WRITE in flight


PUSH_NEXT = {
    PushState.QUEUED: frozenset({PushState.POSTED}),
    PushState.POSTED: frozenset(),
}
