"""The proxy's cache-aware policy: send each request where its items' embeddings already are.

What it reads: each item's id (``items.with_content_ids``), the encoder-cache index the engines'
own events keep (``ec_nixl.events``: a PD's ``encoder_cache``, an encoder's ``encoder_cache``
and ``encoder_pool``), and how many requests the proxy has in flight at each backend. What it
decides (a ``Plan``):

* **the PD**: the one whose encoder cache holds the most of the request's items, ties to the
  least loaded; none holds any: the least loaded. When **all** of them are held there, the
  encoder is skipped: to vLLM the PD's request is a local encoder-cache hit.
* **the encoders**, for the items that PD does not hold: the least-loaded encoder that holds the
  item (it does not encode it again), else the least-loaded encoder (all such items of a request
  go to that one, in one call).
* **the balance guard**, SGLang's and vllm-router's ``cache_aware`` rule: the holder is passed
  over for the least-loaded instance when its load exceeds the least one's by more than
  ``balance_abs`` requests *and* by a factor of more than ``balance_rel``. A hot image then
  spreads: the instance it is sent to next holds it too.

The index may be stale (an item evicted between its event and the request): the request then
costs what it costs today (the PD encodes its media, the encoder encodes the item) and the
engine counts a misroute (``ec_nixl_route``). Loads are the proxy's own in-flight counts; ties
rotate, so an idle proxy still spreads new items over its instances.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from ec_nixl.events import schema as S
from ec_nixl.events.index import EventIndex

PD_MEDIUMS = (S.MEDIUM_CACHE,)
ENCODER_MEDIUMS = (S.MEDIUM_CACHE, S.MEDIUM_POOL)


@dataclass
class BalanceGuard:
    abs_threshold: int = 4
    """In-flight requests the holder may have beyond the least-loaded instance's."""
    rel_threshold: float = 1.5
    """...and the factor it may exceed it by; past both, the least-loaded instance is chosen."""

    def __post_init__(self) -> None:
        if self.abs_threshold < 0 or self.rel_threshold < 1:
            raise ValueError(f"balance thresholds: abs must be >= 0 and rel >= 1, got {self.abs_threshold}, "
                             f"{self.rel_threshold}")

    def tips(self, holder_load: int, least_load: int) -> bool:
        return holder_load - least_load > self.abs_threshold and holder_load > self.rel_threshold * least_load


class Loads:
    """Requests in flight per backend URL (the proxy's asyncio thread writes, anyone reads)."""

    def __init__(self) -> None:
        self._n: Counter = Counter()
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def inc(self, url: str) -> None:
        with self._lock:
            self._n[url] += 1

    def dec(self, url: str) -> None:
        with self._lock:
            self._n[url] -= 1

    def __getitem__(self, url: str) -> int:
        return self._n[url]

    def least(self, urls: list[str]) -> str:
        """The least-loaded of ``urls``; ties rotate (an idle proxy spreads too)."""
        low = min(self._n[u] for u in urls)
        ties = [u for u in urls if self._n[u] == low]
        return ties[next(self._turn) % len(ties)]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {u: n for u, n in self._n.items() if n}


@dataclass
class Plan:
    pd: str
    held_at_pd: list[int]
    """Positions of the items the PD's encoder cache holds."""
    encoders: dict[str, list[int]] = field(default_factory=dict)
    """Encoder URL -> positions of the items it is to provide."""
    held_at_encoder: dict[str, list[int]] = field(default_factory=dict)
    """Of those, the positions each encoder holds (it is told, to count a misroute)."""

    @property
    def skips_encoder(self) -> bool:
        return not self.encoders


class CacheAwareRouter:
    """Plans each request (see the module docstring); ``counters`` say what it decided."""

    def __init__(self, encoders: list[str], pds: list[str], index: EventIndex, guard: Optional[BalanceGuard] = None,
                 loads: Optional[Loads] = None):
        self.encoders, self.pds, self.index = list(encoders), list(pds), index
        self.guard = guard or BalanceGuard()
        self.loads = loads or Loads()
        self.counters: Counter = Counter()

    def _held(self, item_id: Optional[str], mediums: tuple[str, ...]) -> set[str]:
        if item_id is None:
            return set()
        return {h.instance.rstrip("/") for h in self.index.holders(item_id) if h.medium in mediums}

    def plan(self, ids: list[Optional[str]]) -> Plan:
        c = self.counters
        c["requests"] += 1
        c["items"] += len(ids)
        c["unknown_ids"] += sum(1 for i in ids if i is None)
        at_pd = {u: [] for u in self.pds}
        for pos, i in enumerate(ids):
            for u in self._held(i, PD_MEDIUMS) & at_pd.keys():
                at_pd[u].append(pos)
        least = self.loads.least(self.pds)
        most = max(len(v) for v in at_pd.values())
        pd = least
        if most:
            holder = self.loads.least([u for u in self.pds if len(at_pd[u]) == most])
            if self.guard.tips(self.loads[holder], self.loads[least]):
                c["pd_balance_overrides"] += 1
            else:
                pd = holder
        plan = Plan(pd, at_pd[pd])
        rest = [p for p in range(len(ids)) if p not in set(plan.held_at_pd)]
        c["items_held_at_pd"] += len(plan.held_at_pd)
        if not rest:
            c["pd_cache_routes"] += 1
            return plan
        least_e = self.loads.least(self.encoders)
        for pos in rest:
            holders = [u for u in self.encoders if u in self._held(ids[pos], ENCODER_MEDIUMS)]
            e = least_e
            if holders:
                holder = self.loads.least(holders)
                if self.guard.tips(self.loads[holder], self.loads[least_e]):
                    c["encoder_balance_overrides"] += 1
                else:
                    e = holder
                    plan.held_at_encoder.setdefault(e, []).append(pos)
                    c["items_to_holding_encoder"] += 1
            plan.encoders.setdefault(e, []).append(pos)
        c["items_to_encoders"] += len(rest)
        return plan
