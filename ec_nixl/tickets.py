"""What a consumer asks for (``ItemRef``) and how each load stands (``LoadTicket``).

A ticket is created PENDING by ``Loader.load`` and ends LANDED (its bytes are in our pool) or
FAILED (``error``/``reason`` say why); ``phase`` says where a pending one is, which decides how a
failure frees its slot. (A pending ticket with a ``reason`` is one whose description was found
bad after its step's READ was posted: it fails when that READ is final, ``ReadLane.post_step``.)
Tickets are plain state owned by the loader's owner thread; the only things a caller does with
one are read it, take the landed tensor, and ``release`` the slot.
A ticket keeps a reference to its pool (to give the slot back), never to the endpoint.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional, Sequence

import msgspec
import torch

from ec_nixl import protocol as P
from ec_nixl.states import PHASE_NEXT, TICKET_NEXT, Phase, TicketState, advance
from ec_nixl.tensors import torch_dtype

# The members the per-item hot path uses, bound once: ``Phase.DONE`` looks the member up through
# the Enum's metaclass (~0.1 us on the 2-core dev box), and a 32-item step does it ~200 times.
_PENDING, _LANDED, _FAILED = TicketState.PENDING, TicketState.LANDED, TicketState.FAILED
_QUEUED, _DONE = Phase.QUEUED, Phase.DONE

if TYPE_CHECKING:
    from ec_nixl.pool import Fence, Pool, Slot
    from ec_nixl.transport import Xfer


class ItemRef(msgspec.Struct, frozen=True):
    """What a consumer needs to fetch one item: its description and where it lives.

    ``block``/``valid_until`` come from a producer's Hold reply: while the hold is valid the item
    cannot move, so a READ can be posted at once without asking for a grant.

    (A frozen msgspec Struct, not a frozen dataclass: a PD worker builds one per item on every
    step, ~2 us each as a dataclass, ~0.1 us as a Struct. A changed copy:
    ``msgspec.structs.replace(ref, producer=...)``.)
    """

    desc: P.ItemDesc
    producer: str
    block: int = -1
    valid_until: float = 0.0
    reader: int = 0
    readers: int = 1
    incarnation: str = ""
    """The producer incarnation whose Hold gave ``block`` (``HoldRequest.incarnation``): the block
    is used only on a session with that incarnation; a producer restarted at the same address is
    asked for a grant instead. Empty: trust ``block`` (callers that cannot tell)."""

    @property
    def mm_hash(self) -> str:
        return self.desc.mm_hash


class LoadTicket:
    """One item being loaded; LANDED once its bytes are in this endpoint's pool."""

    __slots__ = ("ref", "slot", "state", "phase", "error", "reason", "retryable", "deadline",
                 "t_start", "t_post", "t_done", "xfer", "retry_at", "mode", "_pool", "released", "event", "_view",
                 "resent", "wait_until")

    def __init__(self, ref: ItemRef, deadline: float, pool: "Pool"):
        self.ref = ref
        self.slot: Optional[Slot] = None
        self.state = _PENDING
        self.phase = _QUEUED
        self.error = ""
        self.reason = ""
        self.retryable = False
        self.deadline = deadline
        self.t_start = time.perf_counter()
        self.t_post = 0.0
        self.t_done = 0.0
        self.xfer: Optional[Xfer] = None
        self.retry_at = 0.0
        self.mode = ""
        self._pool = pool
        self.released = False
        self.event = None  # a CUDA event, when the bytes became visible through stream work
        self._view: Optional[torch.Tensor] = None
        self.resent = False  # its Get went out again on a new connection (once at most)
        self.wait_until = 0.0  # monotonic: the producer may wait for the item until then (load's wait_s)

    @property
    def mm_hash(self) -> str:
        return self.ref.desc.mm_hash

    @property
    def done(self) -> bool:
        return self.state is not _PENDING

    @property
    def pending(self) -> bool:
        return self.state is _PENDING

    def enter(self, phase: Phase) -> None:
        """Move to ``phase`` (owner thread; the table in ``states`` says which moves exist)."""
        self.phase = advance(self.phase, phase, PHASE_NEXT)

    @property
    def has_view(self) -> bool:
        return self._view is not None

    def prepare_view(self) -> None:
        """Build the item's tensor view ahead of landing (while its READ runs): the hand-over
        then only flips the state. The view is not handed out before ``land``."""
        slot = self.slot
        if self._view is None and slot is not None:
            d = self.ref.desc
            if d.nbytes > slot.nblocks * self._pool.block_size:
                raise ValueError(f"item {d.mm_hash} of {d.nbytes} B does not fit {slot!r}")
            self._view = self._pool.arena.landing_view(slot.block * self._pool.block_size, d.shape,
                                                       torch_dtype(d.dtype))

    def land(self, t_done: float = 0.0) -> None:
        """The bytes are in our pool: build the view now (unless prepared), off the waiter's path.
        ``t_done``: when (``perf_counter``), if the caller landed a whole request at once."""
        if self.slot is None:
            raise RuntimeError(f"item {self.mm_hash} landed without a slot")
        self.phase = advance(self.phase, _DONE, PHASE_NEXT)  # (``enter``, inlined: a step lands 32 in a row)
        self.t_done = t_done or time.perf_counter()
        self.state = advance(self.state, _LANDED, TICKET_NEXT)
        if self._view is None:
            self.prepare_view()

    def fail(self, error: str, reason: str, retryable: bool) -> None:
        """Record the failure; the caller has already decided what happens to the slot."""
        self.enter(_DONE)
        self.t_done = time.perf_counter()
        self.error, self.reason, self.retryable = error, reason, retryable
        self.state = advance(self.state, _FAILED, TICKET_NEXT)

    def tensor(self) -> torch.Tensor:
        """The landed item as a view into the pool (valid until ``release``); built once."""
        if self.state is not _LANDED or self.slot is None:
            raise RuntimeError(f"item {self.mm_hash} is {self.state}, not landed")
        if self._view is None:
            self.prepare_view()
        return self._view

    def release(self, fence: Optional[Fence] = None) -> None:
        """Give the slot back once ``fence`` (e.g. the gather's CUDA event) has completed."""
        if not self.released and self.state is _LANDED and self.slot is not None:
            self.released = True
            self._pool.release(self.slot, fence)

    def __repr__(self) -> str:
        return f"LoadTicket({self.mm_hash!r}, {self.state}/{self.phase}{', ' + self.error if self.error else ''})"


def wait_left(tickets: list[LoadTicket]) -> float:
    """How long a Get or Push of ``tickets`` may let the producer wait for items not published
    yet: the longest of their waits still left (0: none asked, or all ran out)."""
    until = max(t.wait_until for t in tickets)
    return max(0.0, until - time.monotonic()) if until else 0.0


def hand_over(tickets: Sequence[LoadTicket]) -> tuple[dict[str, torch.Tensor], list]:
    """The barrier's hand-over of landed ``tickets``: ``({mm_hash: view}, [CUDA events the
    compute stream must wait on])``, in one plain loop over the tickets' slots (no property or
    method call per item: every step pays it, 32 times for a 32-item step). Raises like
    ``LoadTicket.tensor`` for one that has not landed."""
    out: dict[str, torch.Tensor] = {}
    events = []
    for t in tickets:
        v = t._view
        if v is None or t.state is not _LANDED:
            v = t.tensor()
        out[t.ref.desc.mm_hash] = v
        if t.event is not None:
            events.append(t.event)
    return out, events
