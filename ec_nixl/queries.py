"""Asynchronous questions a consumer asks a producer over its link: Hold and Stats.

A query is created on any thread, sent by the owner thread once the link is ready, and answered
exactly once: by the producer's reply, or with a failure status (UNREACHABLE, TIMEOUT, ...)
for every item when the link cannot deliver it. Callers poll ``done`` or wait on the endpoint;
nothing here blocks.
"""

from __future__ import annotations

import time
from typing import Optional

from ec_nixl import protocol as P


class HoldRequest:
    """An asynchronous Hold; ``states`` is None until answered (or failed/timed out)."""

    __slots__ = ("producer", "mm_hashes", "readers", "req", "deadline", "states", "incarnation", "t_asked",
                 "t_answered", "wait_s", "resent")
    kind = "hold"

    def __init__(self, producer: str, mm_hashes: list[str], readers: int, req: int, deadline: float,
                 wait_s: float = 0.0):
        self.producer, self.mm_hashes, self.readers, self.req = producer, mm_hashes, readers, req
        self.wait_s = wait_s  # the producer may keep it this long for items not published yet
        self.deadline = deadline
        self.states: Optional[dict[str, P.ItemState]] = None
        self.incarnation = ""  # of the producer that answered (goes into ItemRef.incarnation)
        self.t_asked = time.monotonic()
        self.t_answered = 0.0  # when the answer (or the failure) arrived: the round trip's end
        self.resent = False  # asked again on a new connection (``Links.lose``; once at most)

    @property
    def done(self) -> bool:
        return self.states is not None

    def answer(self, items: list[P.ItemState]) -> None:
        got = {s.mm_hash: s for s in items if s.mm_hash in self.mm_hashes}
        for h in self.mm_hashes:
            got.setdefault(h, P.ItemState(mm_hash=h, status="BAD_GRANT", detail="left out of the answer"))
        self.t_answered = time.monotonic()
        self.states = got

    def finish(self, status: str, detail: str) -> None:
        if self.states is None:
            self.t_answered = time.monotonic()
            self.states = {h: P.ItemState(mm_hash=h, status=status, detail=detail) for h in self.mm_hashes}

    def message(self, session: str):
        return P.Hold(session=session, req=self.req, mm_hashes=self.mm_hashes, readers=self.readers,
                      wait_s=self.wait_s)

    def resolve(self, msg, incarnation: str) -> None:
        self.incarnation = incarnation
        if isinstance(msg, P.Grant):
            self.answer(msg.items)
        else:
            self.finish("BAD_REPLY", f"unexpected {type(msg).__name__}")


class StatsRequest:
    """An asynchronous Stats query; ``stats`` is None until answered, ``error`` set on failure."""

    __slots__ = ("producer", "req", "deadline", "stats", "error", "resent")
    kind = "stats"

    def __init__(self, producer: str, req: int, deadline: float):
        self.producer, self.req, self.deadline = producer, req, deadline
        self.stats: Optional[dict] = None
        self.error = ""
        self.resent = False

    @property
    def done(self) -> bool:
        return self.stats is not None or bool(self.error)

    def message(self, session: str):
        return P.Stats(session=session, req=self.req)

    def resolve(self, msg, incarnation: str) -> None:
        if isinstance(msg, P.StatsReply):
            self.stats = dict(msg.stats)
        else:
            self.finish("BAD_REPLY", f"unexpected {type(msg).__name__}")

    def finish(self, status: str, detail: str) -> None:
        if not self.done:
            self.error = f"{status}: {detail}"


Query = "HoldRequest | StatsRequest"
