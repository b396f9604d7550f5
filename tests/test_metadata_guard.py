"""The NIXL metadata lock-out: a bad copy of an agent's metadata must not cost that agent anything.

NIXL (1.5.1) refuses an agent name for good once it failed to load metadata under it (even the
correct metadata, even after ``remove_remote_agent``), and a truncated copy of a *loaded* agent's
metadata unloads it. So a Hello carrying a truncated copy of a real consumer's metadata used to
lock that consumer out of the producer until the producer restarted. Now the handshake carries
the metadata's length and sha256 (checked before NIXL sees it), a loaded agent is never handed
other metadata, and every incarnation has its own NIXL agent name: a forger who recomputes the
digest costs the victim one restart, not the producer's lifetime.

Producers are real processes (``peers``), consumers real endpoints in this process; the hostile
Hellos are copies of the real consumer's own Hello, sent over a raw socket (``fakes``).
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from ec_nixl import handshake
from ec_nixl import protocol as P
from ec_nixl.tickets import ItemRef
from fakes import FakeAgent, FakeProducer, RawClient, pump
from helpers import SMALL, desc_of, fetch, refs_for, state, wait_until


def own_hello(cons) -> P.Hello:
    """The Hello consumer ``cons`` sends (its real metadata and arena), with a fresh nonce."""
    return handshake.hello(cons.me, P.new_nonce(), cons.transport.metadata, cons.transport.arena_info)


def truncated_copy(hello: P.Hello, cut: int = 20) -> P.Hello:
    """``hello`` with its metadata cut short, everything else kept (what a copy cut in transit, or
    a careless replay, looks like)."""
    bad = msgspec.structs.replace(hello, agent_md=hello.agent_md[:-cut], nonce=P.new_nonce())
    P.sign(bad, None)
    return bad


def forged(hello: P.Hello, cut: int = 20) -> P.Hello:
    """The same, by a deliberate forger: the metadata's declared length and digest recomputed."""
    md = hello.agent_md[:-cut]
    fields = getattr(P, "md_fields", lambda md: {})(md)
    bad = msgspec.structs.replace(hello, agent_md=md, nonce=P.new_nonce(), **fields)
    P.sign(bad, None)
    return bad


def sessions(prod) -> int:
    return prod.call("stats")["sessions"]


def test_truncated_copy_of_a_consumers_hello_does_not_lock_it_out(make_peer, make_consumer, device):
    """A Hello carrying a truncated copy of a real consumer's NIXL metadata (right compat hash,
    right name) reaches the producer before the consumer does. It is refused without a session,
    and the consumer then handshakes and loads byte-exact (before the fix: refused for good,
    ``NIXL_ERR_INVALID_PARAM``)."""
    prod = make_peer()
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    client = RawClient(prod.address)
    try:
        before = sessions(prod)
        reply = client.ask(truncated_copy(own_hello(cons)))
        assert isinstance(reply, P.Refused), reply
        assert sessions(prod) == before, "a refused Hello opened a session"
    finally:
        client.close()
    specs = [("after-truncated-hello", (32, 32), "float32", 7)]
    fetch(cons, refs_for(prod, prod.call("publish", specs)), specs, device)
    assert (reply.reason, reply.detail) == (
        "BAD_REQUEST", f"NIXL metadata of {len(cons.transport.metadata) - 20} B, the handshake declares "
                       f"{len(cons.transport.metadata)} B (cut short or corrupted)"), reply
    assert cons.pool.stats().used == 0


