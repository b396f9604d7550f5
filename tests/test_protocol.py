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


def expect_decode(data: bytes):
    """What ``P.decode`` must do with ``data``: return the message msgspec decodes as one of the
    protocol's types, or raise ProtocolError with exactly msgspec's reason after
    "malformed control message: " (inputs here are far below the size and item limits)."""
    try:
        return msgspec.msgpack.decode(data, type=P.Message), None
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return None, f"malformed control message: {e}"


def assert_decodes_exactly(data: bytes):
    want, error = expect_decode(data)
    if error is None:
        got = P.decode(data)
        assert got == want and type(got) is type(want)
        assert P.decode(P.encode(got)) == got, "a decoded message must survive a round trip"
        return got
    with pytest.raises(ProtocolError) as e:
        P.decode(data)
    assert str(e.value) == error
    return None


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_decoder_fuzz_returns_a_message_or_the_exact_protocol_error(data):
    assert_decodes_exactly(data)


_FIELDS = ["type", "session", "req", "mm_hashes", "items", "readers"]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS),
                       st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=8),
                                 st.lists(st.integers(-2**63, 2**63 - 1), max_size=3),
                                 st.sampled_from(["get", "hold", "push", "hello", "grant"]))))
def test_decoder_fuzz_structured(d):
    """Maps with real tags and field names: a decoded message is of the type its tag names and
    carries exactly the given fields; anything else is the exact ProtocolError."""
    msg = assert_decodes_exactly(msgspec.msgpack.encode(d))
    if msg is not None:
        assert type(msg).__struct_config__.tag == d["type"]
        for k, v in d.items():
            if k != "type" and k in type(msg).__struct_fields__:
                assert getattr(msg, k) == v, (k, msg)


def test_decoder_names_what_is_wrong():
    """Hand-picked malformed messages and the exact reason each is refused with."""
    cases = {
        msgspec.msgpack.encode({"type": "get", "session": "s", "req": "x", "mm_hashes": []}):
            "malformed control message: Expected `int`, got `str` - at `$.req`",
        msgspec.msgpack.encode({"type": "hold", "req": 1, "mm_hashes": []}):
            "malformed control message: Object missing required field `session`",
        msgspec.msgpack.encode({"type": "nope"}):
            "malformed control message: Invalid value 'nope' - at `$.type`",
        b"\xc1": "malformed control message: MessagePack data is malformed: invalid opcode '\\xc1' (byte 0)",
    }
    for data, error in cases.items():
        with pytest.raises(ProtocolError) as e:
            P.decode(data)
        assert str(e.value) == error, data


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
