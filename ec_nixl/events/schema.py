"""The encoder-cache events' wire format: vLLM's KV-events framing, our own event types.

A publisher's PUB socket sends three frames per message, as vLLM's ``ZmqEventPublisher`` does:
``topic``, an 8-byte big-endian sequence number, and a msgspec-MessagePack ``EncoderEventBatch``
(an array ``[ts, events, data_parallel_rank, instance, epoch]``: vLLM's three ``EventBatch``
fields, then ours). Each event is a map tagged by its ``type``: ``EncoderItemStored``,
``EncoderItemRemoved``, ``EncoderItemsCleared``. A heartbeat is a batch with no events that
repeats the last sequence number. The replay socket (ROUTER) answers vLLM's replay request (the
first sequence number wanted, 8 bytes big-endian) with ``[topic, seq, batch]`` frames and an end
marker (``seq`` -1, empty payload), and the request ``snapshot`` with one
``EncoderCacheSnapshot`` (the whole state as of sequence number ``seq``) and the end marker.
docs/events.md is the reference; this module owns the types and nothing else (no sockets).
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

MEDIUM_POOL = "encoder_pool"
"""An Encode instance's registered pool: items a consumer can read now."""
MEDIUM_CACHE = "encoder_cache"
"""vLLM's own encoder cache (the scheduler's ``EncoderCacheManager``): items it will not encode again."""

SNAPSHOT_REQUEST = b"snapshot"
"""Replay-socket request for the whole current state (any other request is vLLM's 8-byte start seq)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""vLLM's end-of-replay marker (with an empty payload; ours may carry an error text)."""
SEQ_BYTES = 8

MAX_KEY_LEN = 256
"""Longest mm_hash, modality, medium or instance string a subscriber accepts."""


class EncoderCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """One change of an instance's encoder-cache state (tagged by class name on the wire)."""


class EncoderItemStored(EncoderCacheEvent):
    mm_hash: str
    modality: str
    nbytes: int
    medium: str


class EncoderItemRemoved(EncoderCacheEvent):
    mm_hash: str
    medium: str


class EncoderItemsCleared(EncoderCacheEvent):
    """Every item of ``medium`` is gone: a publisher's first batch (a fresh engine holds nothing)."""

    medium: str


Event = Union[EncoderItemStored, EncoderItemRemoved, EncoderItemsCleared]


class EncoderEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's changes. The first three fields are vLLM's ``EventBatch``'s."""

    ts: float
    events: list[Event]
    data_parallel_rank: Optional[int] = None
    instance: str = ""
    """The serving address of the instance these events are about (each event inherits it)."""
    epoch: str = ""
    """The publisher's incarnation: a new one (a restart) restarts the sequence numbers."""


class EncoderCacheSnapshot(msgspec.Struct, array_like=True, gc=False):
    """A publisher's whole state as of batch ``seq`` (what a late or lost subscriber starts from)."""

    ts: float
    seq: int
    instance: str
    epoch: str
    mediums: list[str]
    entries: list[EncoderItemStored]
    data_parallel_rank: Optional[int] = None


class BadEvent(ValueError):
    """A payload that is not a valid batch or snapshot (names what is wrong)."""


_batch_decoder = msgspec.msgpack.Decoder(EncoderEventBatch)
_snapshot_decoder = msgspec.msgpack.Decoder(EncoderCacheSnapshot)
_encoder = msgspec.msgpack.Encoder()


def encode(obj: Union[EncoderEventBatch, EncoderCacheSnapshot]) -> bytes:
    return _encoder.encode(obj)


def _check_text(what: str, value: str) -> None:
    if not value or len(value) > MAX_KEY_LEN:
        raise BadEvent(f"{what} must be 1..{MAX_KEY_LEN} characters, got {len(value)}")


def _check_event(ev: Event) -> None:
    _check_text("medium", ev.medium)
    if isinstance(ev, (EncoderItemStored, EncoderItemRemoved)):
        _check_text("mm_hash", ev.mm_hash)
    if isinstance(ev, EncoderItemStored):
        _check_text("modality", ev.modality)
        if ev.nbytes < 0:
            raise BadEvent(f"nbytes of {ev.mm_hash} is negative ({ev.nbytes})")


def _decode(decoder: msgspec.msgpack.Decoder, payload: bytes, events: str):
    """``payload`` as ``decoder``'s type, its instance and its ``events`` field checked beyond types."""
    try:
        obj = decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadEvent(f"not an {decoder.type.__name__}: {e}") from None
    _check_text("instance", obj.instance)
    for ev in getattr(obj, events):
        _check_event(ev)
    return obj


def decode_batch(payload: bytes) -> EncoderEventBatch:
    """A batch, checked beyond its types (lengths, signs); BadEvent says what is wrong."""
    return _decode(_batch_decoder, payload, "events")


def decode_snapshot(payload: bytes) -> EncoderCacheSnapshot:
    snap = _decode(_snapshot_decoder, payload, "entries")
    if snap.seq < 0:
        raise BadEvent(f"snapshot seq must be >= 0, got {snap.seq}")
    return snap


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def parse_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise BadEvent(f"sequence number frame has {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big", signed=True)
