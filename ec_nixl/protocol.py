"""The control-plane wire protocol: typed messages, strict decoding, compatibility and auth.

Every message is a ``msgspec.Struct`` encoded with MessagePack. Decoding is strict (types,
tags and field presence are checked by msgspec), and ``validate_*`` helpers add the semantic
checks msgspec cannot express (sizes, shapes, dtypes). Nothing on the wire is ever unpickled.
NIXL metadata in a handshake travels with its length and sha256 (``md_problem``), checked before
NIXL parses it: NIXL refuses an agent name for good once a copy of its metadata failed to load.

This module owns the wire format and never touches sockets or NIXL.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
from typing import Optional, Union

import msgspec

from ec_nixl.errors import IncompatiblePeer, ProtocolError

PROTOCOL_VERSION = 4  # 3: Hello/Welcome carry agent, md_len, md_sha256; 4: Welcome carries answers

# Largest item the protocol accepts at all (a pool cannot hold more than this anyway).
MAX_ITEM_BYTES = 1 << 40
MAX_ITEMS_PER_MESSAGE = 4096
MAX_NDIM = 8

# dtypes an encoder output may have, by their torch names; sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}


class Nack(str, enum.Enum):
    """Why a producer refused an item. Only NOT_READY and BUSY are worth retrying."""

    NOT_READY = "NOT_READY"
    BUSY = "BUSY"
    MISSING = "MISSING"
    INCOMPAT = "INCOMPAT"
    VERSION = "VERSION"
    TOO_LARGE = "TOO_LARGE"
    BAD_REQUEST = "BAD_REQUEST"
    UNAUTHORIZED = "UNAUTHORIZED"
    UNKNOWN_SESSION = "UNKNOWN_SESSION"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"

    @property
    def retryable(self) -> bool:
        return self in (Nack.NOT_READY, Nack.BUSY)


class ArenaInfo(msgspec.Struct, frozen=True):
    """Where a peer's registered pool lives: what a remote side needs to address it."""

    base: int
    size: int
    block: int
    mem_type: str  # "DRAM" | "VRAM"
    device: int


class ItemDesc(msgspec.Struct, frozen=True):
    """One encoder output: what the consumer must know to receive and check it."""

    mm_hash: str
    shape: list[int]
    dtype: str
    nbytes: int


class Hello(msgspec.Struct, tag="hello"):
    """A consumer's handshake. ``name`` is the rank's stable identity (sessions, groups, logs);
    ``agent`` the NIXL agent name of this incarnation, which ``agent_md`` describes. The
    metadata's length and sha256 are signed with the rest (``mac``) and checked before NIXL
    sees it (``md_problem``)."""

    version: int
    compat: str
    name: str
    incarnation: str
    nonce: bytes
    agent_md: Optional[bytes] = None  # None for control-only clients (a vLLM scheduler)
    arena: Optional[ArenaInfo] = None
    group: str = ""  # all ranks of one consumer engine share a group; readers are counted per group
    agent: str = ""
    md_len: int = 0
    md_sha256: bytes = b""
    mac: bytes = b""


class Welcome(msgspec.Struct, tag="welcome"):
    """A producer's answer to an accepted Hello; its metadata fields mean what the Hello's do."""

    version: int
    compat: str
    name: str
    incarnation: str
    session: str
    nonce: bytes
    agent_md: Optional[bytes] = None
    arena: Optional[ArenaInfo] = None
    agent: str = ""
    md_len: int = 0
    md_sha256: bytes = b""
    link_timeout_s: float = 0.0  # how long this producer keeps a silent consumer's connection (0: not said)
    answers: str = ""  # 'host:port' Grants may also come from: the consumer connects there with its identity
    mac: bytes = b""


class Refused(msgspec.Struct, tag="refused"):
    """A handshake or request refused as a whole."""

    reason: str
    detail: str
    req: int = 0


class ItemState(msgspec.Struct, frozen=True):
    """The producer's answer for one item: ready (with its place), or a NACK reason."""

    mm_hash: str
    status: str  # "ready" or a Nack value
    detail: str = ""
    block: int = -1
    nbytes: int = 0
    shape: list[int] = []
    dtype: str = ""
    lease_s: float = 0.0  # how long the producer promises to keep it where it is


class Hold(msgspec.Struct, tag="hold"):
    """Keep these items for me (lease) and tell me where they are; doubles as a heartbeat.

    ``wait_s`` > 0: items not published yet are expected (their encoder is still running): the
    producer answers once all of them are ready, or after ``wait_s`` (capped at
    ``MAX_HOLD_WAIT_S``) with what it has then. Producers that predate it ignore the field and
    answer at once (MISSING), which the consumer retries."""

    session: str
    req: int
    mm_hashes: list[str]
    readers: int = 1
    wait_s: float = 0.0


