"""Micro-benchmarks of ec-nixl's hot pieces (pytest-benchmark), each beside a reference timed in the
same run: pool allocate/free, barrier pass on landed items, post of one prepped READ, handshake.

The producer endpoint runs in this process on its own I/O thread (NIXL accepts two agents in one
process and transfers between them: the loopback goes through the same UCX transports as two
processes on one host). The consumer is driven by the test thread (``threaded=False``).

Run: ``pytest bench/`` (``--benchmark-json PATH`` to keep the numbers). Speed is never asserted:
each test checks only the correctness of what it timed.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time

import pytest
import torch

from ec_nixl import Endpoint, EndpointConfig, ItemRef, LoadBarrier
from ec_nixl.arena import Arena
from ec_nixl.pool import Pool

BLOCK = 64 << 10
QWEN_BYTES = 1369 * 3584 * 2  # one 1024x1024 image on Qwen2.5-VL-7B, bf16
_names = itertools.count()


def _name(role: str) -> str:
    return f"micro-{role}-{os.getpid()}-{next(_names)}"


def median_s(fn, n: int = 200, warm: int = 20) -> float:
    """Median seconds of ``fn()`` over ``n`` calls (the reference timings)."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_median(benchmark):
    st = getattr(benchmark, "stats", None)
    return None if st is None else st.stats.median


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def item(seed: int, nbytes: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).to(device)


@pytest.fixture(scope="module")
def pair(device):
    """A producer endpoint (own I/O thread, listening) and a READ consumer driven by this thread."""
    prod = Endpoint(EndpointConfig(name=_name("prod"), device=device, pool_bytes=64 << 20, listen="127.0.0.1:0",
                                   threaded=True, announce_lease_s=600.0))
    cons = Endpoint(EndpointConfig(name=_name("cons"), device=device, pool_bytes=64 << 20, mode="read",
                                   threaded=False))
    try:
        yield prod, cons
    finally:
        cons.close()
        prod.close()


def publish(prod: Endpoint, n: int, nbytes: int, device: str, tag: str):
    tensors = {f"{tag}-{i}": item(i + 1, nbytes, device) for i in range(n)}
    descs = [prod.publish(h, t) for h, t in tensors.items()]
    sync(device)
    return descs, tensors


def held_refs(cons: Endpoint, prod: Endpoint, descs) -> list[ItemRef]:
    states = cons.hold(prod.address, [d.mm_hash for d in descs], timeout=10)
    now = time.time()
    for d in descs:
        assert states[d.mm_hash].status == "ready", states[d.mm_hash]
    return [ItemRef(desc=d, producer=prod.address, block=states[d.mm_hash].block,
                    valid_until=now + states[d.mm_hash].lease_s - 1) for d in descs]


# ------------------------------------------------------------------------------------------------