def test_forged_metadata_costs_one_incarnation_not_the_name(make_peer, make_consumer, device):
    """A forger who recomputes length and digest: against a consumer the producer has loaded, it
    is refused before NIXL (the live consumer's pushes still land); against one it has not, NIXL
    refuses that agent name for good, which now costs that incarnation only: the same consumer
    name restarted (a new process, a new agent name) is served. The producer keeps no NIXL peer
    for a refused Hello."""
    prod = make_peer()
    specs = [("first", (32, 32), "float32", 1), ("second", (32, 32), "float32", 2),
             ("third", (32, 32), "float32", 3)]
    descs = prod.call("publish", specs)
    live = make_consumer(name="victim", mode="write", pool_bytes=SMALL)
    fetch(live, refs_for(prod, descs[:1]), specs[:1], device)
    client = RawClient(prod.address)
    try:
        n = sessions(prod)
        reply = client.ask(forged(own_hello(live)))
        assert isinstance(reply, P.Refused) and reply.reason == "INCOMPAT", reply
        assert "already loaded with other metadata" in reply.detail, reply
        other = msgspec.structs.replace(forged(own_hello(live)), agent="someone-else")  # under another name
        P.sign(other, None)
        reply = client.ask(other)
        assert isinstance(reply, P.Refused) and reply.reason == "INCOMPAT", reply
        assert "announced as agent 'someone-else'" in reply.detail, reply
        assert sessions(prod) == n
        fetch(live, refs_for(prod, descs[1:2]), specs[1:2], device)  # the producer still WRITEs into it
        hello, old_agent = own_hello(live), live.transport.name
        live.close()
        assert wait_until(lambda: sessions(prod) == n - 1, 10), "the closed consumer's session stayed"
        reply = client.ask(forged(hello))  # its agent is unloaded now: NIXL takes the bad copy, and fails
        assert isinstance(reply, P.Refused) and reply.reason == "INCOMPAT", reply
        assert reply.detail.startswith("cannot add NIXL peer: NIXL_ERR_"), reply
        assert sessions(prod) == n - 1
    finally:
        client.close()
    restarted = make_consumer(name="victim", mode="write", pool_bytes=SMALL)
    fetch(restarted, refs_for(prod, descs[2:]), specs[2:], device)
    assert restarted.transport.name != old_agent and restarted.incarnation != hello.incarnation
    assert restarted.pool.stats().used == 0


def test_truncated_metadata_in_a_welcome_is_refused_before_nixl(make_consumer):
    """The other direction: a Welcome whose producer metadata was cut short fails the load
    naming the problem, and the consumer never hands NIXL that copy: the same producer agent,
    answering with its whole metadata, is then usable."""
    agent = FakeAgent()
    first = FakeProducer(lambda m: None, agent=agent,
                         welcome=lambda w: msgspec.structs.replace(w, agent_md=w.agent_md[:-20]))
    ok = desc_of("ok", (16, 16))
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    try:
        tickets = cons.load([ItemRef(desc=ok, producer=first.address)])
        assert pump(cons, first, lambda: tickets[0].done, 10)
        assert state(tickets[0]) == "failed", tickets[0]
        assert tickets[0].reason == "BAD_MESSAGE" and "cut short or corrupted" in tickets[0].error, tickets[0]
    finally:
        first.sock.close(0)
    second = FakeProducer(lambda m: P.Grant(req=m.req, items=[P.ItemState(
        mm_hash="ok", status="ready", block=3, nbytes=ok.nbytes, shape=ok.shape, dtype=ok.dtype)]), agent=agent)
    try:
        tickets = cons.load([ItemRef(desc=ok, producer=second.address)])
        assert pump(cons, second, lambda: tickets[0].done, 10)
        assert state(tickets[0]) == "landed", tickets[0]
        start = 3 * agent.block
        landed = tickets[0].tensor().view(torch.uint8).reshape(-1).cpu()
        assert torch.equal(landed, agent.buf[start:start + ok.nbytes])
        tickets[0].release()
    finally:
        second.close()


@pytest.mark.parametrize("field", ["md_len", "md_sha256", "agent"])
def test_hello_without_its_metadata_check_is_refused(make_peer, make_consumer, field):
    """A data Hello whose metadata length, digest or agent name is missing is refused naming it,
    before NIXL sees the metadata (so such a Hello cannot poison a name either)."""
    prod = make_peer()
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    blank = {"md_len": 0, "md_sha256": b"", "agent": ""}[field]
    bad = msgspec.structs.replace(own_hello(cons), **{field: blank})
    P.sign(bad, None)
    client = RawClient(prod.address)
    try:
        reply = client.ask(bad)
    finally:
        client.close()
    assert isinstance(reply, P.Refused) and reply.reason == "BAD_REQUEST", reply
    print(f"[no {field}] {reply.detail}")
    specs = [("fine", (8, 8), "float32", 4)]
    fetch(cons, refs_for(prod, prod.call("publish", specs)), specs)
