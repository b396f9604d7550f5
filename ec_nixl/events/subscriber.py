"""The reference subscriber: one index of many publishers that converges whatever it missed.

Each publisher is a *source* with its own SUB socket (so a message is known by where it came
from) and, while it asks for something, one DEALER to its replay socket. Per source:

* start, or come back after being declared gone: ask for a **snapshot**, keep what the SUB
  socket receives meanwhile, then apply the snapshot (state as of batch ``seq``) and every kept
  batch after it;
* a batch with the next sequence number is applied; an older one (or a heartbeat repeating the
  last) is ignored; a newer one, or a heartbeat naming a batch not seen, is a **gap**: the
  missing batches are **replayed** (kept meanwhile, as above); a replay that cannot give them
  all (the publisher's buffer moved on) turns into a snapshot;
* another ``epoch`` (the publisher restarted: its sequence numbers start again) drops the
  source's entries and asks for a snapshot;
* nothing heard for ``dead_after_s`` (heartbeats included) drops its entries until it is heard
  again.

Nothing here sleeps or blocks beyond ``poll``'s timeout, and time is read only through ``clock``,
so tests decide every step. A malformed message is counted and logged, never applied.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import zmq

from ec_nixl.errors import ConfigError
from ec_nixl.events import schema as S
from ec_nixl.events.index import EventIndex

logger = logging.getLogger("ec_nixl.events")

MAX_MESSAGE_BYTES = 64 << 20
"""A larger message is refused by the socket itself (a snapshot of ~500 000 items fits)."""
LIVE, SYNCING, REPLAYING, DOWN = "live", "syncing", "replaying", "down"


@dataclass(frozen=True)
class Source:
    endpoint: str
    """The publisher's PUB address."""
    replay: str
    """Its replay/snapshot (ROUTER) address."""


def parse_source(spec: str) -> Source:
    """``tcp://host:port`` (or ``host:port``): the replay socket is on port + 1, as
    ``ec_connector_extra_config``'s events ports are laid out (docs/events.md)."""
    spec = spec.strip()
    if "://" not in spec:
        spec = "tcp://" + spec
    head, _, port = spec.rpartition(":")
    if not head or not port.isdigit() or not 0 < int(port) < 65535:
        raise ConfigError(f"events endpoint {spec!r} is not tcp://host:port")
    return Source(spec, f"{head}:{int(port) + 1}")


@dataclass
class _Request:
    kind: str  # "snapshot" | "replay"
    start: int
    sent_at: float
    dealer: zmq.Socket
    got: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class _Peer:
    source: Source
    sub: zmq.Socket
    state: str = SYNCING
    epoch: str = ""
    seq: int = -1
    instance: str = ""
    last_heard: float = 0.0
    kept: list[tuple[int, S.EncoderEventBatch]] = field(default_factory=list)
    request: Optional[_Request] = None


