"""The pool allocator and slot lifetimes (no NIXL): fragmentation, reuse, fences, quarantine."""

from __future__ import annotations

import random
import time

import pytest
import torch

from ec_nixl.arena import Arena
from ec_nixl.tensors import Ready
from ec_nixl.errors import ItemTooLarge, PoolExhausted
from ec_nixl.pool import Pool

BLOCK = 4096


@pytest.fixture
def pool(device):
    arena = Arena(64 * BLOCK, device)
    p = Pool(arena, BLOCK, reserved_blocks=1)
    yield p
    arena.close()


def test_dram_arena_is_huge_page_aligned():
    """The DRAM arena starts on a 2 MiB boundary, so the kernel can back it with huge pages
    (CMA transfers pin the peer's pages one by one: 4 KiB pages cost 2-3x the bandwidth)."""
    a = Arena(6 << 20, "cpu")
    try:
        assert a.base % (2 << 20) == 0 and a.bytes.numel() == 6 << 20
        a.bytes[-1] = 7  # the whole region is usable
        assert int(a.bytes[-1]) == 7
    finally:
        a.close()


def test_alignment_views_and_reserved_probe_area(pool):
    a = pool.allocate(1)
    b = pool.allocate(BLOCK + 1)
    assert a.block == 1, "block 0 is the reserved probe area"
    assert (a.nblocks, b.nblocks) == (1, 2)
    assert a.offset % BLOCK == 0 and b.offset % BLOCK == 0
    v = b.view((3, 5), torch.float32)
    assert v.data_ptr() == pool.arena.base + b.offset and v.shape == (3, 5)
    assert pool.stats().used == 3 * BLOCK


@pytest.mark.parametrize("shape,dtype", [((3, 5), torch.float32), ((1369, 7), torch.bfloat16), ((2, 3, 4), torch.int8),
                                         ((17,), torch.float64), ((1, 1), torch.float16)])
