"""ec-nixl's own paths: ``ours-read``, ``ours-write``, ``staged-write``, ``publish-landed``, and the
landed-barrier case.

``ours-read``     ``Endpoint.load()`` -> ``LoadBarrier.wait()`` returned; the consumer READs the
                  item from the producer's pool at the place a ``hold()`` gave (no grant round trip).
``ours-write``    the same on a write-mode link: the producer WRITEs into the consumer's slot.
``publish-landed`` the producer's ``publish_slot`` -> the consumer's barrier returned, with the
                  announcement and the Hold round trip in between (see ``PublishLanded``).
``expect-landed`` the same hand-off in the overlapped flow: the consumer's Hold is already waiting
                  at the producer when it publishes (see ``ExpectLanded``).
``expect-write``  the same on a write-mode link: the consumer's load (``wait_s``) is waiting at the
                  producer, which WRITEs into its slots at the publish (see ``ExpectWrite``).
``staged-write``  ECMooncakeConnector-style: ``publish()`` of a tensor outside the pool (a staging
                  copy into the registered pool, + synchronize), then the same WRITE; the sample is
                  the producer's stage time plus the consumer's load time (back to back).
Producer items of ``ours-*`` are written in place into ``reserve()``d slots (zero-copy publish).
A chunk's operations run back to back into distinct slots; their bytes are checked after the last
(as the raw-nixl paths do) and their slots go back before the next chunk, untimed.
Only the public API is used (``Endpoint``, ``ItemRef``, ``LoadBarrier``): this is what a user gets.
"""

from __future__ import annotations

import time

from ec_nixl.bench.memory import as_u8, check, probe, sync
from ec_nixl.bench.paths.base import Path


def held_refs(ep, addr: str, descs: list, hold: bool = True) -> list:
    """ItemRefs for ``descs``; with ``hold``, one Hold round trip gives their place (direct READ)."""
    from ec_nixl import ItemRef

    if not hold:
        return [ItemRef(desc=d, producer=addr) for d in descs]
    states = ep.hold(addr, [d.mm_hash for d in descs], timeout=30)
    now = time.time()
    refs = []
    for d in descs:
        s = states[d.mm_hash]
        if s.status != "ready":
            raise RuntimeError(f"hold of {d.mm_hash} at {addr}: {s.status} {s.detail}")
        refs.append(ItemRef(desc=d, producer=addr, block=s.block, valid_until=now + s.lease_s - 1))
    return refs


class OursRead(Path):
    name = "ours-read"
    ep_key, kind, hold, addr_key = "read", "ours", True, "address"

    def prepare(self, k: int) -> list:
        c = self.c
        groups = c.rpc("items", self.kind, self.tag, self.spec_tuple(), k, self.per_op)
        refs = held_refs(c.eps[self.ep_key], c.info[self.addr_key], [d for g in groups for d in g[0]], self.hold)
        out, i = [], 0
        for descs, probes, stage in groups:
            out.append((refs[i : i + len(descs)], probes, stage))
            i += len(descs)
        return out

    def samples(self, k: int) -> list[float]:
        """``k`` operations back to back, their bytes checked after the last (as raw-nixl does:
        a check per operation would put a device synchronization between every two)."""
        self.finish()  # last chunk's landed steps go back first (untimed): the chunk has the pool
        self.landed: list[tuple] = []
        times = [self.op(p) for p in self.prepare(k)]
        for refs, probes, out in self.landed:
            for r, p in zip(refs, probes):
                check(as_u8(out[r.mm_hash]), p, f"{self.name} {r.mm_hash}")
        return times

    def op(self, payload) -> float:
        refs, probes, stage = payload
        ep, barrier = self.c.eps[self.ep_key], self.c.barriers[self.ep_key]
        t0 = time.perf_counter()
        tickets = ep.load(refs)
        out = barrier.wait(tickets, timeout=60)
        dt = time.perf_counter() - t0
        self.end_step(ep, tickets, refs, probes, out)
        return dt + stage

    def end_step(self, ep, tickets, refs, probes, out) -> None:
        """Untimed: settle (read-done to the producer), keep the slots until the next chunk, and
        the bytes for the check after the chunk."""
        ep.progress()
        self.ring.append(tickets)
        self.landed.append((refs, probes, out))


class OursWrite(OursRead):
    name = "ours-write"
    ep_key, kind, hold = "write", "ours", False


class StagedWrite(OursRead):
    name = "staged-write"
    ep_key, kind, hold = "write", "staged", False


