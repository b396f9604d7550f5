"""Serving items: the producer side of an endpoint.

``publish`` pins encoder outputs in the registered pool (one pack per step, or zero-copy when
written in place). Consumers that completed the handshake (``_on_hello``: version, compat hash,
HMAC, nonce bound to the connection) then ``Hold`` items (lease + where), ``Get`` them (a pinned
READ grant) or ``Push`` them (we WRITE into their reservation, one request per consumer and
reader). Items are freed when every reader of every group that held them is done, or when their
lease ends.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Optional

import torch
import zmq

from ec_nixl import protocol as P
from ec_nixl.errors import ConfigError, ECNixlError, ProtocolError, TransferFailed
from ec_nixl.pool import Fence, Slot
from ec_nixl.tensors import Both, describe, dtype_name
from ec_nixl.transport import Peer, Xfer

logger = logging.getLogger("ec_nixl")

_MAX_HELLO_NONCES = 1 << 16  # handshakes remembered against replay


class _Push:
    __slots__ = ("session", "reader", "block", "nbytes", "req", "xfer", "state")

    def __init__(self, session: str, reader: int, block: int, nbytes: int, req: int):
        self.session = session
        self.reader = reader
        self.block = block
        self.nbytes = nbytes
        self.req = req
        self.xfer: Optional[Xfer] = None
        self.state = "queued"  # queued | posted


class _Item:
    __slots__ = ("desc", "slot", "ready", "expires_at", "interest", "done", "pins", "pushes", "held",
                 "t_pub")

    def __init__(self, desc: P.ItemDesc, slot: Slot, ready: Optional[Fence], lease_s: float):
        self.desc = desc
        self.slot = slot
        self.ready = ready
        self.t_pub = time.monotonic()
        self.expires_at = self.t_pub + lease_s
        self.interest: dict[str, int] = {}  # consumer group -> readers expected
        self.done: dict[str, set[int]] = {}  # consumer group -> readers that finished
        self.pins: dict[tuple[str, int], float] = {}  # (session, reader) -> pin expiry
        self.pushes: dict[tuple[str, int], _Push] = {}
        self.held = False

    def is_ready(self) -> bool:
        if self.ready is None:
            return True
        if self.ready.query():
            self.ready = None
            return True
        return False

    def satisfied(self) -> bool:
        """Every group that declared interest has had all its readers read the item."""
        return bool(self.interest) and all(
            len(self.done.get(s, ())) >= n for s, n in self.interest.items()
        )

    def busy(self) -> bool:
        return bool(self.pins or self.pushes)


class _Session:
    __slots__ = ("id", "identity", "name", "peer", "last_seen", "arena", "group", "observer", "used", "welcome")

    def __init__(self, sid: str, identity: bytes, name: str, peer: Optional[Peer], arena, group: str,
                 observer: bool = False):
        self.id = sid
        self.observer = observer  # may only read statistics
        self.group = group or sid
        self.identity = identity
        self.name = name
        self.peer = peer
        self.arena = arena
        self.last_seen = time.monotonic()
        self.used = False  # a request came on it (so the consumer kept this connection)
        self.welcome: Optional[P.Welcome] = None  # our answer, repeated to a resent Hello


class Server:
    """The producer half of ``Endpoint`` (a mixin: the state lives in ``Endpoint.__init__``).

    Public calls (any thread): ``publish``/``publish_many``, ``reserve``/``publish_slot``,
    ``unpublish``, ``published``; requests are served on the owner thread. Only peers that
    completed the handshake get anything; an item's slot is freed only when no grant or push
    still uses it.
    """

    def publish(self, mm_hash: str, tensor: torch.Tensor, ready: Optional[Fence] = None) -> P.ItemDesc:
        """Pin ``tensor`` for transfer under ``mm_hash``; returns its description (see ``publish_many``)."""
        return self.publish_many([(mm_hash, tensor)], ready)[0]

    def publish_many(self, items: list[tuple[str, torch.Tensor]], ready: Optional[Fence] = None) -> list[P.ItemDesc]:
        """Pin a step's encoder outputs for transfer; returns their descriptions.

        A tensor that starts a pool slot (written there through ``reserve()``) is adopted as is,
        taking a hold on its slot. All others are copied into new slots by ONE ``native.pack``
        (a single kernel launch on CUDA, on the current stream, guarded by one event: the copy
        never blocks the host), each counted as a staging copy. Publishing a hash that is already
        published only renews its lease. On error nothing of the batch stays allocated.
        """
        pool = self._need_pool()
        evict = self._evict if self.cfg.evict_unclaimed else None
        descs: list[P.ItemDesc] = []
        copies: list[tuple[P.ItemDesc, Slot, torch.Tensor]] = []
        seen: dict[str, P.ItemDesc] = {}
        try:
            for mm_hash, tensor in items:
                if mm_hash in seen:
                    descs.append(seen[mm_hash])
                    continue
                desc = describe(mm_hash, tensor)
                P.validate_item(desc)
                with self._lock:
                    item = self._items.get(mm_hash)
                    if item is not None:
                        item.expires_at = max(item.expires_at, time.monotonic() + self.cfg.announce_lease_s)
                        desc = item.desc
                if item is None:
                    if tensor.device != pool.arena.device:
                        raise ConfigError(f"item {mm_hash} is on {tensor.device}, the pool on {pool.arena.device}")
                    tensor = tensor.contiguous()
                    slot = pool.slot_at(tensor.data_ptr()) if pool.arena.contains(tensor) else None
                    if slot is not None:  # written straight into the pool (see reserve()): no copy
                        pool.hold(slot)
                        self._add_item(desc, slot, ready)
                    else:
                        slot = pool.allocate(desc.nbytes, tag=mm_hash, evict=evict)
                        copies.append((desc, slot, tensor.reshape(-1).view(torch.uint8)))
                seen[mm_hash] = desc
                descs.append(desc)
            if copies:
                from ec_nixl import native

                native.pack([c[2] for c in copies], pool.arena.bytes, [c[1].offset for c in copies])
                fence = ready
                if pool.arena.device.type == "cuda":
                    ev = torch.cuda.Event()
                    ev.record()
                    fence = Both(ready, ev) if ready is not None else ev
        except Exception:
            for _, slot, _ in copies:
                pool.release(slot)
            raise
        for desc, slot, _ in copies:
            self._add_item(desc, slot, fence)
            self.metrics.count("staging_copies")
            self.metrics.count("staging_bytes", desc.nbytes)
        return descs

    def reserve(self, nbytes: int, tag: str = "") -> Slot:
        """A pool slot to write an item into directly (zero-copy publish with ``publish_slot``)."""
        return self._need_pool().allocate(nbytes, tag=tag,
                                          evict=self._evict if self.cfg.evict_unclaimed else None)

    def publish_slot(self, mm_hash: str, slot: Slot, shape, dtype: torch.dtype,
                     ready: Optional[Fence] = None) -> P.ItemDesc:
        """Publish bytes already written (or being written: ``ready``) into ``slot``; no copy."""
        desc = P.ItemDesc(mm_hash=mm_hash, shape=list(shape), dtype=dtype_name(dtype),
                          nbytes=int(torch.Size(shape).numel()) * P.DTYPE_SIZES[dtype_name(dtype)])
        P.validate_item(desc)
        if desc.nbytes > slot.nblocks * self._need_pool().block_size:
            raise ProtocolError(f"item {mm_hash} of {desc.nbytes} B does not fit its slot of {slot.nbytes} B")
        with self._lock:
            if mm_hash in self._items:
                raise ProtocolError(f"item {mm_hash} is already published")
        self._add_item(desc, slot, ready)
        return desc

    def unpublish(self, mm_hash: str) -> bool:
        """Drop an item now unless a transfer is using it (then it goes when that ends)."""
        with self._lock:
            item = self._items.get(mm_hash)
            if item is None:
                return False
            item.expires_at = 0.0
            item.interest.clear()
            if item.busy():
                return True
            del self._items[mm_hash]
        self._need_pool().release(item.slot)
        return True

    def published(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def _add_item(self, desc: P.ItemDesc, slot: Slot, ready: Optional[Fence]) -> None:
        with self._lock:
            self._items[desc.mm_hash] = _Item(desc, slot, ready, self.cfg.announce_lease_s)
        self.metrics.count("published")

    def _evict(self, nbytes: int) -> int:
        """Drop published items nobody has held or pinned, oldest first, until ``nbytes`` fit."""
        freed = 0
        victims = []
        with self._lock:
            for h, item in sorted(self._items.items(), key=lambda kv: kv[1].t_pub):
                if freed >= nbytes:
                    break
                if not item.held and not item.busy():
                    victims.append(item)
                    freed += item.slot.nblocks * self._need_pool().block_size
                    del self._items[h]
        for item in victims:
            logger.info("evicting unclaimed item %s (%d B) to make room", item.desc.mm_hash, item.desc.nbytes)
            self._need_pool().release(item.slot)
        return len(victims)

    def _serve_some(self) -> None:
        self._last_activity = time.monotonic()
        for _ in range(256):
            try:
                identity, data = self._server.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                return
            except ValueError:
                continue  # a frame count we never send: ignore
            try:
                msg = P.decode(data)
            except ECNixlError as e:
                self.metrics.fail("BAD_MESSAGE")
                self._reply(identity, P.Refused(reason=P.Nack.BAD_REQUEST.value, detail=str(e)))
                continue
            try:
                self._on_request(identity, msg)
            except ECNixlError as e:
                self._reply(identity, P.Refused(reason=P.Nack.BAD_REQUEST.value, detail=str(e),
                                                req=getattr(msg, "req", 0)))
            except Exception as e:  # never let one request take the server down
                logger.exception("ec-nixl: request %s failed", type(msg).__name__)
                self._reply(identity, P.Refused(reason=P.Nack.INTERNAL.value, detail=repr(e),
                                                req=getattr(msg, "req", 0)))

    def _reply(self, identity: bytes, msg) -> None:
        try:
            self._server.send_multipart([identity, P.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("reply to %r dropped: %s", identity, e)

    def _session(self, identity: bytes, sid: str, req: int) -> Optional[_Session]:
        s = self._sessions.get(sid)
        if s is None or s.identity != identity:
            self.metrics.fail(P.Nack.UNKNOWN_SESSION.value)
            self._reply(identity, P.Refused(reason=P.Nack.UNKNOWN_SESSION.value,
                                            detail="no handshake for this session", req=req))
            return None
        s.last_seen = time.monotonic()
        if not s.used:
            s.used = True
            # A consumer agent uses one session with us at a time: the first request on a new one
            # means its older ones were lost, or belong to its previous incarnation (a restarted
            # process: agent names are unique). Their pins and interest go now, not at lease end.
            # Not at Hello: Hellos of connections it already gave up may still be queued here.
            # Its NIXL peer stays: add_peer already replaced an older incarnation's metadata.
            for o in [o for o in self._sessions.values() if o is not s and o.name == s.name
                      and o.peer is not None and s.peer is not None]:
                self._end_session(o, keep_peer=True)
        return s

    def _on_request(self, identity: bytes, msg) -> None:
        if isinstance(msg, P.Hello):
            return self._on_hello(identity, msg)
        sid = getattr(msg, "session", None)
        if sid is None:
            raise ProtocolError(f"{type(msg).__name__} is not a request")
        s = self._session(identity, sid, getattr(msg, "req", 0))
        if s is None:
            return
        if s.observer and not isinstance(msg, (P.Stats, P.Heartbeat, P.Bye)):
            self.metrics.fail(P.Nack.UNAUTHORIZED.value)
            return self._reply(identity, P.Refused(reason=P.Nack.UNAUTHORIZED.value, req=getattr(msg, "req", 0),
                                                   detail="an observer session may only read statistics"))
        if isinstance(msg, (P.Hold, P.Get)):
            return self._on_hold_or_get(identity, s, msg)
        if isinstance(msg, P.Push):
            return self._on_push(identity, s, msg)
        if isinstance(msg, P.Cancel):
            return self._on_cancel(identity, s, msg)
        if isinstance(msg, P.Stats):
            return self._reply(identity, P.StatsReply(req=msg.req, stats=self.stats()))
        if isinstance(msg, P.Heartbeat):
            return self._reply(identity, P.Heartbeat(session=sid))
        if isinstance(msg, P.Bye):
            return self._end_session(s)
        raise ProtocolError(f"unexpected {type(msg).__name__} from a consumer")

    def _on_hello(self, identity: bytes, msg: P.Hello) -> None:
        logger.debug("hello from %s (%s)", msg.name, "data" if msg.agent_md is not None else "control")
        def refuse(reason: P.Nack, detail: str):
            self.metrics.fail(reason.value)
            logger.warning("ec-nixl: refused %s (%s): %s", msg.name, reason.value, detail)
            self._reply(identity, P.Refused(reason=reason.value, detail=detail))

        if not P.verify(msg, self._token):
            return refuse(P.Nack.UNAUTHORIZED, "handshake not signed with the shared token")
        # A signed Hello proves the token only once: the same nonce from another connection is a
        # replay (its session would act for the real consumer's NIXL agent). Resends come from the
        # same connection and pass. The memory of nonces is bounded (oldest forgotten first).
        first, sid = self._hello_nonces.setdefault(msg.nonce, (identity, None))
        if len(self._hello_nonces) > _MAX_HELLO_NONCES:
            self._hello_nonces.popitem(last=False)
        if first != identity:
            return refuse(P.Nack.UNAUTHORIZED, "replayed handshake (its nonce came from another connection)")
        # A consumer resends its Hello until it hears from us (its first may have been dropped
        # before the connection was up; a starved producer may find dozens queued). Each resend
        # gets the same session: one session and one NIXL peer per handshake, however many copies.
        s = self._sessions.get(sid) if sid is not None else None
        if s is not None and s.welcome is not None:
            return self._reply(identity, s.welcome)
        if msg.version != P.PROTOCOL_VERSION:
            return refuse(P.Nack.VERSION, f"protocol {msg.version} != {P.PROTOCOL_VERSION}")
        observer = msg.compat == "" and msg.agent_md is None
        if msg.compat != self.compat and not observer:
            return refuse(P.Nack.INCOMPAT, f"compat hash {msg.compat} != {self.compat} "
                          f"(model/dtype/width/block differ)")
        peer = None
        if msg.agent_md is not None and msg.arena is not None and self.transport is not None:
            try:
                peer = self.transport.add_peer(msg.agent_md, msg.arena, msg.incarnation, msg.name)
            except Exception as e:
                return refuse(P.Nack.INCOMPAT, f"cannot add NIXL peer: {e}")
        sid = secrets.token_hex(8)
        session = self._sessions[sid] = _Session(sid, identity, msg.name, peer, msg.arena, msg.group, observer)
        self._hello_nonces[msg.nonce] = (identity, sid)
        w = P.Welcome(version=P.PROTOCOL_VERSION, compat=self.compat, name=self.cfg.name,
                      incarnation=self.incarnation, session=sid, nonce=P.new_nonce(),
                      agent_md=self.transport.metadata if self.transport else None,
                      arena=self.transport.arena_info if self.transport else None)
        P.sign(w, self._token, msg.nonce)
        session.welcome = w
        self._reply(identity, w)

    def _on_hold_or_get(self, identity: bytes, s: _Session, msg) -> None:
        pin = isinstance(msg, P.Get)
        readers = max(1, min(int(msg.readers), 1024))
        now = time.monotonic()
        out = []
        with self._lock:
            for h in msg.mm_hashes:
                item = self._items.get(h)
                if item is None or item.expires_at <= 0.0:
                    out.append(P.ItemState(mm_hash=h, status=P.Nack.MISSING.value,
                                           detail=f"{self.cfg.name} does not hold {h}"))
                    continue
                item.held = True
                item.interest[s.group] = max(item.interest.get(s.group, 1), readers)
                item.expires_at = max(item.expires_at, now + self.cfg.announce_lease_s)
                if not item.is_ready():
                    out.append(P.ItemState(mm_hash=h, status=P.Nack.NOT_READY.value, detail="still being written"))
                    continue
                if pin:
                    item.pins[(s.id, msg.reader)] = now + self.cfg.grant_lease_s
                d = item.desc
                out.append(P.ItemState(mm_hash=h, status="ready", block=item.slot.block, nbytes=d.nbytes,
                                       shape=d.shape, dtype=d.dtype, lease_s=item.expires_at - now))
        self._reply(identity, P.Grant(req=msg.req, items=out))

    def _on_push(self, identity: bytes, s: _Session, msg: P.Push) -> None:
        if s.peer is None:
            raise ProtocolError("a control-only session cannot receive pushes")
        failed = []
        with self._lock:
            for it in msg.items:
                item = self._items.get(it.mm_hash)
                if item is None or item.expires_at <= 0.0:
                    failed.append(P.ItemState(mm_hash=it.mm_hash, status=P.Nack.MISSING.value,
                                              detail=f"{self.cfg.name} does not hold {it.mm_hash}"))
                    continue
                n = P.blocks_for(item.desc.nbytes, s.arena.block)
                if it.nbytes != item.desc.nbytes:
                    failed.append(P.ItemState(mm_hash=it.mm_hash, status=P.Nack.BAD_REQUEST.value,
                                              detail=f"asked for {it.nbytes} B, item has {item.desc.nbytes} B"))
                    continue
                if it.block < 0 or (it.block + n) * s.arena.block > s.arena.size:
                    failed.append(P.ItemState(mm_hash=it.mm_hash, status=P.Nack.BAD_REQUEST.value,
                                              detail=f"destination block {it.block} outside your arena"))
                    continue
                item.held = True
                item.interest[s.group] = max(item.interest.get(s.group, 1), max(1, msg.readers))
                item.expires_at = max(item.expires_at, time.monotonic() + self.cfg.announce_lease_s)
                push = _Push(s.id, msg.reader, it.block, item.desc.nbytes, msg.req)
                old = item.pushes.get((s.id, msg.reader))
                if old is not None and old.state == "posted":
                    failed.append(P.ItemState(mm_hash=it.mm_hash, status=P.Nack.BUSY.value,
                                              detail="a push to this reader is still in flight"))
                    continue
                item.pushes[(s.id, msg.reader)] = push
                self._active_pushes.append((item, push))
        if failed:
            self._reply(identity, P.PushFailed(req=msg.req, items=failed))
        self._poll_pushes()

    def _poll_pushes(self) -> None:
        """Post queued pushes whose item is ready (one WRITE per consumer session and reader,
        carrying every ready item); finish the ones NIXL reports done."""
        groups: dict[tuple[str, int], list[tuple[_Item, _Push]]] = {}
        for item, push in self._active_pushes:
            if push.state == "queued" and item.pushes.get((push.session, push.reader)) is push \
                    and push.session in self._sessions and item.is_ready():
                groups.setdefault((push.session, push.reader), []).append((item, push))
        for (sid, reader), batch in groups.items():
            s = self._sessions[sid]
            notif = P.encode_notif(P.NOTIF_WRITE_DONE, sid, [it.desc.mm_hash for it, _ in batch], reader)
            try:
                x = self.transport.post_many("WRITE", s.peer, [(it.slot.block, p.block, it.slot.nblocks)
                                                               for it, p in batch], notif)
            except TransferFailed as e:
                for it, p in batch:
                    self._push_failed(s, it, p, str(e))
                continue
            for _, p in batch:
                p.xfer, p.state = x, "posted"
        still = []
        for item, push in self._active_pushes:
            s = self._sessions.get(push.session)
            if item.pushes.get((push.session, push.reader)) is not push:
                continue  # cancelled, failed or done
            if s is None:
                self._end_push(item, push, ok=False)
                continue
            if push.state == "queued":
                still.append((item, push))
                continue
            x = push.xfer
            st = self.transport.poll(x)
            if st == "PROC":
                still.append((item, push))
            elif st == "DONE":
                if not x.released:
                    tel = self.transport.telemetry(x)
                    self.transport.release(x)
                    if tel is not None:
                        self.metrics.transfer(x.nbytes, tel[0] * 1e-6, tel[1] * 1e-6, tel[3])
                self._end_push(item, push, ok=True)
            else:
                if not x.released:
                    self.metrics.count("failed_transfers")
                if not self.transport.release(x):
                    still.append((item, push))  # keep polling until NIXL lets it go
                    continue
                self._push_failed(s, item, push, f"WRITE to {s.name} failed (NIXL ERR)")
        self._active_pushes = still

    def _push_failed(self, s: _Session, item: _Item, push: _Push, detail: str) -> None:
        self._end_push(item, push, ok=False)
        try:
            self._server.send_multipart([s.identity, P.encode(P.PushFailed(req=push.req, items=[
                P.ItemState(mm_hash=item.desc.mm_hash, status="XFER_ERR", detail=detail)]))], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _end_push(self, item: _Item, push: _Push, ok: bool) -> None:
        with self._lock:
            item.pushes.pop((push.session, push.reader), None)
            s = self._sessions.get(push.session)
            if ok and s is not None:
                item.done.setdefault(s.group, set()).add(push.reader)
        self._maybe_free(item)

    def _on_cancel(self, identity: bytes, s: _Session, msg: P.Cancel) -> None:
        safe, in_flight = [], []
        with self._lock:
            for h in msg.mm_hashes:
                item = self._items.get(h)
                pushes = [] if item is None else [p for k, p in item.pushes.items() if k[0] == s.id]
                busy = False
                for p in pushes:
                    if p.state == "posted" and p.xfer is not None and self.transport.poll(p.xfer) == "PROC" \
                            and not self.transport.release(p.xfer):
                        busy = True
                        continue
                    item.pushes.pop((s.id, p.reader), None)
                (in_flight if busy else safe).append(h)
        self._reply(identity, P.CancelAck(req=msg.req, safe=safe, in_flight=in_flight))

    def _maybe_free(self, item: _Item) -> None:
        with self._lock:
            if item.busy():
                return
            gone = item.expires_at <= 0.0 or (self.cfg.free_when_consumed and item.satisfied())
            if not gone or self._items.get(item.desc.mm_hash) is not item:
                return
            del self._items[item.desc.mm_hash]
        self.pool.release(item.slot)

    def _end_session(self, s: _Session, keep_peer: bool = False) -> None:
        self._sessions.pop(s.id, None)
        group_left = any(o.group == s.group for o in self._sessions.values())
        with self._lock:
            items = list(self._items.values())
            for item in items:
                if not group_left:
                    item.interest.pop(s.group, None)
                for k in [k for k in item.pins if k[0] == s.id]:
                    del item.pins[k]
        for item in items:
            self._maybe_free(item)
        if s.peer is not None and not keep_peer and not any(o.name == s.name for o in self._sessions.values()):
            self.transport.forget_peer(s.name)

    def _expire_items(self, now: float) -> None:
        expired = []
        with self._lock:
            for item in self._items.values():
                for k, until in list(item.pins.items()):
                    if now >= until:
                        del item.pins[k]
                        self.metrics.count("expired_pins")
                if now >= item.expires_at and not item.busy():
                    expired.append(item)
            for item in expired:
                del self._items[item.desc.mm_hash]
        for item in expired:
            if not item.satisfied():
                self.metrics.count("expired_leases")
                logger.info("ec-nixl: lease of %s expired unread", item.desc.mm_hash)
            self.pool.release(item.slot)

    def _on_read_done(self, agent: str, sid: str, mm_hashes: list[str], reader: int) -> None:
        """A consumer's reader finished READing these items: free each once all readers did."""
        s = self._sessions.get(sid)
        if s is None or s.name != agent:
            return  # not a session of ours (or a forged one): ignore
        for mm_hash in mm_hashes:
            with self._lock:
                item = self._items.get(mm_hash)
                if item is None:
                    continue
                item.pins.pop((sid, reader), None)
                item.done.setdefault(s.group, set()).add(reader)
            self._maybe_free(item)