MAX_HOLD_WAIT_S = 10.0
"""Longest a producer keeps a waiting Hold unanswered, whatever the consumer asked."""


class Get(msgspec.Struct, tag="get"):
    """Grant me these items for a READ (pins them until my notification or the lease ends).
    ``wait_s`` as a Hold's: the Grant comes once all are ready, or after the wait."""

    session: str
    req: int
    mm_hashes: list[str]
    reader: int = 0
    readers: int = 1
    wait_s: float = 0.0


class Grant(msgspec.Struct, tag="grant"):
    req: int
    items: list[ItemState]


class PushItem(msgspec.Struct, frozen=True):
    mm_hash: str
    block: int  # destination block in the consumer's arena
    nbytes: int


class Push(msgspec.Struct, tag="push"):
    """WRITE these items into my arena at the given blocks, then notify me.

    ``wait_s`` > 0: items not published yet are expected; each one's WRITE starts when it is
    published (no round trip after the publish), and those still missing after ``wait_s``
    (capped at ``MAX_HOLD_WAIT_S``) are refused MISSING. Until then the blocks are the
    producer's to write: the consumer takes them back only through a Cancel and its CancelAck.
    Producers that predate the field refuse the missing items at once (MISSING)."""

    session: str
    req: int
    items: list[PushItem]
    reader: int = 0
    readers: int = 1
    wait_s: float = 0.0


class PushFailed(msgspec.Struct, tag="push_failed"):
    """Items a producer could not (or will no longer) push; their slots are not written."""

    req: int
    items: list[ItemState]


class Cancel(msgspec.Struct, tag="cancel"):
    """Do not push these any more: I gave up waiting. The reply says it is safe to reuse."""

    session: str
    req: int
    mm_hashes: list[str]


class CancelAck(msgspec.Struct, tag="cancel_ack"):
    """safe: the producer will never write these again; unsafe ones are still in flight."""

    req: int
    safe: list[str]
    in_flight: list[str]


class Stats(msgspec.Struct, tag="stats"):
    """Ask a producer for its statistics and pool occupancy (operators, tests)."""

    session: str
    req: int


class StatsReply(msgspec.Struct, tag="stats_reply"):
    req: int
    stats: dict = {}


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    session: str


class Bye(msgspec.Struct, tag="bye"):
    session: str


class ReadDone(msgspec.Struct, tag="read_done"):
    """A consumer's reader finished READing these items (the producer frees each after all
    readers). A control message, not a NIXL notification: a notification queued on the UCX
    worker is paid for by the next transfer's post (~17 us on CPU), i.e. on the hot path."""

    session: str
    mm_hashes: list[str]
    reader: int = 0