class PublishLanded(OursRead):
    """``publish-landed``: one step's whole hand-off, from the producer's ``publish_slot`` call to
    ``LoadBarrier.wait`` returned on the consumer: the announcement (the bench's pipe stands in for
    vLLM's encoder response -> proxy -> scheduler), the Hold round trip, the READ and the barrier.
    Timed on the clock both processes share (``perf_counter`` is CLOCK_MONOTONIC on Linux). The
    items were written into reserved slots beforehand, untimed: that is the encoder's work."""

    name = "publish-landed"
    ep_key = "read"

    def prepare(self, k: int) -> list:
        return self.c.rpc("stage_unpublished", self.tag, self.spec_tuple(), k, self.per_op)

    def op(self, payload) -> float:
        group, probes, _ = payload
        c = self.c
        ep, barrier = c.eps[self.ep_key], c.barriers[self.ep_key]
        t_publish, descs = c.rpc("publish_staged", group)
        refs = held_refs(ep, c.info["address"], descs)
        tickets = ep.load(refs)
        out = barrier.wait(tickets, timeout=60)
        t_landed = time.perf_counter()
        self.end_step(ep, tickets, refs, probes, out)
        return t_landed - t_publish


class ExpectLanded(PublishLanded):
    """``expect-landed``: publish -> landed when the consumer asked first (the proxy's overlapped
    flow: PD's Hold waits at E while E encodes). The Hold (``wait_s``) is sent, and seen parked
    by the producer, before the timed publish; the producer answers it from the publish, the
    consumer posts its READ from that answer, and the barrier returns. No announcement travels
    after the publish: this is the control path a request waits on in that flow. So the consumer
    knows what it expects (a PD computes an item's shape from the request) and reads the bench
    pipe's reply to the publish command only after its barrier returned (it says when publishing
    began, and the descriptions it is checked against)."""

    name = "expect-landed"

    def op(self, payload) -> float:
        from ec_nixl import ItemRef
        from ec_nixl.bench import proc

        group, probes, hashes = payload
        ep, addr, expected = self._expect(hashes)
        hold = ep.hold_async(addr, hashes, timeout=30, wait_s=10)
        proc.send(self.c.prod, "publish_when_parked", group, self.parked)
        if not ep.wait_for(lambda: hold.done, 30):
            raise RuntimeError(f"the waiting Hold of {hashes[0]} was not answered after the publish")
        refs, now = [], time.time()
        for d in expected:
            s = hold.states[d.mm_hash]
            if s.status != "ready":
                raise RuntimeError(f"waiting hold of {d.mm_hash}: {s.status} {s.detail}")
            refs.append(ItemRef(desc=d, producer=addr, block=s.block, valid_until=now + s.lease_s - 1,
                                incarnation=hold.incarnation))
        tickets = ep.load(refs)
        return self._landed(tickets, refs, probes, expected)

    def _expect(self, hashes: list[str]) -> tuple:
        """(endpoint, producer address, the descriptions the consumer expects of ``hashes``), and
        one more request counted as parked (the producer publishes once it saw it parked)."""
        from ec_nixl.protocol import ItemDesc

        nbytes, shape, dtype = self.spec_tuple()
        self.parked = getattr(self, "parked", 0) + 1
        return self.c.eps[self.ep_key], self.c.info["address"], [
            ItemDesc(mm_hash=h, shape=list(shape), dtype=dtype, nbytes=nbytes) for h in hashes]

    def _landed(self, tickets, refs, probes, expected) -> float:
        """The barrier, then the publish's reply (when it began; what it published)."""
        from ec_nixl.bench import proc

        c = self.c
        ep, barrier = c.eps[self.ep_key], c.barriers[self.ep_key]
        out = barrier.wait(tickets, timeout=60)
        t_landed = time.perf_counter()
        t_publish, descs = proc.reply(c.prod, "publish_when_parked", 60)
        if list(descs) != expected:
            raise RuntimeError(f"the producer published {descs[0]}, the consumer expected {expected[0]}")
        self.end_step(ep, tickets, refs, probes, out)
        return t_landed - t_publish


class ExpectWrite(ExpectLanded):
    """``expect-write``: publish -> landed when the consumer asked first, on a write-mode link:
    its ``load(wait_s=)`` sends a Push naming its slots, parked at the producer (seen parked
    before the timed publish), and the producer posts the WRITEs from the publish itself; the
    barrier returns on their notifications. No control message travels after the publish:
    issue 25's WRITE at publish, with the slot given per item ahead of it."""

    name = "expect-write"
    ep_key = "write"

    def op(self, payload) -> float:
        from ec_nixl import ItemRef
        from ec_nixl.bench import proc

        group, probes, hashes = payload
        ep, addr, expected = self._expect(hashes)
        refs = [ItemRef(desc=d, producer=addr) for d in expected]
        tickets = ep.load(refs, timeout=60, wait_s=10)
        proc.send(self.c.prod, "publish_when_parked", group, self.parked, "pushes_parked")
        return self._landed(tickets, refs, probes, expected)


