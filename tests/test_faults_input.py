"""Bad input from peers: malformed or random requests, lying grants and welcomes, malformed
replies, incompatible peers, items too large. Each gets a clear, exact answer or error naming
the problem, within bounded time; nothing leaks and the same peers keep serving others.

Hostile peers are fakes speaking the real wire protocol (``fakes``: FAULT INJECTION); the
producers they are compared with are real processes (``peers``) moving real bytes over NIXL.
"""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import torch

from ec_nixl import protocol as P
from ec_nixl.barrier import LoadBarrier
from ec_nixl.errors import LoadFailed, ProtocolError
from ec_nixl.tickets import ItemRef
from fakes import DEFAULT_COMPAT, FakeAgent, FakeProducer, RawClient, pump, raw_hello
from helpers import MODES, SMALL, check, desc_of, fetch, refs_for, state, timing


# --------------------------------------------------------------------------------------------
# requests a producer cannot take: exact refusals


def expected_reply(data: bytes, compat: str, welcomed: dict) -> tuple:
    """What a producer without a token, whose compat hash is ``compat``, must answer ``data``
    sent by one client: ("welcome", session or None) or ("refused", reason, detail, req).

    The producer's rules, in its order: decode; a Hello resent with a nonce that already got a
    Welcome (``welcomed``: nonce -> session) gets the same Welcome; then version, then compat
    hash (an observer Hello, with no hash and no NIXL agent, needs none); any other message must
    name a session of this connection.
    """
    try:
        msg = P.decode(data)
    except ProtocolError as e:
        return ("refused", "BAD_REQUEST", str(e), 0)
    if isinstance(msg, P.Hello):
        if msg.nonce in welcomed:
            return ("welcome", welcomed[msg.nonce])
        if msg.version != P.PROTOCOL_VERSION:
            return ("refused", "VERSION", f"protocol {msg.version} != {P.PROTOCOL_VERSION}", 0)
        observer = msg.compat == "" and msg.agent_md is None
        if msg.compat != compat and not observer:
            return ("refused", "INCOMPAT", f"compat hash {msg.compat} != {compat} (model/dtype/width/block differ)", 0)
        assert observer, f"generated a data Hello with the right compat hash; extend this oracle: {msg}"
        return ("welcome", None)
    req = getattr(msg, "req", 0)
    if getattr(msg, "session", None) is None:
        return ("refused", "BAD_REQUEST", f"{type(msg).__name__} is not a request", req)
    return ("refused", "UNKNOWN_SESSION", "no handshake for this session", req)


def ask_exactly(client: RawClient, data: bytes, compat: str, welcomed: dict) -> str:
    """Send ``data``; assert the reply is exactly ``expected_reply``; returns 'welcome' or the reason."""
    want = expected_reply(data, compat, welcomed)
    reply = client.ask(data)
    if want[0] == "welcome":
        assert isinstance(reply, P.Welcome) and reply.compat == compat, (data[:80], reply)
        if want[1] is not None:
            assert reply.session == want[1], "a resent Hello must get the same session"
        welcomed[P.decode(data).nonce] = reply.session
        return "welcome"
    assert isinstance(reply, P.Refused), (data[:80], reply)
    assert (reply.reason, reply.detail, reply.req) == want[1:], (data[:80], reply)
    return want[1]


def test_malformed_requests_get_exact_refusals_and_server_keeps_serving(make_peer, make_consumer, device):
    """No message, garbage, messages that are no request, and requests on sessions nobody opened:
    each gets a Refused with its exact reason and detail; a real consumer is then served."""
    prod = make_peer()
    client = RawClient(prod.address)
    try:
        cases = {
            b"": "BAD_REQUEST",
            b"\xff\xfe garbage": "BAD_REQUEST",
            P.encode(P.Grant(req=3, items=[])): "BAD_REQUEST",  # a reply, not a request
            P.encode(P.Heartbeat(session="nope")): "UNKNOWN_SESSION",
            P.encode(P.Get(session="forged", req=1, mm_hashes=["x"])): "UNKNOWN_SESSION",
            P.encode(raw_hello(version=99)): "VERSION",
        }
        for data, reason in cases.items():
            assert ask_exactly(client, data, DEFAULT_COMPAT, {}) == reason, data
    finally:
        client.close()
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    specs = [("fine", (16, 16), "bfloat16", 5)]
    fetch(cons, refs_for(prod, prod.call("publish", specs)), specs, device)