class Subscriber:
    """Subscribe to ``sources`` and keep ``index`` equal to what they hold (see the module docstring).
    ``listener(kind, source, detail)`` hears every batch applied and every recovery step."""

    def __init__(self, sources: list[Source], index: Optional[EventIndex] = None, *, topic: str = "",
                 dead_after_s: float = 3.0, request_timeout_s: float = 1.0, max_kept: int = 10_000,
                 rcvhwm: int = 100_000, clock: Callable[[], float] = time.monotonic,
                 listener: Optional[Callable[[str, Source, Any], None]] = None):
        if not sources:
            raise ConfigError("an events subscriber needs at least one source")
        if not dead_after_s > 0 or not request_timeout_s > 0:
            raise ConfigError("dead_after_s and request_timeout_s must be > 0")
        self.index = index if index is not None else EventIndex()
        self.counters: collections.Counter = collections.Counter()
        self._clock, self._listener = clock, listener
        self._dead_after, self._timeout, self._max_kept = dead_after_s, request_timeout_s, max_kept
        self._ctx = zmq.Context.instance()
        self._peers: list[_Peer] = []
        now = clock()
        for src in sources:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, rcvhwm)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sub.connect(src.endpoint)
            peer = _Peer(src, sub, last_heard=now)
            self._peers.append(peer)
            self._ask(peer, "snapshot")

    # ------------------------------------------------------------- driving

    def poll(self, timeout_s: float = 0.0) -> int:
        """Handle what arrived (waiting up to ``timeout_s`` for something), then retry requests that
        went unanswered and drop sources not heard from; returns the messages handled."""
        poller = zmq.Poller()
        owner: dict[Any, tuple[_Peer, bool]] = {}
        for p in self._peers:
            poller.register(p.sub, zmq.POLLIN)
            owner[p.sub] = (p, False)
            if p.request is not None:
                poller.register(p.request.dealer, zmq.POLLIN)
                owner[p.request.dealer] = (p, True)
        handled = 0
        for sock, _ in poller.poll(int(max(0.0, timeout_s) * 1000)):
            peer, is_reply = owner[sock]
            while not sock.closed:  # drain the socket: one poll wakes for all that is there
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                handled += 1
                if is_reply:
                    if peer.request is None or peer.request.dealer is not sock:
                        break  # a request given up on meanwhile
                    self._on_reply(peer, frames)
                else:
                    self._on_message(peer, frames)
        self.tick()
        return handled

    def tick(self, now: Optional[float] = None) -> None:
        """Resend requests unanswered for ``request_timeout_s``; drop sources silent ``dead_after_s``."""
        now = self._clock() if now is None else now
        for p in self._peers:
            if p.state != DOWN and now - p.last_heard > self._dead_after:
                dropped = self.index.drop(p.source.endpoint)
                self._cancel(p)
                p.state, p.epoch, p.seq, p.kept = DOWN, "", -1, []
                self.counters["sources_lost"] += 1
                logger.warning("events: %s (%s) silent for %.1f s: its %d entries are dropped until it is heard again",
                               p.source.endpoint, p.instance or "?", now - p.last_heard, dropped)
                self._tell("lost", p, dropped)
            elif p.request is not None and now - p.request.sent_at > self._timeout:
                self.counters["request_retries"] += 1
                self._ask(p, p.request.kind, p.request.start)

    def close(self) -> None:
        for p in self._peers:
            self._cancel(p)
            p.sub.close(linger=0)

    # ------------------------------------------------------------- state

    def synced(self) -> bool:
        """Every source is live (its state applied up to the last batch it announced)."""
        return all(p.state == LIVE for p in self._peers)

    def status(self) -> list[dict]:
        now = self._clock()
        return [{"endpoint": p.source.endpoint, "instance": p.instance, "state": p.state, "seq": p.seq,
                 "epoch": p.epoch[:8], "silent_s": round(now - p.last_heard, 3)} for p in self._peers]

    # ------------------------------------------------------------- messages

    def _bad(self, peer: _Peer, why: str) -> None:
        self.counters["bad_messages"] += 1
        n = self.counters["bad_messages"]
        if n <= 10 or n % 1000 == 0:
            logger.warning("events: malformed message from %s (%d so far): %s", peer.source.endpoint, n, why)
        self._tell("bad", peer, why)

    def _on_message(self, peer: _Peer, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise S.BadEvent(f"expected 3 frames (topic, seq, batch), got {len(frames)}")
            seq = S.parse_seq(frames[1])
            batch = S.decode_batch(frames[2])
        except S.BadEvent as e:
            return self._bad(peer, str(e))
        peer.last_heard = self._clock()
        self.counters["messages"] += 1
        if peer.state == DOWN:
            logger.info("events: %s heard again: asking for a snapshot", peer.source.endpoint)
            self._ask(peer, "snapshot")
        if peer.state != LIVE:
            return self._keep(peer, seq, batch)
        self._live(peer, seq, batch)

    def _keep(self, peer: _Peer, seq: int, batch: S.EncoderEventBatch) -> None:
        if len(peer.kept) >= self._max_kept:  # the sync will see the gap this leaves and replay it
            peer.kept.clear()
            self.counters["kept_overflows"] += 1
        peer.kept.append((seq, batch))

    def _live(self, peer: _Peer, seq: int, batch: S.EncoderEventBatch) -> None:
        if batch.epoch != peer.epoch:
            self.counters["resets"] += 1
            logger.info("events: %s restarted (epoch %s -> %s, seq %d -> %d): its entries are dropped, asking for "
                        "a snapshot", peer.source.endpoint, peer.epoch[:8], batch.epoch[:8], peer.seq, seq)
            self.index.drop(peer.source.endpoint)
            peer.epoch, peer.seq = "", -1
            self._tell("reset", peer, seq)
            self._ask(peer, "snapshot")
            return self._keep(peer, seq, batch)
        heartbeat = not batch.events
        if seq <= peer.seq:
            return  # a heartbeat, or a batch a replay gave already
        if seq == peer.seq + 1 and not heartbeat:
            self._apply(peer, seq, batch)
            return
        self.counters["gaps"] += 1
        self._tell("gap", peer, (peer.seq, seq))
        self._ask(peer, "replay", peer.seq + 1)
        if not heartbeat:
            self._keep(peer, seq, batch)

    def _apply(self, peer: _Peer, seq: int, batch: S.EncoderEventBatch) -> None:
        peer.instance = batch.instance
        self.index.apply(peer.source.endpoint, batch.instance, batch.events)
        peer.seq = seq
        self.counters["batches"] += 1
        self.counters["events"] += len(batch.events)
        self._tell("batch", peer, (seq, batch))

    def _drain_kept(self, peer: _Peer) -> None:
        """Apply what was kept while the source was not live, in order (this may find a gap)."""
        peer.state = LIVE
        kept, peer.kept = sorted(peer.kept, key=lambda kb: kb[0]), []
        for i, (seq, batch) in enumerate(kept):
            self._live(peer, seq, batch)
            if peer.state != LIVE:
                peer.kept.extend(kept[i + 1:])
                return

    # ------------------------------------------------------------- replay and snapshot

    def _ask(self, peer: _Peer, kind: str, start: int = 0) -> None:
        self._cancel(peer)
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.connect(peer.source.replay)
        dealer.send_multipart((b"", S.SNAPSHOT_REQUEST if kind == "snapshot" else S.seq_bytes(start)),
                              flags=zmq.NOBLOCK)
        peer.request = _Request(kind, start, self._clock(), dealer)
        peer.state = SYNCING if kind == "snapshot" else REPLAYING
        self.counters[f"{kind}_requests"] += 1

    def _cancel(self, peer: _Peer) -> None:
        if peer.request is not None:
            peer.request.dealer.close(linger=0)
            peer.request = None

    def _on_reply(self, peer: _Peer, frames: list[bytes]) -> None:
        req = peer.request
        assert req is not None
        try:
            if len(frames) != 4 or frames[0] != b"":
                raise S.BadEvent(f"expected 4 reply frames (empty, topic, seq, payload), got {len(frames)}")
            seq = S.parse_seq(frames[2])
        except S.BadEvent as e:
            return self._bad(peer, str(e))
        peer.last_heard = self._clock()
        if seq != -1:
            req.got.append((seq, frames[3]))
            return
        self._cancel(peer)
        if frames[3]:
            self.counters["request_errors"] += 1
            logger.warning("events: %s refused the %s request: %s", peer.source.endpoint, req.kind,
                           frames[3][:300].decode(errors="replace"))
            return self._retry_later(peer, req)
        if req.kind == "snapshot":
            self._take_snapshot(peer, req)
        else:
            self._take_replay(peer, req)

    def _retry_later(self, peer: _Peer, req: _Request) -> None:
        """Keep the request open without a socket: ``tick`` asks again after ``request_timeout_s``."""
        dealer = self._ctx.socket(zmq.DEALER)  # never connected: nothing arrives on it
        dealer.setsockopt(zmq.LINGER, 0)
        peer.request = _Request(req.kind, req.start, self._clock(), dealer)

    def _take_snapshot(self, peer: _Peer, req: _Request) -> None:
        try:
            if len(req.got) != 1:
                raise S.BadEvent(f"a snapshot answer has one message, got {len(req.got)}")
            snap = S.decode_snapshot(req.got[0][1])
        except S.BadEvent as e:
            self._bad(peer, str(e))
            return self._retry_later(peer, req)
        self.index.replace(peer.source.endpoint, snap.instance, snap.entries)
        peer.epoch, peer.seq, peer.instance = snap.epoch, snap.seq, snap.instance
        peer.kept = [(s, b) for s, b in peer.kept if b.epoch == snap.epoch]  # (a later restart shows again)
        self.counters["snapshots"] += 1
        self._tell("snapshot", peer, snap)
        self._drain_kept(peer)

    def _take_replay(self, peer: _Peer, req: _Request) -> None:
        batches = []
        try:
            for seq, payload in req.got:
                batches.append((seq, S.decode_batch(payload)))
        except S.BadEvent as e:
            self._bad(peer, str(e))
            return self._ask(peer, "snapshot")
        want = req.start
        if not batches or batches[0][0] != want or any(b.epoch != peer.epoch for _, b in batches) \
                or any(s != want + i for i, (s, _) in enumerate(batches)):
            # the publisher's buffer no longer has them (or it restarted): start from its state
            self.counters["replays_short"] += 1
            return self._ask(peer, "snapshot")
        for seq, batch in batches:
            if seq > peer.seq:
                self._apply(peer, seq, batch)
        self.counters["replays"] += 1
        self._drain_kept(peer)

    def _tell(self, kind: str, peer: _Peer, detail: Any) -> None:
        if self._listener is not None:
            self._listener(kind, peer.source, detail)


class SubscriberThread:
    """Runs a ``Subscriber`` in a thread of its own (the proxy's); readers use ``index``."""

    def __init__(self, subscriber: Subscriber, poll_s: float = 0.25):
        self.subscriber, self.index = subscriber, subscriber.index
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ec-nixl-events-sub", daemon=True)

    def start(self) -> "SubscriberThread":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.subscriber.poll(self._poll_s)
        finally:
            self.subscriber.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
