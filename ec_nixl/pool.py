"""The registered pool: variable-size, block-aligned slots carved from one arena, with leases.

A slot is handed out with one *hold*. Whoever may still touch its bytes keeps a hold (the item
table, an in-flight NIXL transfer) or attaches a *fence* (a CUDA event recorded after the last
kernel that reads or writes it). A slot returns to the free list only when its holds reach zero
and every fence has completed, so a slot is never reused while a DMA or a kernel may still touch
it. A slot whose DMA could not be confirmed finished (a timed-out or failed transfer) goes to
*quarantine* instead, and stays unusable until a deadline has passed and its owner says the DMA
is over.

This module owns the allocator and slot lifetimes; it never talks to NIXL and never decides
*when* an item is done with (the endpoint does).
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from ec_nixl.arena import Arena
from ec_nixl.errors import ItemTooLarge, PoolExhausted
from ec_nixl.states import SLOT_NEXT, SlotState, advance

_LIVE, _FREE = SlotState.LIVE, SlotState.FREE  # bound once: an Enum member lookup costs ~0.1 us per slot


class Fence(Protocol):
    """Anything that can say whether the work it guards has finished (e.g. ``torch.cuda.Event``)."""

    def query(self) -> bool: ...


@dataclass
class PoolStats:
    capacity: int
    used: int
    free: int
    largest_free: int
    slots: int
    deferred: int
    quarantined: int
    high_water: int
    allocations: int
    frees: int
    failures: int
    evictions: int

    @property
    def occupancy(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


class Slot:
    """A block-aligned region of the pool. ``offset``/``nbytes`` in bytes, ``block`` in blocks."""

    __slots__ = ("id", "block", "nblocks", "nbytes", "pool", "holds", "fences", "state", "tag")

    def __init__(self, sid: int, block: int, nblocks: int, nbytes: int, pool: "Pool", tag: str):
        self.id = sid
        self.block = block
        self.nblocks = nblocks
        self.nbytes = nbytes
        self.pool = pool
        self.holds = 1
        self.fences: list[Fence] = []
        self.state = _LIVE
        self.tag = tag

    @property
    def offset(self) -> int:
        return self.block * self.pool.block_size

    def bytes(self) -> torch.Tensor:
        return self.pool.arena.view(self.offset, self.nbytes)

    def view(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """The slot's first bytes as a tensor of ``shape``/``dtype`` (no copy)."""
        n = torch.Size(shape).numel() * dtype.itemsize
        if n > self.nblocks * self.pool.block_size:
            raise ValueError(f"{tuple(shape)} {dtype} needs {n} B; {self!r} has {self.nblocks * self.pool.block_size}")
        return self.pool.arena.typed_view(self.offset, shape, dtype)

    def __repr__(self) -> str:
        return f"Slot(id={self.id}, block={self.block}, nblocks={self.nblocks}, {self.state}, holds={self.holds}, {self.tag!r})"


