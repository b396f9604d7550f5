"""The wire protocol: strict decoding, semantic validation, compatibility and HMAC."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_nixl import protocol as P
from ec_nixl.errors import IncompatiblePeer, ProtocolError


def test_round_trip_every_message():
    msgs = [
        P.Hello(version=1, compat="c", name="n", incarnation="i", nonce=b"x" * 16, agent_md=b"md",
                arena=P.ArenaInfo(base=1, size=2, block=3, mem_type="DRAM", device=0), group="g"),
        P.Welcome(version=1, compat="c", name="n", incarnation="i", session="s", nonce=b"y"),
        P.Refused(reason="MISSING", detail="d", req=3),
        P.Hold(session="s", req=1, mm_hashes=["a", "b"], readers=2),
        P.Get(session="s", req=2, mm_hashes=["a"], reader=1, readers=2),
        P.Grant(req=2, items=[P.ItemState(mm_hash="a", status="ready", block=3, nbytes=8, shape=[2],
                                          dtype="float32", lease_s=1.5)]),
        P.Push(session="s", req=4, items=[P.PushItem(mm_hash="a", block=7, nbytes=8)]),
        P.PushFailed(req=4, items=[P.ItemState(mm_hash="a", status="MISSING")]),
        P.Cancel(session="s", req=5, mm_hashes=["a"]),
        P.CancelAck(req=5, safe=["a"], in_flight=[]),
        P.Heartbeat(session="s"),
        P.Bye(session="s"),
    ]
    for m in msgs:
        assert P.decode(P.encode(m)) == m


@pytest.mark.parametrize("junk", [b"", b"\x00", b"\xc1", msgspec.msgpack.encode({"type": "nope"}),
                                  msgspec.msgpack.encode({"type": "get", "session": 1, "req": "x"}),
                                  msgspec.msgpack.encode([1, 2, 3]), b"\xff" * 100])
def test_malformed_messages_raise_protocol_error(junk):
    with pytest.raises(ProtocolError, match="malformed"):
        P.decode(junk)


def test_oversized_message_rejected():
    with pytest.raises(ProtocolError, match="exceeds"):
        P.decode(b"\x00" * (P.MAX_MESSAGE_BYTES + 1))


def test_too_many_items_rejected():
    m = P.Get(session="s", req=1, mm_hashes=["a"] * (P.MAX_ITEMS_PER_MESSAGE + 1))
    with pytest.raises(ProtocolError, match="items in one message"):
        P.decode(P.encode(m))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_decoder_fuzz_never_raises_anything_but_protocol_error(data):
    try:
        P.decode(data)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "session", "req", "mm_hashes", "items", "readers"]),
                       st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=8),
                                 st.lists(st.integers(-2**63, 2**63 - 1), max_size=3),
                                 st.sampled_from(["get", "hold", "push", "hello", "grant"]))))
def test_decoder_fuzz_structured(d):
    try:
        P.decode(msgspec.msgpack.encode(d))
    except ProtocolError:
        pass


def item(**kw):
    base = dict(mm_hash="h", shape=[1369, 3584], dtype="bfloat16", nbytes=1369 * 3584 * 2)
    base.update(kw)
    return P.ItemDesc(**base)


def test_validate_item_accepts_good_and_names_bad():
    P.validate_item(item(), width=3584, dtype="bfloat16")
    cases = [
        (item(dtype="complex64"), "unsupported dtype"),
        (item(shape=[0, 3584], nbytes=0), "bad shape"),
        (item(shape=[-3, 3584]), "bad shape"),
        (item(nbytes=5), "nbytes 5 != shape"),
        (item(mm_hash=""), "bad mm_hash"),
        (item(shape=[1] * 9, nbytes=2), "bad shape"),
    ]
    for desc, msg in cases:
        with pytest.raises(ProtocolError, match=msg):
            P.validate_item(desc)
    with pytest.raises(IncompatiblePeer, match="width 3584 but this model expects 2048"):
        P.validate_item(item(), width=2048)
    with pytest.raises(IncompatiblePeer, match="dtype"):
        P.validate_item(item(), dtype="float16")


def test_huge_shapes_rejected():
    with pytest.raises(ProtocolError):
        P.validate_item(item(shape=[1 << 30, 1 << 20], nbytes=(1 << 50) * 2))


def test_grant_must_match_request_and_arena():
    arena = P.ArenaInfo(base=0, size=64 << 20, block=64 << 10, mem_type="DRAM", device=0)
    want = item()
    ok = P.ItemState(mm_hash="h", status="ready", block=4, nbytes=want.nbytes, shape=want.shape, dtype="bfloat16")
    P.validate_state_matches(ok, want, arena)
    with pytest.raises(ProtocolError, match="outside"):
        P.validate_state_matches(msgspec.structs.replace(ok, block=1023), want, arena)
    with pytest.raises(ProtocolError, match="announced"):
        P.validate_state_matches(msgspec.structs.replace(ok, shape=[1, 1]), want, arena)
    with pytest.raises(ProtocolError, match="answers a request"):
        P.validate_state_matches(msgspec.structs.replace(ok, mm_hash="other"), want, arena)


def test_compat_hash_is_stable_and_sensitive():
    a = P.compat_hash({"model": "m", "dtype": "bf16", "width": 3584})
    assert a == P.compat_hash({"width": 3584, "dtype": "bf16", "model": "m"})
    assert a != P.compat_hash({"model": "m", "dtype": "bf16", "width": 2048})


def test_hmac_sign_verify_and_replay():
    h = P.Hello(version=1, compat="c", name="n", incarnation="i", nonce=b"n" * 16)
    P.sign(h, b"k")
    assert P.verify(h, b"k") and not P.verify(h, b"other")
    w = P.Welcome(version=1, compat="c", name="p", incarnation="j", session="s", nonce=b"m" * 16)
    P.sign(w, b"k", peer_nonce=b"n" * 16)
    assert P.verify(w, b"k", b"n" * 16)
    assert not P.verify(w, b"k", b"z" * 16), "a Welcome replayed to another Hello must not verify"
    h.name = "tampered"
    assert not P.verify(h, b"k")


def test_notifs_round_trip_and_foreign_bytes():
    b = P.encode_notif(P.NOTIF_WRITE_DONE, "s", ["h|x", "y"], 3)
    assert P.decode_notif(b) == ("W", "s", ["h|x", "y"], 3)
    assert P.decode_notif(P.encode_notif("W", "s", ["h"] * (P.MAX_ITEMS_PER_MESSAGE + 1), 0)) is None
    assert P.decode_notif(b"bye") is None and P.decode_notif(b"") is None