def test_slot_view_is_the_slots_bytes(pool, shape, dtype):
    """``Slot.view`` (one as_strided over a cached typed view of the arena) is exactly the slot's
    first bytes, contiguous, of that shape and dtype: same storage, same offset, same values."""
    pool.allocate(BLOCK)  # the slot under test does not start at the first usable block
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    s = pool.allocate(nbytes)
    raw = s.bytes()
    raw.copy_(torch.arange(raw.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    v = s.view(shape, dtype)
    assert tuple(v.shape) == shape and v.dtype == dtype and v.is_contiguous()
    assert v.data_ptr() == pool.arena.base + s.offset
    assert torch.equal(v.reshape(-1).view(torch.uint8), raw[:nbytes])
    with pytest.raises(ValueError, match="needs"):
        s.view((s.nblocks * BLOCK + 1,), torch.uint8)


def test_landing_views_are_reused_per_place_shape_and_dtype(pool, monkeypatch):
    """``Arena.landing_view`` builds a place's view once (a consumer's slots come back for items
    of the same shape), a different shape or dtype at that place gets its own view, every view
    shows the bytes there now, and the cache stays bounded."""
    import ec_nixl.arena as arena_mod

    a = pool.arena
    s = pool.allocate(2 * BLOCK)
    first = a.landing_view(s.offset, [16, 8], torch.float32)
    assert a.landing_view(s.offset, (16, 8), torch.float32) is first  # a list or a tuple: one key
    other_shape = a.landing_view(s.offset, (8, 16), torch.float32)
    other_dtype = a.landing_view(s.offset, (16, 16), torch.bfloat16)
    assert other_shape is not first and tuple(other_shape.shape) == (8, 16)
    assert other_dtype.dtype == torch.bfloat16 and other_dtype.data_ptr() == first.data_ptr()
    s.bytes()[: 16 * 8 * 4].copy_(torch.arange(16 * 8, dtype=torch.float32).view(torch.uint8))
    assert torch.equal(first.cpu().reshape(-1), torch.arange(16 * 8, dtype=torch.float32))
    assert torch.equal(a.landing_view(s.offset, (16, 8), torch.float32).cpu(), first.cpu())
    monkeypatch.setattr(arena_mod, "LANDING_VIEWS", 3)
    a.landing_view(s.offset + BLOCK, (4, 4), torch.float32)  # the 4th distinct view: cache dropped first
    assert len(a._landing) == 1 and a.landing_view(s.offset, (16, 8), torch.float32) is not first


def test_fragmentation_reuse_and_coalescing(pool):
    rng = random.Random(0)
    live = []
    for _ in range(2000):
        if live and (rng.random() < 0.5 or pool.stats().free < 8 * BLOCK):
            pool.release(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(pool.allocate(rng.randint(1, 6 * BLOCK)))
            except PoolExhausted:
                pool.release(live.pop(0))
        # no two live slots overlap
        spans = sorted((s.block, s.block + s.nblocks) for s in live)
        assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))
    for s in live:
        pool.release(s)
    st = pool.stats()
    assert st.used == 0 and st.slots == 0
    assert st.largest_free == pool.capacity, "free extents did not coalesce back into one"
    whole = pool.allocate(pool.capacity)
    assert whole.nblocks == 63


def test_no_reuse_while_held_or_fenced(pool):
    s = pool.allocate(10 * BLOCK)
    pool.hold(s)  # e.g. a transfer in flight
    pool.release(s)
    assert pool.stats().used == 10 * BLOCK, "freed while a hold remained"
    fence = Ready(False)  # e.g. a CUDA event after the gather kernel
    pool.release(s, fence)
    assert s.state == "deferred" and pool.stats().used == 10 * BLOCK
    others = [pool.allocate(BLOCK) for _ in range(5)]
    assert all(not (s.block <= o.block < s.block + s.nblocks) for o in others)
    pool.reclaim()
    assert s.state == "deferred"
    fence.set()
    assert pool.reclaim() == 1 and s.state == "free"
    for o in others:
        pool.release(o)
    assert pool.stats().used == 0


def test_quarantine_waits_for_time_and_check(pool):
    s = pool.allocate(BLOCK)
    dma_over = Ready(False)
    pool.quarantine(s, 0.05, check=dma_over.query, reason="timeout")
    assert pool.stats().quarantined == 1
    pool.reclaim()
    assert s.state == "quarantined"
    time.sleep(0.06)
    pool.reclaim()
    assert s.state == "quarantined", "freed while the DMA might still write"
    dma_over.set()
    pool.reclaim()
    assert s.state == "free" and pool.stats().used == 0


def test_too_large_and_exhausted_errors(pool):
    with pytest.raises(ItemTooLarge, match="holds only"):
        pool.allocate(pool.capacity + 1, tag="huge")
    keep = pool.allocate(pool.capacity - BLOCK)
    with pytest.raises(PoolExhausted, match="does not fit now") as e:
        pool.allocate(2 * BLOCK, tag="next")
    assert e.value.retryable
    evicted = []

    def evict(nbytes):
        pool.release(keep)
        evicted.append(nbytes)
        return 1

    got = pool.allocate(2 * BLOCK, evict=evict)
    assert evicted == [2 * BLOCK] and got.nblocks == 2
    assert pool.stats().evictions == 1


def test_try_allocate_many_gives_none_for_what_does_not_fit_now(pool):
    """The direct load path's batch allocation: side-by-side slots in order, None (not an error,
    not a partial slot) for an item too large now or ever; a None leaves the pool as it was."""
    fits = pool.capacity // BLOCK // 2 * BLOCK  # two of these do not fit beside a 2-block item
    a, b, c, d = pool.try_allocate_many([BLOCK + 1, fits, fits, pool.capacity + 1], ["a", "b", "c", "d"])
    assert (a.nblocks, a.tag, b.block) == (2, "a", a.block + 2) and b.nblocks == fits // BLOCK
    assert c is None and d is None
    assert pool.stats().used == (2 + fits // BLOCK) * BLOCK
    for s in (a, b):
        pool.release(s)
    assert pool.stats().used == 0


def test_try_allocate_many_keeps_a_step_back_to_back_past_a_hole(pool):
    """A step's slots come from one extent that holds them all, in order, even where first-fit per
    item would put the first ones in a hole and the rest elsewhere (NIXL then moves the step as
    one descriptor); each slot is still freed on its own, and the pool ends whole."""
    a = pool.allocate(2 * BLOCK, tag="a")
    b = pool.allocate(BLOCK, tag="b")
    pool.release(a)  # a 2-block hole at the start, the rest free after b
    x, y, z = pool.try_allocate_many([BLOCK, BLOCK, BLOCK // 2], ["x", "y", "z"])
    assert (y.block, z.block) == (x.block + 1, x.block + 2) and x.block == b.block + 1
    assert [s.tag for s in (x, y, z)] == ["x", "y", "z"] and pool.stats().allocations == 5
    assert pool.free_runs()[0] == 2  # the hole is untouched
    # No extent holds the whole step: slot by slot, first-fit (the hole is used).
    big = pool.capacity // BLOCK - 6
    p, q = pool.try_allocate_many([BLOCK, big * BLOCK], ["p", "q"])
    assert p.block == a.block and q is not None and q.block == z.block + 1
    for s in (b, x, z, y, p, q):
        pool.release(s)
    assert pool.stats().used == 0 and pool.free_runs() == [pool.capacity // BLOCK]


def test_try_allocate_waits_for_nothing_and_reports_the_free_runs(pool):
    """What a waiting publisher polls: a slot or None (never PoolExhausted, never an eviction),
    a deferred slot whose fence completed counts as free, an item that can never fit still
    raises ItemTooLarge; ``free_runs`` shows how the free space is split."""
    fence = Ready(False)
    a = pool.allocate(pool.capacity - 2 * BLOCK, tag="a")
    b = pool.allocate(BLOCK, tag="b")
    pool.release(b, fence)  # deferred behind the fence: not free yet
    assert pool.try_allocate(2 * BLOCK, "c") is None and pool.stats().failures == 0
    assert pool.free_runs() == [1]
    fence.set()
    c = pool.try_allocate(2 * BLOCK, "c")
    assert c is not None and c.nblocks == 2 and pool.stats().deferred == 0
    with pytest.raises(ItemTooLarge):
        pool.try_allocate(pool.capacity + 1, "huge")
    pool.release(a)
    assert pool.free_runs() == [pool.capacity // BLOCK - 2]
    pool.release(c)
    assert pool.free_runs() == [pool.capacity // BLOCK] and pool.stats().used == 0


def test_double_release_is_harmless(pool):
    s = pool.allocate(BLOCK)
    pool.release(s)
    pool.release(s)
    assert pool.stats().used == 0 and pool.stats().frees == 1


def test_arena_contains(pool, device):
    s = pool.allocate(BLOCK)
    assert pool.arena.contains(s.bytes())
    assert not pool.arena.contains(torch.zeros(4, device=device))