def test_pool_allocate_free(benchmark, ratio, device):
    """Allocate + free one 9.8 MB slot in a fragmented pool; reference: torch.empty of the same size."""
    arena = Arena(256 << 20, device)
    try:
        pool = Pool(arena, BLOCK, reserved_blocks=16)
        live = [pool.allocate((i % 7 + 1) * BLOCK, tag=f"f{i}") for i in range(64)]
        for s in live[::2]:
            pool.release(s)  # ~32 free extents: first-fit has to walk
        base = pool.stats().used

        def alloc_free():
            s = pool.allocate(QWEN_BYTES, tag="x")
            pool.release(s)
            return s

        s = benchmark(alloc_free)
        assert s.nblocks == -(-QWEN_BYTES // BLOCK) and s.offset % BLOCK == 0
        assert s.state == "free" and pool.stats().used == base
        ratio(bench_median(benchmark),
              lambda: median_s(lambda: torch.empty(QWEN_BYTES, dtype=torch.uint8, device=device)),
              f"torch.empty({QWEN_BYTES} B, {device})")
    finally:
        arena.close()


@pytest.mark.parametrize("n", [1, 32])
def test_barrier_pass_landed(benchmark, ratio, pair, device, n):
    """``LoadBarrier.wait`` on tickets that already landed; reference: a plain dict lookup per item."""
    prod, cons = pair
    descs, tensors = publish(prod, n, BLOCK, device, f"barrier{n}")
    tickets = cons.load(held_refs(cons, prod, descs))
    barrier = LoadBarrier(cons)
    barrier.wait(tickets, timeout=30)
    try:
        out = benchmark(barrier.wait, tickets)
        assert set(out) == set(tensors)
        for h, t in tensors.items():
            assert torch.equal(out[h].reshape(-1).view(torch.uint8), t)
        cache = {t.mm_hash: t.tensor() for t in tickets}
        hashes = [t.mm_hash for t in tickets]
        ratio(bench_median(benchmark), lambda: median_s(lambda: {h: cache[h] for h in hashes}),
              f"dict lookup of {n} item(s)")
    finally:
        for t in tickets:
            t.release()


@pytest.mark.parametrize("notif", [False, True], ids=["no-notif", "notif"])
def test_post_prepped_read(benchmark, ratio, pair, device, notif):
    """One prepped NIXL READ of one 64 KiB block (post -> DONE -> release), no control plane; with
    ``notif`` it carries a READ-done notification of the size ec-nixl sends (the endpoint always
    does). Reference: a 64 KiB bytearray copy (CPU) or device copy + synchronize (GPU)."""
    from ec_nixl import protocol as P

    prod, cons = pair
    msg = P.encode_notif(P.NOTIF_WRITE_DONE, "0" * 16, ["micro-" + "0" * 58], 0) if notif else b""
    descs, tensors = publish(prod, 1, BLOCK, device, f"post-{notif}")
    (ref_,) = held_refs(cons, prod, descs)
    peer = cons.transport.peers[prod.transport.name]
    slot = cons.reserve(BLOCK, tag="post-dst")
    tr = cons.transport

    def read_one():
        x = tr.post("READ", peer, slot.block, ref_.block, 1, msg)
        while tr.poll(x) == "PROC":
            pass
        state = x.state
        tr.release(x)
        return state

    try:
        slot.bytes().zero_()
        sync(device)
        state = benchmark(read_one)
        assert state == "DONE"
        assert torch.equal(slot.bytes()[:BLOCK], tensors[descs[0].mm_hash])
        if device == "cuda":
            a, b = tensors[descs[0].mm_hash], torch.empty(BLOCK, dtype=torch.uint8, device="cuda")

            def ref_fn():
                b.copy_(a)
                torch.cuda.synchronize()

            what = "64 KiB device copy + synchronize"
        else:
            src, dst = bytearray(os.urandom(BLOCK)), bytearray(BLOCK)
            mv_src, mv_dst = memoryview(src), memoryview(dst)

            def ref_fn():
                mv_dst[:] = mv_src

            what = "64 KiB bytearray copy"
        ratio(bench_median(benchmark), lambda: median_s(ref_fn, n=500), what)
    finally:
        cons.pool.release(slot)
        prod.unpublish(descs[0].mm_hash)


@pytest.fixture(scope="module")
def remote_producer(device):
    """A producer in its own process (no GIL shared with the timed consumer)."""
    from ec_nixl.bench.producer import ProducerProcess

    p = ProducerProcess(device=device, pool_bytes=64 << 20)
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("mode", ["read", "auto"])
def test_handshake(benchmark, ratio, remote_producer, device, mode):
    """A fresh consumer endpoint loads one tiny item from a producer process: Hello/Welcome, NIXL
    add_remote_agent (+ the link probes in 'auto' mode), a Get/Grant and the first READ or WRITE.
    Endpoint creation (NIXL agent, pool registration) is untimed (setup).
    Reference: the same load (Get/Grant + READ, or Push + WRITE) on the now warm link."""
    prod = remote_producer
    tiny = (4096, (2048,), "bfloat16")
    made: list[Endpoint] = []

    def new_item():
        ((desc,), (probe,), _), = prod.rpc("items", "ours", f"hs-{mode}", tiny, 1, 1)
        return ItemRef(desc=desc, producer=prod.address), probe

    def setup():
        while made:
            made.pop().close()
        ep = Endpoint(EndpointConfig(name=_name("hs"), device=device, pool_bytes=8 << 20, mode=mode,
                                     threaded=False))
        made.append(ep)
        ref, probe = new_item()
        return (ep, ref, probe), {}

    def load_one(ep, ref, probe):
        tickets = ep.load([ref])
        out = LoadBarrier(ep).wait(tickets, timeout=30)
        u8 = out[ref.mm_hash].reshape(-1).view(torch.uint8)
        got = (tuple(u8[:8].tolist()), tuple(u8[-8:].tolist()))
        for tk in tickets:
            tk.release()
        return ep, got == probe

    try:
        ep, ok = benchmark.pedantic(load_one, setup=setup, rounds=4, iterations=1)
        assert ok, "the first load returned wrong bytes"
        assert ep.stats()["peers"] == 1
        warm = []
        for i in range(15 if bench_median(benchmark) is not None else 1):
            ref, probe = new_item()
            t0 = time.perf_counter()
            _, ok = load_one(ep, ref, probe)
            warm.append(time.perf_counter() - t0)
            assert ok
        ratio(bench_median(benchmark), statistics.median(warm[3:] or warm), f"the same load on the warm link ({mode})")
    finally:
        while made:
            made.pop().close()
