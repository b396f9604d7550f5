"""What a consumer's scheduler knows of each producer, for deciding what a request waits for.

* its Holds, in the order sent: the oldest one still unanswered says whether the producer answers
  (``answering``); a silent one gets no early admissions, so no engine step waits on it;
* loads from it that failed in a worker (``distrust``): its requests are gated for a while;
* the workers' link probes: GB/s (``long``: a busy engine keeps a long transfer out of the step
  that would wait for it) and mode (``pushes``: over a WRITE link an item's place is not needed).
"""

from __future__ import annotations

import collections
import time

from ec_nixl.endpoint import Endpoint
from ec_nixl.queries import HoldRequest
from ec_nixl.states import LinkState

SILENT_S = 0.25
"""A producer with a Hold unanswered this long is not admitted early from: its requests wait for
their Holds (gated) until it answers again, so a stalled producer holds up no engine step."""
DISTRUST_S = 5.0
"""After a load from a producer failed in a worker, its requests are gated this long."""


class ProducerView:
    """Per producer address: Holds in flight, failures, link speed and mode (scheduler thread)."""

    def __init__(self, endpoint: Endpoint, readers: int, prefetch_defer_s: float):
        self.endpoint, self.readers, self.prefetch_defer_s = endpoint, readers, prefetch_defer_s
        self._asked: dict[str, collections.deque[HoldRequest]] = {}  # Holds to answer at once, as sent
        self._distrust: dict[str, float] = {}  # until when (monotonic) it gets no early admissions
        self.gbps: dict[str, float] = {}  # the workers' link probes
        self._mode: dict[str, str] = {}  # "read" | "write", the workers' links

    def hold(self, producer: str, hashes: list[str], timeout: float = 2.0, wait_s: float = 0.0) -> HoldRequest:
        """Send a Hold; one that must be answered at once is remembered for ``answering``."""
        hr = self.endpoint.hold_async(producer, hashes, self.readers, timeout=timeout, wait_s=wait_s)
        if not wait_s:
            self._asked.setdefault(producer, collections.deque()).append(hr)
        return hr

    def answering(self, producer: str, now: float) -> bool:
        """The producer's control link is up and it answers: no Hold to it (other than one that
        may wait at it for an item being encoded) has been out ``SILENT_S``, and no load from it
        failed in a worker within ``DISTRUST_S``."""
        if self._distrust.get(producer, 0.0) > now:
            return False
        link = self.endpoint.links.find(producer)
        if link is None or link.state is not LinkState.READY:
            return False
        asked = self._asked.get(producer)  # the oldest unanswered first
        while asked and asked[0].done:
            asked.popleft()
        return not asked or now - asked[0].t_asked <= SILENT_S

    def distrust(self, producer: str) -> None:
        """A load from ``producer`` failed in a worker."""
        self._distrust[producer] = time.monotonic() + DISTRUST_S

    def long(self, items) -> bool:
        """Whether moving ``items`` (``RemoteItem``s) takes ``prefetch_defer_s`` or more: their
        bytes over each producer link's bandwidth, as the workers' link probe measured it at
        handshake. An unmeasured link counts as fast: on the links we run (loopback, NVLink, RDMA)
        an item lands in micro- to milliseconds, while a deferred request waits a whole step of the
        batch (measured on the 2-core box, 2026-12-04: one step per request under load, ~5 ms of
        admission each). (The load times themselves do not tell the link's speed: a prefetch's
        completion is seen only at the worker's next poll.)"""
        seconds = 0.0
        for r in items:
            gbps = self.gbps.get(r.producer)
            if gbps:
                seconds += r.desc.nbytes / (gbps * 1e9)
        return bool(items) and (self.prefetch_defer_s <= 0 or seconds >= self.prefetch_defer_s)

    def pushes(self, producer: str) -> bool:
        """The workers' link to ``producer`` is a WRITE link: it pushes items, places unneeded."""
        return self._mode.get(producer) == "write"

    def learn(self, stats: dict) -> None:
        """The workers' link probes (producer address -> GB/s, and the mode each link chose)."""
        self.gbps.update(stats.get("link_gbps") or {})
        self._mode.update(stats.get("link_mode_at") or {})