Message = Union[
    Hello,
    Welcome,
    Refused,
    Hold,
    Get,
    Grant,
    Push,
    PushFailed,
    Cancel,
    CancelAck,
    Stats,
    StatsReply,
    Heartbeat,
    Bye,
    ReadDone,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
MAX_MESSAGE_BYTES = 4 << 20


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one control message; any malformed input raises ``ProtocolError``."""

    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed control message: {e}") from None
    for field in ("mm_hashes", "items"):
        seq = getattr(msg, field, None)
        if seq is not None and len(seq) > MAX_ITEMS_PER_MESSAGE:
            raise ProtocolError(f"{len(seq)} items in one message exceeds {MAX_ITEMS_PER_MESSAGE}")
    return msg


# --- notifications (NIXL notif payloads, producer -> consumer after a WRITE: they travel
# behind the WRITE, so their arrival means the bytes landed). One per batch: the items of one
# request, for one reader. (Read-done goes the other way as a control message: ReadDone.)

NOTIF_WRITE_DONE = "W"
_notif_enc = msgspec.msgpack.Encoder()
_notif_dec = msgspec.msgpack.Decoder(tuple[str, str, list[str], int])


def encode_notif(kind: str, session: str, mm_hashes: list[str], reader: int) -> bytes:
    return _notif_enc.encode((kind, session, list(mm_hashes), reader))


def decode_notif(data: bytes) -> Optional[tuple[str, str, list[str], int]]:
    """Returns (kind, session, mm_hashes, reader), or None for anything else (never raises)."""
    try:
        n = _notif_dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return n if len(n[2]) <= MAX_ITEMS_PER_MESSAGE else None


# --- semantic validation -----------------------------------------------------------------


def validate_item(desc: ItemDesc, *, width: Optional[int] = None, dtype: Optional[str] = None) -> None:
    """Raise ProtocolError unless the description is self-consistent (and matches the model)."""

    h = desc.mm_hash
    if not h or len(h) > 512:
        raise ProtocolError(f"bad mm_hash {h[:64]!r}: must be 1..512 characters")
    size = DTYPE_SIZES.get(desc.dtype)
    if size is None:
        raise ProtocolError(f"item {h}: unsupported dtype {desc.dtype!r} (known: {sorted(DTYPE_SIZES)})")
    shape = desc.shape
    expect = size
    for d in shape:  # one pass: type, sign and the product (this runs on every load)
        if type(d) is not int or d <= 0:
            expect = 0
            break
        expect *= d
    if not expect or not 1 <= len(shape) <= MAX_NDIM:
        raise ProtocolError(f"item {h}: bad shape {shape!r}: need 1..{MAX_NDIM} positive dims")
    if desc.nbytes != expect:
        raise ProtocolError(f"item {h}: nbytes {desc.nbytes} != shape {desc.shape} x {desc.dtype} = {expect}")
    if not 0 < desc.nbytes <= MAX_ITEM_BYTES:
        raise ProtocolError(f"item {h}: nbytes {desc.nbytes} out of range (1..{MAX_ITEM_BYTES})")
    if dtype is not None and desc.dtype != dtype:
        raise IncompatiblePeer(f"item {h}: dtype {desc.dtype} but this model uses {dtype}")
    if width is not None and desc.shape[-1] != width:
        raise IncompatiblePeer(f"item {h}: width {desc.shape[-1]} but this model expects {width}")


def validate_state_matches(state: ItemState, want: ItemDesc, arena: Optional[ArenaInfo] = None) -> None:
    """A producer's grant must describe exactly the item asked for (and lie inside its arena)."""

    if state.mm_hash != want.mm_hash:
        raise ProtocolError(f"grant for {state.mm_hash!r} answers a request for {want.mm_hash!r}")
    if state.nbytes != want.nbytes or list(state.shape) != list(want.shape) or state.dtype != want.dtype:
        raise ProtocolError(
            f"item {want.mm_hash}: producer holds {state.shape} {state.dtype} ({state.nbytes} B), "
            f"announced {want.shape} {want.dtype} ({want.nbytes} B)"
        )
    if arena is None:
        if state.block < 0:
            raise ProtocolError(f"item {want.mm_hash}: granted block {state.block} is negative")
        return
    nblocks = blocks_for(state.nbytes, arena.block)
    if state.block < 0 or (state.block + nblocks) * arena.block > arena.size:
        raise ProtocolError(f"item {want.mm_hash}: granted block {state.block} lies outside the producer arena")


def blocks_for(nbytes: int, block: int) -> int:
    return max(1, -(-nbytes // block))


# --- compatibility and authentication -------------------------------------------------------


def compat_hash(fields: dict) -> str:
    """A stable hash of what must match between peers (version, model, dtype, width, ...)."""
    blob = json.dumps({"protocol": PROTOCOL_VERSION, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def md_fields(agent_md: Optional[bytes]) -> dict:
    """The ``md_len``/``md_sha256`` fields of a handshake carrying ``agent_md``."""
    if agent_md is None:
        return {}
    return {"md_len": len(agent_md), "md_sha256": hashlib.sha256(agent_md).digest()}


def md_problem(msg: Union[Hello, Welcome]) -> Optional[str]:
    """What is wrong with a handshake's NIXL metadata (None: nothing, or it carries none).

    NIXL must never see a copy that was cut short or altered: it keeps refusing the agent name
    of metadata it once failed to load, and unloads a loaded agent whose name such a copy bears.
    """
    md = msg.agent_md
    if md is None:
        return None
    if not msg.agent:
        return "NIXL metadata without the name of its agent"
    if msg.md_len != len(md):
        return f"NIXL metadata of {len(md)} B, the handshake declares {msg.md_len} B (cut short or corrupted)"
    if not hmac.compare_digest(hashlib.sha256(md).digest(), msg.md_sha256):
        return "NIXL metadata does not match the sha256 the handshake declares (corrupted)"
    return None


def new_nonce() -> bytes:
    return os.urandom(16)


def _mac_payload(msg: Union[Hello, Welcome], peer_nonce: bytes) -> bytes:
    fields = msgspec.structs.asdict(msg)
    fields["mac"] = b""
    return msgspec.msgpack.encode(fields) + peer_nonce


def sign(msg: Union[Hello, Welcome], token: Optional[bytes], peer_nonce: bytes = b"") -> None:
    """Attach an HMAC-SHA256 over the message (and the peer's nonce, against replay)."""
    msg.mac = hmac.new(token, _mac_payload(msg, peer_nonce), hashlib.sha256).digest() if token else b""


def verify(msg: Union[Hello, Welcome], token: Optional[bytes], peer_nonce: bytes = b"") -> bool:
    if not token:
        return True
    want = hmac.new(token, _mac_payload(msg, peer_nonce), hashlib.sha256).digest()
    return hmac.compare_digest(want, msg.mac)
