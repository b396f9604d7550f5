"""The merged encoder-cache index: which instance holds which item, on which medium.

Fed by ``Subscriber`` (one *source* per publisher: its snapshot, then its batches), read by a
router from other threads: one lock guards it. A source's entries are replaced whole by a
snapshot and dropped whole when the source is declared gone, so a lost or restarted publisher
never leaves half a state behind. ``dump`` is the canonical form two indexes are compared by.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable

from ec_nixl.events import schema as S


@dataclass(frozen=True)
class Holder:
    instance: str
    medium: str
    nbytes: int
    modality: str


class EventIndex:
    """mm_hash -> holders, across every source."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, dict[tuple[str, str], S.EncoderItemStored]] = {}  # source -> (medium, hash) -> item
        self._instance: dict[str, str] = {}  # source -> instance
        self._by_hash: dict[str, dict[tuple[str, str], S.EncoderItemStored]] = {}  # hash -> (source, medium) -> item

    # ------------------------------------------------------------- writers (the subscriber)

    def replace(self, source: str, instance: str, entries: Iterable[S.EncoderItemStored]) -> None:
        """A snapshot: ``source``'s whole state is ``entries``."""
        with self._lock:
            self._drop(source)
            self._instance[source] = instance
            table = self._entries[source] = {}
            for ev in entries:
                self._store(source, table, ev)

    def apply(self, source: str, instance: str, events: Iterable[S.Event]) -> None:
        with self._lock:
            self._instance[source] = instance
            table = self._entries.setdefault(source, {})
            for ev in events:
                if isinstance(ev, S.EncoderItemStored):
                    self._store(source, table, ev)
                elif isinstance(ev, S.EncoderItemRemoved):
                    if table.pop((ev.medium, ev.mm_hash), None) is not None:
                        self._unlink(source, ev.medium, ev.mm_hash)
                else:  # EncoderItemsCleared
                    for key in [k for k in table if k[0] == ev.medium]:
                        del table[key]
                        self._unlink(source, key[0], key[1])

    def drop(self, source: str) -> int:
        """Forget everything ``source`` said (it is gone or restarted); returns how many entries."""
        with self._lock:
            return self._drop(source)

    def _store(self, source: str, table: dict, ev: S.EncoderItemStored) -> None:
        table[(ev.medium, ev.mm_hash)] = ev
        self._by_hash.setdefault(ev.mm_hash, {})[(source, ev.medium)] = ev

    def _unlink(self, source: str, medium: str, mm_hash: str) -> None:
        holders = self._by_hash.get(mm_hash)
        if holders is not None:
            holders.pop((source, medium), None)
            if not holders:
                del self._by_hash[mm_hash]

    def _drop(self, source: str) -> int:
        table = self._entries.pop(source, {})
        for medium, mm_hash in table:
            self._unlink(source, medium, mm_hash)
        self._instance.pop(source, None)
        return len(table)

    # ------------------------------------------------------------- readers (any thread)

    def holders(self, mm_hash: str) -> list[Holder]:
        with self._lock:
            found = self._by_hash.get(mm_hash)
            if not found:
                return []
            return [Holder(self._instance.get(src, ""), medium, ev.nbytes, ev.modality)
                    for (src, medium), ev in found.items()]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(t) for t in self._entries.values())

    def dump(self) -> dict[str, dict[str, list[str]]]:
        """{instance: {medium: sorted mm_hashes}}: the whole index, canonical (merged over sources)."""
        out: dict[str, dict[str, list[str]]] = {}
        with self._lock:
            for src, table in self._entries.items():
                per = out.setdefault(self._instance.get(src, src), {})
                for medium, mm_hash in table:
                    per.setdefault(medium, []).append(mm_hash)
        for per in out.values():
            for medium in per:
                per[medium].sort()
        return {inst: per for inst, per in sorted(out.items()) if any(per.values())}

    def entries(self) -> list[tuple[str, S.EncoderItemStored]]:
        """(instance, item) for every entry."""
        with self._lock:
            return [(self._instance.get(src, src), ev) for src, table in self._entries.items() for ev in table.values()]
