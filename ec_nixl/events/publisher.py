"""One instance's encoder-cache publisher: the state, its deltas, replay and snapshot.

The engine (vLLM's scheduler thread, or a producer's pool) calls ``stored``/``removed`` as its
cache changes, and ``flush`` when a step ended; those only record (the latest change per item
wins). A thread named ``ec-nixl-events`` applies what was recorded to the state and sends what
changed it as one batch with the next sequence number: at once after a quiet spell (the first
``flush`` wakes it), then every ``batch_s`` while changes keep coming (it stays *armed*: further
flushes make no system call), and it sleeps again after a window with none. Every wake-up and
every message costs (a thread woken, ZMQ's I/O thread woken, a socket write: ~0.1-0.3 ms of CPU
each on the 2-core VM here), so the cost follows ``batch_s``, not the request rate; ``batch_s`` 0
sends every flush from the caller's thread instead. It keeps the last ``buffer_batches`` batches
for replay, answers replay and snapshot requests (its ROUTER socket is its own; what it reads is
copied under the lock, and sent after) and sends a heartbeat when nothing went out for
``heartbeat_s``. The first batch (seq 0) clears every medium the publisher serves: a fresh engine
holds nothing.

A full PUB socket drops messages (ZMQ's high-water mark, ``hwm``): a slow subscriber sees a gap
in the sequence numbers and replays or takes a snapshot; the engine never waits for it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import zmq

from ec_nixl.errors import ConfigError
from ec_nixl.events import schema as S
from ec_nixl.loop import name_os_thread

logger = logging.getLogger("ec_nixl.events")

MAX_BATCH_EVENTS = 4096
"""Events per batch at most; a larger backlog goes out as several batches."""
MAX_REQUESTS_PER_WAKE = 64
"""Replay/snapshot requests answered per wake-up before pending changes go out again."""


@dataclass
class PublisherConfig:
    endpoint: str
    """Where the PUB socket binds, e.g. ``tcp://0.0.0.0:16600``."""
    replay_endpoint: Optional[str]
    """Where the ROUTER (replay and snapshot) binds; None: no replay (subscribers cannot recover)."""
    instance: str
    """The serving address subscribers learn the events are about (each batch carries it)."""
    mediums: tuple[str, ...]
    """What this publisher describes (``schema.MEDIUM_*``); its first batch clears each."""
    topic: str = "ec-nixl"
    buffer_batches: int = 10_000
    hwm: int = 100_000
    heartbeat_s: float = 1.0
    batch_s: float = 0.05
    """While changes keep coming, one batch per this (0: every flush sends, from the caller's thread)."""
    data_parallel_rank: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.mediums:
            raise ConfigError("an events publisher needs at least one medium")
        if self.buffer_batches < 1 or self.hwm < 1:
            raise ConfigError(f"events buffer ({self.buffer_batches}) and hwm ({self.hwm}) must be >= 1")
        if not self.heartbeat_s > 0:
            raise ConfigError(f"events heartbeat must be > 0 s, got {self.heartbeat_s}")
        if not 0 <= self.batch_s <= 1:
            raise ConfigError(f"events batch window must be within 0..1 s, got {self.batch_s}")
        if not self.instance or len(self.instance) > S.MAX_KEY_LEN:
            raise ConfigError(f"events instance must be 1..{S.MAX_KEY_LEN} characters, got {self.instance!r}")