def _structured():
    from hypothesis import strategies as st

    keys = st.sampled_from(["type", "session", "req", "mm_hashes", "items", "readers", "reader", "version", "compat",
                            "name", "incarnation", "nonce", "agent_md", "arena", "group", "mac", "block",
                            "nbytes", "mm_hash", "base", "size", "mem_type", "device", "status", "shape"])
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                        st.text(max_size=12), st.binary(max_size=24),
                        st.sampled_from(["hello", "get", "hold", "push", "cancel", "stats", "heartbeat", "bye",
                                         "welcome", "grant", "refused", "push_failed", "cancel_ack", "DRAM", ""]))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(keys, inner, max_size=4)), max_leaves=12)
    return st.dictionaries(keys, values, max_size=10)


def _hellos():
    """Well-formed Hellos with random contents: versions and hashes that match or not, an agent
    or none (an observer brings neither hash nor agent), nonces that repeat (resends)."""
    from hypothesis import strategies as st

    text, num = st.text(max_size=12), st.integers(0, 2**32)
    arena = st.builds(P.ArenaInfo, base=num, size=num, block=num, mem_type=st.sampled_from(["DRAM", "VRAM"]),
                      device=st.integers(0, 8))
    return st.builds(P.Hello, version=st.sampled_from([P.PROTOCOL_VERSION, 0, P.PROTOCOL_VERSION + 1]),
                     compat=st.sampled_from(["", "0" * 32, DEFAULT_COMPAT[:-1]]), name=text, incarnation=text,
                     nonce=st.binary(max_size=4), agent_md=st.none() | st.binary(max_size=24),
                     arena=st.none() | arena, group=text)


def _requests_and_replies():
    """Every other message type, well-formed, with random contents (sessions nobody opened)."""
    from hypothesis import strategies as st

    text, num, blob = st.text(max_size=12), st.integers(0, 2**32), st.binary(max_size=24)
    hashes = st.lists(text, max_size=3)
    item = st.builds(P.ItemState, mm_hash=text, status=text, detail=text, block=num)
    return st.one_of(
        st.builds(P.Hold, session=text, req=num, mm_hashes=hashes, readers=num),
        st.builds(P.Get, session=text, req=num, mm_hashes=hashes, reader=num, readers=num),
        st.builds(P.Push, session=text, req=num, items=st.lists(st.builds(P.PushItem, mm_hash=text, block=num,
                                                                          nbytes=num), max_size=3)),
        st.builds(P.Cancel, session=text, req=num, mm_hashes=hashes),
        st.builds(P.Stats, session=text, req=num),
        st.builds(P.Heartbeat, session=text),
        st.builds(P.Bye, session=text),
        st.builds(P.Welcome, version=num, compat=text, name=text, incarnation=text, session=text, nonce=blob),
        st.builds(P.Refused, reason=text, detail=text, req=num),
        st.builds(P.Grant, req=num, items=st.lists(item, max_size=3)),
        st.builds(P.PushFailed, req=num, items=st.lists(item, max_size=3)),
        st.builds(P.CancelAck, req=num, safe=hashes, in_flight=hashes),
        st.builds(P.StatsReply, req=num),
    )