# --- producer side: how the items of these paths come to be -------------------------------------


def _write_reserved(prod, tag: str, nbytes: int, n: int) -> list:
    """``n`` encoder outputs written straight into reserved slots: [(mm_hash, slot)] (no sync)."""
    slots = []
    for _ in range(n):
        h = prod.new_hash(tag)
        slot = prod.reserve(prod.ep, nbytes, h)
        slot.bytes()[:nbytes].copy_(prod.src_region(nbytes))
        slots.append((h, slot))
    return slots


def stage_in_place(prod, tag: str, nbytes: int, shape, tdt, per_op: int) -> tuple:
    """The encoder writes its output straight into a reserved slot (untimed: not the transfer)."""
    slots = _write_reserved(prod, tag, nbytes, per_op)
    sync(prod.device)
    descs = [prod.ep.publish_slot(h, slot, shape, tdt) for h, slot in slots]
    return descs, [probe(slot.bytes()[:nbytes]) for _, slot in slots], 0.0


def stage_copy(prod, tag: str, nbytes: int, shape, tdt, per_op: int) -> tuple:
    """The output lives outside the pool: ``publish()`` stages a copy (timed: the producer's cost)."""
    srcs = [(prod.new_hash(tag), prod.src_region(nbytes)) for _ in range(per_op)]
    t0 = time.perf_counter()
    descs = [prod.ep.publish(h, s.view(tdt).view(shape)) for h, s in srcs]
    sync(prod.device)
    dt = time.perf_counter() - t0
    return descs, [probe(s) for _, s in srcs], dt


def stage_unpublished(prod, tag: str, spec: tuple, n_ops: int, per_op: int) -> list:
    """publish-landed's items: written into reserved slots, kept unpublished until
    ``publish_staged``. Returns per operation (group id, head/tail probes)."""
    nbytes, shape, dtype = spec
    import torch

    out = []
    for _ in range(n_ops):
        slots = _write_reserved(prod, tag, nbytes, per_op)
        group = prod.new_hash(f"{tag}-group")
        prod.unpublished[group] = (slots, shape, getattr(torch, dtype))
        out.append((group, [probe(slot.bytes()[:nbytes]) for _, slot in slots], [h for h, _ in slots]))
    sync(prod.device)
    return out


def publish_when_parked(prod, group: str, parked: int, counter: str = "holds_parked",
                        timeout: float = 30.0) -> tuple[float, list]:
    """``publish_staged`` once this producer has parked ``parked`` waiting requests in all
    (``counter``: Holds, or Pushes; untimed)."""
    deadline = time.monotonic() + timeout
    while prod.ep.metrics.counters.get(counter, 0) < parked:  # (not stats(): it copies every sample)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no waiting request ({counter}) reached the producer in {timeout:.0f}s")
        time.sleep(0.0002)
    return publish_staged(prod, group)


def publish_staged(prod, group: str) -> tuple[float, list]:
    """Publish one staged group now: (the moment publishing began, its descriptions)."""
    slots, shape, tdt = prod.unpublished.pop(group)
    t0 = time.perf_counter()
    return t0, [prod.ep.publish_slot(h, slot, shape, tdt) for h, slot in slots]


# --- the barrier on items that already landed ----------------------------------------------------


def barrier_landed(c, spec, items: int, reps: int = 300) -> list[tuple]:
    """``LoadBarrier.wait`` on tickets that already landed (host time), for 1 and ``items`` items:
    the step-side cost once loads were prefetched. Returns (nbytes, items, samples) per row."""
    ep, barrier = c.eps["read"], c.barriers["read"]
    (descs, _, _), = c.rpc("items", "ours", "barrier", (spec.nbytes, spec.shape, spec.dtype), 1, items)
    tickets = ep.load(held_refs(ep, c.info["address"], descs))
    barrier.wait(tickets, timeout=60)
    rows = []
    try:
        for n in sorted({1, items}):
            sub = tickets[:n]
            ts = []
            for _ in range(reps + 10):
                t0 = time.perf_counter()
                out = barrier.wait(sub)
                ts.append(time.perf_counter() - t0)
            if len(out) != n:
                raise AssertionError(f"barrier returned {len(out)} items for {n} tickets")
            rows.append((spec.nbytes * n, n, ts[10:]))
    finally:
        for t in tickets:
            t.release()
    return rows