class Pool:
    """First-fit allocator over ``arena`` in units of ``block_size`` bytes; thread-safe.

    ``reserved_blocks`` at the start of the arena are never handed out (link probes use them).
    """

    def __init__(self, arena: Arena, block_size: int = 64 << 10, reserved_blocks: int = 0):
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"block size must be a power of two, got {block_size}")
        self.arena = arena
        self.block_size = block_size
        self.nblocks = arena.size // block_size
        if self.nblocks <= reserved_blocks:
            raise ValueError(
                f"pool of {arena.size} B holds {self.nblocks} blocks of {block_size} B, "
                f"not more than the {reserved_blocks} reserved"
            )
        self.reserved_blocks = reserved_blocks
        self._lock = threading.Lock()
        # Free extents as parallel sorted lists: starts[i] .. starts[i] + lens[i].
        self._starts: list[int] = [reserved_blocks]
        self._lens: list[int] = [self.nblocks - reserved_blocks]
        self._live: dict[int, Slot] = {}
        self._deferred: list[Slot] = []
        self._quarantine: list[tuple[Slot, float, Optional[Callable[[], bool]], str]] = []
        self._next_id = 1
        self._used_blocks = 0
        self._high_water = 0
        self._allocs = self._frees = self._failures = self._evictions = 0

    @property
    def capacity(self) -> int:
        return (self.nblocks - self.reserved_blocks) * self.block_size

    def blocks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.block_size))

    # --- allocation ---------------------------------------------------------------------

    def allocate(self, nbytes: int, tag: str = "", evict: Optional[Callable[[int], int]] = None) -> Slot:
        """A slot of at least ``nbytes`` with one hold.

        Raises ItemTooLarge when the item can never fit, PoolExhausted when it does not fit now.
        Before giving up, deferred frees are reclaimed and then ``evict(nbytes)`` is asked to
        drop unneeded cached items (it returns how many it dropped).
        """
        n = self._blocks_that_fit(nbytes, tag)
        for attempt in range(3):
            with self._lock:
                slot = self._take(n, nbytes, tag)
                if slot is not None:
                    return slot
            if attempt == 0:
                self.reclaim()
            elif attempt == 1 and evict is not None:
                dropped = evict(nbytes)
                self.reclaim()
                with self._lock:
                    self._evictions += dropped
        with self._lock:
            self._failures += 1
            free, largest = self._free_blocks(), max(self._lens, default=0)
        raise PoolExhausted(
            f"item {tag!r} of {nbytes} B ({n} blocks) does not fit now: {free * self.block_size} B free, "
            f"largest free run {largest * self.block_size} B, {len(self._deferred)} deferred, "
            f"{len(self._quarantine)} quarantined"
        )

    def _blocks_that_fit(self, nbytes: int, tag: str) -> int:
        """Blocks for ``nbytes``; ItemTooLarge when even an empty pool could not hold them."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        n = self.blocks_for(nbytes)
        if n > self.nblocks - self.reserved_blocks:
            with self._lock:
                self._failures += 1
            raise ItemTooLarge(
                f"item {tag!r} of {nbytes} B needs {n} blocks of {self.block_size} B; the pool "
                f"holds only {self.capacity} B in all (raise the pool size)"
            )
        return n

    def try_allocate(self, nbytes: int, tag: str = "") -> Optional[Slot]:
        """``allocate`` without eviction: a slot, or None when it does not fit now (after
        reclaiming deferred and quarantined slots); ItemTooLarge when it never can. For callers
        that wait for space (``Published``)."""
        n = self._blocks_that_fit(nbytes, tag)
        with self._lock:
            slot = self._take(n, nbytes, tag)
            retry = slot is None and bool(self._deferred or self._quarantine)
        if retry and self.reclaim():
            with self._lock:
                slot = self._take(n, nbytes, tag)
        return slot

    def free_runs(self) -> list[int]:
        """The lengths (in blocks) of the free extents, in address order."""
        with self._lock:
            return list(self._lens)

    def try_allocate_many(self, sizes: list[int], tags: list[str]) -> list[Optional[Slot]]:
        """``allocate`` for a step's items under one lock: a slot each, or None for an item that
        does not fit now. Reclaims nothing and evicts nothing: the caller's general path retries
        a None with ``allocate``, which does (and names the reason when it still fails).

        The slots are carved back to back, in order, from one free extent where one holds them
        all: a step's items published together (producer) and loaded together (consumer) then
        lie contiguous on both sides, and NIXL moves the whole step as ONE descriptor (it
        merges consecutive blocks of one prepped row; a descriptor per item cost the H200 1.5x,
        bench/probes/step_floor.py). Each slot is still freed on its own."""
        bs = self.block_size
        ns = [-(-nbytes // bs) if nbytes > 0 else 0 for nbytes in sizes]
        with self._lock:
            run = self._take_run(ns, sizes, tags) if len(ns) > 1 else None
            if run is not None:
                return run
            return [self._take(n, nbytes, tag) if n else None for n, nbytes, tag in zip(ns, sizes, tags)]

    def try_reserve_run(self, nblocks: int) -> Optional[int]:
        """``nblocks`` back to back from the first free extent that holds them, with no slots cut
        yet: the first block, or None (reclaims nothing; the caller's general path does). For a
        step whose READ is posted before any per-item bookkeeping (``ReadLane.post_step``): the
        run is made into slots by ``slots_in_run`` while the DMA runs, and must be."""
        with self._lock:
            return self._cut(nblocks)

    def slots_in_run(self, at: int, ns: list[int], sizes: list[int], tags: list[str]) -> list[Slot]:
        """The slots of a run ``try_reserve_run`` gave from block ``at``: ``ns[i]`` blocks each,
        back to back, covering the run exactly; each is freed on its own."""
        out = []
        with self._lock:
            for n, nbytes, tag in zip(ns, sizes, tags):
                out.append(self._new_slot(at, n, nbytes, tag))
                at += n
        return out

    def _take_run(self, ns: list[int], sizes: list[int], tags: list[str]) -> Optional[list[Optional[Slot]]]:
        """Slots of ``ns`` blocks back to back from the first extent that holds them all (None
        where n is 0), or None when no extent does. Lock held."""
        at = self._cut(sum(ns))
        if at is None:
            return None
        out: list[Optional[Slot]] = []
        for n, nbytes, tag in zip(ns, sizes, tags):
            out.append(self._new_slot(at, n, nbytes, tag) if n else None)
            at += n
        return out

    def _take(self, n: int, nbytes: int, tag: str) -> Optional[Slot]:
        at = self._cut(n)
        return None if at is None else self._new_slot(at, n, nbytes, tag)

    def _cut(self, n: int) -> Optional[int]:
        """The first block of ``n`` taken from the first free extent that holds them (first-fit),
        or None. Lock held."""
        for i, length in enumerate(self._lens):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += n
                    self._lens[i] -= n
                self._used_blocks += n
                if self._used_blocks > self._high_water:
                    self._high_water = self._used_blocks
                return start
        return None

    def _new_slot(self, block: int, n: int, nbytes: int, tag: str) -> Slot:
        slot = Slot(self._next_id, block, n, nbytes, self, tag)
        self._next_id += 1
        self._live[slot.id] = slot
        self._allocs += 1
        return slot

    def slot_at(self, ptr: int) -> Optional[Slot]:
        """The live slot whose bytes start exactly at device/host address ``ptr``, if any."""
        off = ptr - self.arena.base
        if off < 0 or off % self.block_size:
            return None
        with self._lock:
            for slot in self._live.values():
                if slot.block * self.block_size == off and slot.state is _LIVE:
                    return slot
        return None

    def _free_blocks(self) -> int:
        return sum(self._lens)

    def _give_back(self, slot: Slot) -> None:
        """Return a slot's blocks to the free list, merging neighbours. Lock held."""
        slot.state = advance(slot.state, _FREE, SLOT_NEXT)
        self._live.pop(slot.id, None)
        self._used_blocks -= slot.nblocks
        self._frees += 1
        start, n = slot.block, slot.nblocks
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == start:
            i -= 1
            self._lens[i] += n
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, n)
        if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:
            self._lens[i] += self._lens[i + 1]
            del self._starts[i + 1], self._lens[i + 1]

    # --- leases -------------------------------------------------------------------------

    def hold(self, slot: Slot) -> None:
        with self._lock:
            if slot.state is not _LIVE:
                raise RuntimeError(f"cannot hold {slot!r}: it is {slot.state}")
            slot.holds += 1

    def add_fence(self, slot: Slot, fence: Fence) -> None:
        """The slot must not be reused before ``fence`` completes (e.g. a reading kernel)."""
        with self._lock:
            slot.fences.append(fence)

    def release(self, slot: Slot, fence: Optional[Fence] = None) -> None:
        """Drop one hold; the slot is freed once no hold and no pending fence remains."""
        with self._lock:
            if slot.state is not _LIVE:
                return  # released twice (e.g. cancel racing completion): harmless
            if fence is not None:
                slot.fences.append(fence)
            slot.holds -= 1
            if slot.holds > 0:
                return
            slot.fences = [f for f in slot.fences if not f.query()]
            if slot.fences:
                slot.state = advance(slot.state, SlotState.DEFERRED, SLOT_NEXT)
                self._deferred.append(slot)
            else:
                self._give_back(slot)

    def quarantine(
        self, slot: Slot, seconds: float, check: Optional[Callable[[], bool]] = None, reason: str = ""
    ) -> None:
        """Keep ``slot`` out of use for ``seconds`` and until ``check()`` says its DMA is over.

        All holds are dropped: the quarantine owns the slot from now on.
        """
        with self._lock:
            if slot.state is not _LIVE:
                return
            slot.state = advance(slot.state, SlotState.QUARANTINED, SLOT_NEXT)
            slot.holds = 0
            self._quarantine.append((slot, time.monotonic() + seconds, check, reason))

    def reclaim(self) -> int:
        """Free deferred slots whose fences completed and quarantined ones now safe."""
        freed = 0
        now = time.monotonic()
        with self._lock:
            if self._deferred:
                keep = []
                for slot in self._deferred:
                    slot.fences = [f for f in slot.fences if not f.query()]
                    if slot.fences:
                        keep.append(slot)
                    else:
                        self._give_back(slot)
                        freed += 1
                self._deferred = keep
            if self._quarantine:
                keep_q = []
                for entry in self._quarantine:
                    slot, until, check, _ = entry
                    if now >= until and (check is None or check()):
                        self._give_back(slot)
                        freed += 1
                    else:
                        keep_q.append(entry)
                self._quarantine = keep_q
        return freed

    def stats(self) -> PoolStats:
        with self._lock:
            used = self._used_blocks * self.block_size
            return PoolStats(
                capacity=self.capacity,
                used=used,
                free=self.capacity - used,
                largest_free=max(self._lens, default=0) * self.block_size,
                slots=len(self._live),  # every slot not yet free, whatever its state
                deferred=len(self._deferred),
                quarantined=len(self._quarantine),
                high_water=self._high_water * self.block_size,
                allocations=self._allocs,
                frees=self._frees,
                failures=self._failures,
                evictions=self._evictions,
            )