class EventPublisher:
    """Publish one instance's encoder-cache changes (see the module docstring)."""

    def __init__(self, cfg: PublisherConfig):
        self.cfg = cfg
        self.epoch = uuid.uuid4().hex
        self._lock = threading.Lock()  # the state, sequence, replay buffer and PUB socket
        self._pending: dict[tuple[str, str], S.Event] = {}
        self._armed = False  # the thread sends what is pending every batch_s (while changes keep coming)
        self._closed = False
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router: Optional[zmq.Socket] = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(cfg.endpoint)
            if cfg.replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(cfg.replay_endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None if self._router is None else self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"encoder-cache events: cannot bind {cfg.endpoint} / {cfg.replay_endpoint}: {e}") from e
        self._topic = cfg.topic.encode()
        self._state: dict[tuple[str, str], S.EncoderItemStored] = {}
        self._seq = -1
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.buffer_batches)
        self._last_sent = self._last_batch = 0.0  # (any message; an event batch)
        self.counters: collections.Counter = collections.Counter()
        with self._lock:
            self._send_batch([S.EncoderItemsCleared(m) for m in cfg.mediums])
        self._wake_r, self._wake_w = os.pipe()  # (close() wakes the thread with it)
        self._thread = threading.Thread(target=self._run, name="ec-nixl-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- engine side (any thread)

    def stored(self, mm_hash: str, modality: str, nbytes: int, medium: str) -> None:
        self._record((medium, mm_hash), S.EncoderItemStored(mm_hash, modality or "unknown", int(nbytes), medium))

    def removed(self, mm_hash: str, medium: str) -> None:
        self._record((medium, mm_hash), S.EncoderItemRemoved(mm_hash, medium))

    def _record(self, key: tuple[str, str], ev: S.Event) -> None:
        with self._lock:
            self._pending.pop(key, None)  # the latest change wins, in the order of the latest changes
            self._pending[key] = ev

    def flush(self) -> None:
        """The changes recorded so far are complete (an engine step ended): they go out as one batch
        (with ``batch_s`` 0: now, from this thread; else from the publisher's thread, see the module
        docstring). Never blocks on a subscriber; costs no system call while the thread is armed."""
        with self._lock:
            if not self._pending or self._closed:
                return
            if not self.cfg.batch_s:
                return self._send_pending()
            if self._armed:
                return  # the thread comes by within batch_s
            self._armed = True
        os.write(self._wake_w, b"x")

    def _send_pending(self) -> None:
        """The recorded changes that change the state, as batches (lock held)."""
        pending, self._pending = self._pending, {}
        out: list[S.Event] = []
        for key, ev in pending.items():
            if isinstance(ev, S.EncoderItemStored):
                if self._state.get(key) != ev:
                    self._state[key] = ev
                    out.append(ev)
            elif self._state.pop(key, None) is not None:
                out.append(ev)
        for i in range(0, len(out), MAX_BATCH_EVENTS):
            self._send_batch(out[i:i + MAX_BATCH_EVENTS])

    def drain(self) -> None:
        """Send everything recorded, now, whatever ``batch_s`` says (tools, tests)."""
        with self._lock:
            if self._pending and not self._closed:
                self._send_pending()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        with self._lock:
            self._close_sockets()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _close_sockets(self) -> None:
        for s in (self._pub, self._router):
            if s is not None and not s.closed:
                s.close(linger=0)

    def held(self) -> dict[str, list[str]]:
        """{medium: sorted mm_hashes} this publisher has announced."""
        out: dict[str, list[str]] = {}
        with self._lock:
            keys = list(self._state)
        for medium, mm_hash in keys:
            out.setdefault(medium, []).append(mm_hash)
        return {m: sorted(v) for m, v in sorted(out.items())}

    def stats(self) -> dict:
        return {"seq": self._seq, "epoch": self.epoch, "items": len(self._state), **self.counters}

    # ------------------------------------------------------------- sending (lock held)

    def _batch(self, events: list) -> S.EncoderEventBatch:
        return S.EncoderEventBatch(time.time(), events, self.cfg.data_parallel_rank, self.cfg.instance, self.epoch)

    def _send_batch(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, S.EncoderItemsCleared):
                for key in [k for k in self._state if k[0] == ev.medium]:
                    del self._state[key]
        self._seq += 1
        payload = S.encode(self._batch(events))
        self._buffer.append((self._seq, payload))
        self._send_pub(self._seq, payload)
        self._last_batch = self._last_sent
        self.counters["batches"] += 1
        self.counters["events"] += len(events)

    def _send_pub(self, seq: int, payload: bytes) -> None:
        """One PUB message; ZMQ drops it when the high-water mark is reached (never blocks)."""
        try:
            self._pub.send_multipart((self._topic, S.seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.counters["dropped_at_hwm"] += 1
        self._last_sent = time.monotonic()

    # ------------------------------------------------------------- the thread: requests, heartbeats

    def _run(self) -> None:
        name_os_thread("ec-nixl-events")
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        os.set_blocking(self._wake_r, False)
        while not self._closed:
            due = self._last_sent + self.cfg.heartbeat_s
            if self._armed:
                due = min(due, self._last_batch + self.cfg.batch_s)
            try:
                ready = dict(poller.poll(max(0, int((due - time.monotonic()) * 1000) + 1)))
            except zmq.ZMQError as e:  # the sockets were closed under us
                logger.debug("events publisher: poll ended: %s", e)
                return
            if self._closed:
                return
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    pass
            if self._router is not None and self._router in ready:
                self._serve_requests()
            if self._armed and time.monotonic() - self._last_batch >= self.cfg.batch_s:
                with self._lock:  # send what is pending; with nothing, disarm (the next flush re-arms)
                    if self._pending and not self._closed:
                        self._send_pending()
                    else:
                        self._armed = False
            if time.monotonic() - self._last_sent >= self.cfg.heartbeat_s:
                with self._lock:
                    if not self._closed:
                        self._send_pub(max(self._seq, 0), S.encode(self._batch([])))
                        self.counters["heartbeats"] += 1

    def _serve_requests(self) -> None:
        assert self._router is not None
        for _ in range(MAX_REQUESTS_PER_WAKE):
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"":
                self.counters["bad_requests"] += 1
                logger.warning("events publisher %s: malformed replay request (%d frames)", self.cfg.instance, len(frames))
                if len(frames) >= 1:
                    self._end(frames[0], f"error: expected [empty, request], got {len(frames) - 1} frame(s)")
                continue
            client, req = frames[0], frames[2]
            if req == S.SNAPSHOT_REQUEST:
                self._send_snapshot(client)
            elif len(req) == S.SEQ_BYTES:
                self._send_replay(client, int.from_bytes(req, "big"))
            else:
                self.counters["bad_requests"] += 1
                logger.warning("events publisher %s: unknown replay request of %d bytes", self.cfg.instance, len(req))
                self._end(client, f"error: a request is an 8-byte start sequence number or "
                                  f"{S.SNAPSHOT_REQUEST.decode()!r}, got {len(req)} bytes")

    def _send_replay(self, client: bytes, start: int) -> None:
        with self._lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        for seq, payload in batches:
            self._router.send_multipart((client, b"", self._topic, S.seq_bytes(seq), payload))
        self._end(client)
        self.counters["replays"] += 1

    def _send_snapshot(self, client: bytes) -> None:
        with self._lock:  # (the state as of batch ``seq``: later changes follow as batches after it)
            seq, entries = max(self._seq, 0), list(self._state.values())
        snap = S.EncoderCacheSnapshot(time.time(), seq, self.cfg.instance, self.epoch, list(self.cfg.mediums), entries,
                                      self.cfg.data_parallel_rank)
        self._router.send_multipart((client, b"", self._topic, S.seq_bytes(seq), S.encode(snap)))
        self._end(client)
        self.counters["snapshots"] += 1

    def _end(self, client: bytes, error: str = "") -> None:
        self._router.send_multipart((client, b"", b"", S.END_SEQ, error.encode()))
