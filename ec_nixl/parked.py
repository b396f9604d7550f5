"""The requests a producer keeps until their items exist: Holds, Gets and Pushes with ``wait_s``.

Each is either the native hand-off's or the server's. The hand-off's (a Hold or Get noted by
``native_answers``, a Push whose items ``native_push`` armed) are answered or started by the
publish itself, off the GIL; the server only settles them once the hand-off says they ended (it
writes ``NativeHandoff.done_fd``), or answers them when their wait runs out. The server's (no
hand-off, an item still behind a fence, something the hand-off gave back) need its loop: at every
publish and every tick.

Counting the server's ones (``python``) lets a publish leave the server's thread asleep when
nothing waiting needs it. Waking it there had it take the GIL from the runner that just
published, only to settle outcomes the hand-off reports anyway; and the tick then kept waking it
every 2 ms while anything was parked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import msgspec

from ec_nixl import protocol as P
from ec_nixl.loop import IDLE_POLL_S, TICK_S

MAX_PARKED = 4096
"""Waiting requests kept at once; beyond that one is answered at once."""


@dataclass
class Waiting:
    deadline: float
    identity: bytes
    sid: str
    msg: P.Hold | P.Get | P.Push
    native: bool  # the hand-off answers or starts it at the publish (and says when it ended)


class Parked:
    """The waiting requests (owner thread), and how many need the server's loop (any thread reads
    ``python``)."""

    def __init__(self):
        self._all: list[Waiting] = []
        self.python = 0
        self._next_deadline = float("inf")

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[Waiting]:
        return iter(self._all)

    def full(self) -> bool:
        return len(self._all) >= MAX_PARKED

    def add(self, w: Waiting) -> None:
        self._all.append(w)
        self.python += not w.native
        self._next_deadline = min(self._next_deadline, w.deadline)

    def reset(self, entries: list[Waiting]) -> None:
        """What stays parked after a pass over them."""
        self._all = entries
        self.python = sum(not w.native for w in entries)
        self._next_deadline = min((w.deadline for w in entries), default=float("inf"))

    def drop_pushes(self, sid: str, mm_hashes: set[str]) -> None:
        """Take ``mm_hashes`` out of session ``sid``'s parked Pushes (a Cancel, nothing written)."""
        keep = []
        for w in self._all:
            if w.sid == sid and isinstance(w.msg, P.Push):
                items = [it for it in w.msg.items if it.mm_hash not in mm_hashes]
                if not items:
                    continue
                w = replace(w, msg=msgspec.structs.replace(w.msg, items=items))
            keep.append(w)
        self.reset(keep)

    def idle_hint(self) -> Optional[float]:
        """Every tick while one is the server's to look at (a fence has no file descriptor to wake
        it); else when the first wait runs out (the hand-off's file descriptor wakes the rest)."""
        if self.python:
            return TICK_S
        if not self._all:
            return None
        left = self._next_deadline - time.monotonic()
        return max(0.0, left) if left < IDLE_POLL_S else None