def test_fuzz_side_channel_every_reply_is_exact(make_peer, make_consumer, device):
    """Random bytes, random msgpack maps (with real tags and field names) and well-formed messages
    of every type with random contents, over a raw DEALER: each gets exactly one answer, the one ``expected_reply`` names (reason, detail and req of a
    Refused; the Welcome a well-formed observer Hello is entitled to). Then hand-made hostile
    data Hellos with the right compat hash (garbage, cut short or mismatched NIXL metadata) are
    refused naming the cause (BAD_REQUEST before NIXL sees metadata that does not match its
    declared length and digest, INCOMPAT for what NIXL or the arena check refuses), and the
    producer still serves a real consumer."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    prod = make_peer()
    client = RawClient(prod.address)
    welcomed: dict = {}
    counts: dict = {}

    def one(data: bytes) -> None:
        got = ask_exactly(client, data, DEFAULT_COMPAT, welcomed)
        counts[got] = counts.get(got, 0) + 1

    fuzz = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    given(st.binary(max_size=256))(fuzz(one))()
    given(_structured())(fuzz(lambda d: one(msgspec.msgpack.encode(d))))()
    given(_hellos())(fuzz(lambda m: one(P.encode(m))))()
    given(_requests_and_replies())(fuzz(lambda m: one(P.encode(m))))()
    print(f"[fuzz] {counts}")
    assert set(counts) == {"BAD_REQUEST", "UNKNOWN_SESSION", "VERSION", "INCOMPAT", "welcome"}, \
        f"the fuzz no longer reaches every kind of answer: {counts}"
    # Each hostile Hello names a fresh agent: NIXL keeps refusing a name whose metadata it once
    # failed to load (even the correct metadata, later), so the cases must not share one.
    def cut(a):
        return dict(agent_md=a.md[:-20], arena=a.arena, agent=a.name)

    hellos = {
        "garbage md": (lambda a: dict(agent_md=os.urandom(300), arena=a.arena), "INCOMPAT",
                       "cannot add NIXL peer: peer NIXL metadata names no agent (not NIXL metadata)"),
        "truncated md": (lambda a: {**cut(a), **P.md_fields(a.md)}, "BAD_REQUEST",
                         lambda a: f"NIXL metadata of {len(a.md) - 20} B, the handshake declares {len(a.md)} B"),
        "truncated md, digest of the copy": (cut, "INCOMPAT", "cannot add NIXL peer: NIXL_ERR_"),
        "another agent's md": (lambda a: dict(agent_md=a.md, arena=a.arena), "INCOMPAT",
                               "cannot add NIXL peer: NIXL metadata of agent 'fake-"),
        "arena past registration": (lambda a: dict(agent_md=a.md, agent=a.name, arena=msgspec.structs.replace(
            a.arena, size=a.arena.size * 4)), "INCOMPAT", "cannot add NIXL peer: NIXL_ERR_NOT_FOUND"),
        "block size": (lambda a: dict(agent_md=a.md, agent=a.name, arena=msgspec.structs.replace(a.arena, block=4096)),
                       "INCOMPAT", "cannot add NIXL peer: peer block size 4096 != local 65536"),
    }
    try:
        for what, (fields, reason, detail) in hellos.items():
            agent = FakeAgent()
            try:
                reply = client.ask(raw_hello(name=f"evil-{what}", **fields(agent)))
            finally:
                agent.close()
            print(f"[hostile hello] {what}: {reply}")
            assert isinstance(reply, P.Refused) and reply.reason == reason, (what, reply)
            assert reply.detail.startswith(detail(agent) if callable(detail) else detail), (what, reply.detail)
    finally:
        client.close()
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    specs = [("after-fuzz", (16, 16), "bfloat16", 5)]
    fetch(cons, refs_for(prod, prod.call("publish", specs)), specs, device)
    assert prod.proc.is_alive()


# --------------------------------------------------------------------------------------------
# producers that lie or babble


def test_hostile_grants_fail_their_item_with_a_reason(make_consumer, make_peer, device):
    """A fake producer answers every Get with a different lie. Each item fails with a message
    naming the problem; a well-formed grant from the same fake lands with the fake's bytes; the
    consumer then serves a real producer normally."""
    fake_nblocks = 64  # FakeAgent: 4 MiB in 64 KiB blocks
    ok = desc_of("ok", (16, 16))

    def answer(d, **kw):
        base = dict(mm_hash=d.mm_hash, status="ready", block=fake_nblocks - 1, nbytes=d.nbytes, shape=d.shape,
                    dtype=d.dtype, lease_s=10.0)
        base.update(kw)
        return P.ItemState(**base)

    lies = {
        "past-end": (lambda d: answer(d, block=fake_nblocks), "outside the producer arena"),
        "negative": (lambda d: answer(d, block=-5), "outside the producer arena"),
        "huge-block": (lambda d: answer(d, block=2**63 - 1), "outside the producer arena"),
        "u64-block": (lambda d: answer(d, block=2**64 - 1), "outside the producer arena"),
        "shape": (lambda d: answer(d, shape=[1, 1]), "announced"),
        "dtype": (lambda d: answer(d, dtype="float16"), "announced"),
        "huge-nbytes": (lambda d: answer(d, nbytes=2**62), "announced"),
        "other-hash": (lambda d: answer(d, mm_hash="someone-else"), "left this item out"),
        "odd-status": (lambda d: answer(d, status="WHATEVER", detail="no idea"), "WHATEVER"),
        "refused": (lambda d: None, "BAD_REQUEST"),
    }
    descs = {h: desc_of(h, (16, 16)) for h in lies}

    def grant(msg: P.Get):
        if msg.mm_hashes == ["ok"]:
            return P.Grant(req=msg.req, items=[answer(ok)])
        h = msg.mm_hashes[0]
        st = lies[h][0](descs[h])
        if st is None:
            return P.Refused(reason="BAD_REQUEST", detail="go away", req=msg.req)
        return P.Grant(req=msg.req, items=[st])

    fake = FakeProducer(grant)
    cons = make_consumer(mode="read", pool_bytes=SMALL, load_timeout_s=5.0)
    try:
        for h, (_, why) in lies.items():
            tickets = cons.load([ItemRef(desc=descs[h], producer=fake.address)])
            assert pump(cons, fake, lambda: tickets[0].done, 10), h
            assert state(tickets[0]) == "failed", (h, tickets[0])
            assert why in tickets[0].error, (h, tickets[0].error)
            print(f"[hostile grant] {h}: {tickets[0].reason}: {tickets[0].error[:110]}")
        assert cons.pool.stats().used == 0
        tickets = cons.load([ItemRef(desc=ok, producer=fake.address)])
        assert pump(cons, fake, lambda: tickets[0].done, 10)
        assert state(tickets[0]) == "landed", tickets[0]
        start = (fake_nblocks - 1) * fake.agent.block
        landed = tickets[0].tensor().view(torch.uint8).reshape(-1).cpu()
        assert torch.equal(landed, fake.agent.buf[start:start + ok.nbytes])
        tickets[0].release()
    finally:
        fake.close()
    prod = make_peer()
    specs = [("real", (32, 32), "float32", 1)]
    fetch(cons, refs_for(prod, prod.call("publish", specs)), specs, device)
    assert cons.pool.stats().used == 0


def test_malformed_reply_fails_pending_items_naming_it(make_consumer):
    """A producer that sends bytes that are no message: the items waiting on it fail at once with
    the decoding error (not an anonymous timeout), and the connection is dropped."""
    fake = FakeProducer(lambda msg: b"\x81\xa4type\xa5grant\xa3req" + b"\xcf" + b"\xff" * 8)
    cons = make_consumer(mode="read", pool_bytes=SMALL, load_timeout_s=5.0)
    try:
        t0 = time.monotonic()
        tickets = cons.load([ItemRef(desc=desc_of("m", (4, 4)), producer=fake.address)])
        assert pump(cons, fake, lambda: tickets[0].done, 10)
        timing("malformed reply: item failed after", time.monotonic() - t0)
        assert state(tickets[0]) == "failed" and "malformed" in tickets[0].error, tickets[0]
        assert time.monotonic() - t0 < 2.0
        assert cons.pool.stats().used == 0
    finally:
        fake.close()


@pytest.mark.parametrize("lie", ["arena-past-registration", "block-size", "version", "compat"])
def test_hostile_welcome_is_refused_and_name_recovers(make_consumer, lie):
    """A Welcome describing an arena larger than what its agent registered (NIXL refuses to prep
    it), another block size, protocol version or compat hash: the load fails naming the cause.
    A later, correct producer with the same agent name (a new agent) is then usable: the failed
    attempt left no stale NIXL metadata behind."""
    def bad(w):
        if lie == "arena-past-registration":
            return msgspec.structs.replace(w, arena=msgspec.structs.replace(w.arena, size=w.arena.size * 2))
        if lie == "block-size":
            return msgspec.structs.replace(w, arena=msgspec.structs.replace(w.arena, block=4096))
        if lie == "version":
            return msgspec.structs.replace(w, version=99)
        return msgspec.structs.replace(w, compat="0" * 32)

    why = {"arena-past-registration": "NIXL peer", "block-size": "block size", "version": "protocol 99",
           "compat": "incompatible"}[lie]
    cons = make_consumer(mode="read", pool_bytes=SMALL)
    first = FakeProducer(lambda m: None, welcome=bad)
    ok = desc_of("ok", (16, 16))
    try:
        t0 = time.monotonic()
        tickets = cons.load([ItemRef(desc=ok, producer=first.address)])
        assert pump(cons, first, lambda: tickets[0].done, 10)
        timing(f"hostile welcome ({lie}): refused after", time.monotonic() - t0)
        assert state(tickets[0]) == "failed" and why in tickets[0].error, tickets[0]
    finally:
        first.close()
    good_agent = FakeAgent(name=first.agent.name)  # same name, new agent and metadata
    second = FakeProducer(lambda m: P.Grant(req=m.req, items=[P.ItemState(
        mm_hash="ok", status="ready", block=5, nbytes=ok.nbytes, shape=ok.shape, dtype=ok.dtype)]), agent=good_agent)
    try:
        tickets = cons.load([ItemRef(desc=ok, producer=second.address)])
        assert pump(cons, second, lambda: tickets[0].done, 10)
        assert state(tickets[0]) == "landed", tickets[0]
        start = 5 * good_agent.block
        landed = tickets[0].tensor().view(torch.uint8).reshape(-1).cpu()
        assert torch.equal(landed, good_agent.buf[start:start + ok.nbytes])
        tickets[0].release()
    finally:
        second.close()


# --------------------------------------------------------------------------------------------
# incompatible peers, items too large


def test_compat_mismatch_fails_fast_and_consumer_keeps_working(make_peer, make_consumer, device):
    """Another model width, or another block size (hashed into compat too): refused at handshake
    with both hashes in the message, within a second; a compatible producer still works."""
    good = make_peer(compat={"model": "m", "width": 64})
    wrong_width = make_peer(compat={"model": "m", "width": 32})
    wrong_block = make_peer(compat={"model": "m", "width": 64}, block_bytes=128 << 10)
    cons = make_consumer(mode="read", pool_bytes=SMALL, compat={"model": "m", "width": 64})
    for bad in (wrong_width, wrong_block):
        d = bad.call("publish", [("x", (4, 64), "float32", 1)])
        t0 = time.monotonic()
        tickets = cons.load(refs_for(bad, d))
        with pytest.raises(LoadFailed):
            LoadBarrier(cons).wait(tickets)
        timing("compat mismatch: refused after", time.monotonic() - t0)
        assert time.monotonic() - t0 < 1.0
        assert tickets[0].reason == "INCOMPAT" and "compat hash" in tickets[0].error, tickets[0]
    specs = [("y", (4, 64), "float32", 2)]
    fetch(cons, refs_for(good, good.call("publish", specs)), specs, device)
    assert cons.pool.stats().used == 0


@pytest.mark.parametrize("mode", MODES)
def test_item_larger_than_consumer_pool(make_peer, make_consumer, device, mode):
    """Too large for the consumer's whole pool: TOO_LARGE at once, in both modes; the rest loads.
    Too large for the producer's whole pool: ``publish`` raises ItemTooLarge saying so."""
    prod = make_peer(pool_bytes=64 << 20)
    cons = make_consumer(mode=mode, pool_bytes=8 << 20)
    specs = [("big", (2048, 2048), "float32", 1), ("small", (8, 8), "float32", 2)]
    tickets = cons.load(refs_for(prod, prod.call("publish", specs)))
    with pytest.raises(LoadFailed) as e:
        LoadBarrier(cons).wait(tickets)
    assert list(e.value.failures) == ["big"] and tickets[0].reason == "TOO_LARGE"
    assert "raise the pool size" in tickets[0].error
    check({"small": tickets[1].tensor()}, specs[1:], device)
    tickets[1].release()
    assert cons.pool.stats().used == 0
    with pytest.raises(RuntimeError, match=r"^ItemTooLarge: item 'too-big' of 134217728 B needs 2048 blocks of "
                                           r"65536 B; the pool holds only \d+ B in all \(raise the pool size\)"):
        prod.call("publish", [("too-big", (8192, 4096), "float32", 1)])
