"""Serving items: the producer's control plane.

A ZMQ ROUTER socket answers consumers. Only a peer that completed the handshake (signed
``Hello``, nonce bound to its connection, compatible hash, NIXL metadata that matches its
length and digest and names an agent we can load: see ``handshake``) gets a session;
every other request is refused with the reason. On a session a consumer may ``Hold`` items
(lease + where they are, so it can READ at once), ``Get`` them (a pinned READ grant), ``Push``
them (we WRITE into its slots: see ``pusher``), ``Cancel`` pushes, read ``Stats``, send
``Heartbeat``s, report ``ReadDone`` and say ``Bye``. Items live in the table (``published``); the server only decides
who may do what with them. One bad request is refused with its reason and never takes the
server down.

A Hold or Get that may wait (``wait_s``: the consumer got the request before our encoder
finished it) is parked while any of its items is missing or still being written, and answered
the moment the last one is published and ready or when its wait runs out: the consumer's READ
starts as soon as the bytes exist, with no polling between. A Push that may wait is parked for its
items not published yet, and its WRITEs start at their publish (no round trip after it); a Cancel
takes a parked push out before it ever writes. Where the native hand-off is on, the publish itself
sends those answers and starts those WRITEs, and this loop only settles them afterwards
(``parked``: which waiting requests need the loop at a publish).

A consumer that goes away loses its sessions within a bounded time: ZMQ pings every connection
from its own I/O thread (``handshake.keep_alive``) and drops one that answers nothing for
``link_timeout_s`` (a stopped or hung process; a killed one closes at once). A socket monitor
reports each dropped connection, the file descriptor every request arrived on says whose it was,
and a probe (a send that ZMQ refuses once the peer's route is gone) confirms it before the
sessions end: their pins, pushes and interest go, and what only they held is freed soon after.
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
from typing import Callable, Optional

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from ec_nixl import epd_control, handshake
from ec_nixl import protocol as P
from ec_nixl.config import EndpointConfig, split_address
from ec_nixl.errors import ConfigError, ECNixlError, ProtocolError
from ec_nixl.handshake import Identity, Session
from ec_nixl.loop import OwnerLoop
from ec_nixl.metrics import Metrics
from ec_nixl.native_answers import close_answer_socket, open_answer_socket
from ec_nixl.parked import Parked, Waiting
from ec_nixl.published import Published
from ec_nixl.pusher import Pusher
from ec_nixl.transport import Transport

logger = logging.getLogger("ec_nixl")

_MAX_HELLO_NONCES = 1 << 16  # handshakes remembered against replay
_PROBES_S = (0.0, 0.02, 0.1, 0.5, 2.0)
"""When to probe a consumer after its connection dropped: ZMQ removes the route a little later."""


def _readers(msg) -> int:
    """A Hold's or Get's reader count, within the bounds the table accepts."""
    return max(1, min(int(msg.readers), 1024))


def _all_ready(items: list[P.ItemState]) -> bool:
    return all(st.status == "ready" for st in items)


def _wait_of(msg) -> float:
    """How long a request may wait for its items, bounded (0 for none, NaN or negative)."""
    wait = float(getattr(msg, "wait_s", 0.0) or 0.0)
    return min(wait, P.MAX_HOLD_WAIT_S) if wait > 0 else 0.0


class Server:
    """The producer's ROUTER socket and sessions (owner thread only)."""

    def __init__(self, cfg: EndpointConfig, me: Identity, loop: OwnerLoop, metrics: Metrics,
                 published: Optional[Published], transport: Optional[Transport],
                 stats: Callable[[], dict], on_activity: Callable[[], None]):
        self.cfg, self.me, self.metrics, self.published, self.transport = cfg, me, metrics, published, transport
        self._stats, self._on_activity, self._loop = stats, on_activity, loop
        self._sessions: dict[str, Session] = {}
        self._hello_nonces: collections.OrderedDict[bytes, tuple[bytes, Optional[str]]] = collections.OrderedDict()
        host, port = split_address(cfg.listen, allow_any_port=True)
        ctx = zmq.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        handshake.keep_alive(self._sock, cfg)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._fd_of: dict[bytes, int] = {}  # consumer identity -> connection its last request came on
        self._suspects: dict[bytes, list[float]] = {}  # identity -> when to probe it (connection dropped)
        self.parked = Parked()  # Holds, Gets and Pushes waiting for their items
        try:
            if port == 0:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            loop.close_socket(self._sock, self._monitor)
            raise ConfigError(f"cannot listen on {cfg.listen}: {e}") from None
        self.address = cfg.advertise or f"{host}:{port}"
        self.port = port
        # the socket the publish's native answers go out on (native_answers), and its 'host:port'
        self._answer_sock, self.answers = open_answer_socket(ctx, host, cfg.answer_port, split_address(self.address)[0],
                                                             published)
        self.on_cancel: Optional[Callable[[str], tuple[bool, str]]] = None
        """A consumer's answer to vLLM EPD's ``cancel`` (transfer id -> whether it was ours, detail)."""
        self.pusher = Pusher(published, transport, metrics, loop, self._sessions.get, self.reply) \
            if published is not None and transport is not None else None
        self._handoff = transport.handoff if transport is not None and published is not None else None
        loop.add_socket(self._sock, self._serve_some)
        loop.add_socket(self._monitor, self._on_monitor)
        if self._handoff is not None:  # a native WRITE or answer ended: settle it now
            loop.add_socket(self._handoff.done_fd, self._on_native_done)
        loop.every_tick(self._tick)
        loop.idle_hint(self.parked.idle_hint)

    def __len__(self) -> int:
        return len(self._sessions)

    def names(self) -> dict[str, str]:
        """Session id -> consumer name, group and kind (for status output)."""
        return {sid: f"{s.name} (group {s.group}{', observer' if s.observer else ''})"
                for sid, s in self._sessions.items()}

    def session(self, sid: str) -> Optional[Session]:
        return self._sessions.get(sid)

    def reply(self, identity: bytes, msg) -> None:
        self._send([identity, P.encode(msg)])

    def _send(self, frames: list[bytes]) -> None:
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("reply to %r dropped: %s", frames[0], e)

    def close(self) -> None:
        self._loop.close_socket(self._sock, self._monitor)
        if self._handoff is not None:
            self._loop.remove_socket(self._handoff.done_fd)
        if self._answer_sock is not None:
            close_answer_socket(self._answer_sock, self.published)
            self._answer_sock = None

    # --- requests --------------------------------------------------------------------

    def _serve_some(self) -> None:
        self._on_activity()
        for _ in range(256):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue  # a frame count we never send: ignore
            if len(frames) == 3 and not frames[1].bytes:  # a ZMQ REQ peer: vLLM's EPD control requests
                self._send([frames[0].bytes, b"", epd_control.answer(frames[2].bytes, self.port, self.on_cancel)])
                continue
            identity, data = frames[0].bytes, frames[1].bytes
            self._seen_on(identity, frames[1])
            try:
                msg = P.decode(data)
            except ECNixlError as e:
                self.metrics.fail("BAD_MESSAGE")
                self.reply(identity, P.Refused(reason=P.Nack.BAD_REQUEST.value, detail=str(e)))
                continue
            try:
                self._on_request(identity, msg)
            except ECNixlError as e:
                self.reply(identity, P.Refused(reason=P.Nack.BAD_REQUEST.value, detail=str(e),
                                               req=getattr(msg, "req", 0)))
            except Exception as e:  # never let one request take the server down
                logger.exception("ec-nixl: request %s failed", type(msg).__name__)
                self.reply(identity, P.Refused(reason=P.Nack.INTERNAL.value, detail=repr(e),
                                               req=getattr(msg, "req", 0)))

    def _refuse(self, identity: bytes, reason: P.Nack, detail: str, req: int = 0) -> None:
        self.metrics.fail(reason.value)
        self.reply(identity, P.Refused(reason=reason.value, detail=detail, req=req))

    def _on_request(self, identity: bytes, msg) -> None:
        if isinstance(msg, P.Hello):
            return self._on_hello(identity, msg)
        sid = getattr(msg, "session", None)
        if sid is None:
            raise ProtocolError(f"{type(msg).__name__} is not a request")
        req = getattr(msg, "req", 0)
        s = self._session_of(identity, sid, req)
        if s is None:
            return
        if s.observer and not isinstance(msg, (P.Stats, P.Heartbeat, P.Bye)):
            return self._refuse(identity, P.Nack.UNAUTHORIZED, "an observer session may only read statistics", req)
        if isinstance(msg, (P.Hold, P.Get)):
            return self._on_hold_or_get(identity, s, msg)
        if isinstance(msg, P.Push):
            return self._on_push(identity, s, msg)
        if isinstance(msg, P.Cancel):
            return self._on_cancel(identity, s, msg)
        if isinstance(msg, P.Stats):
            return self.reply(identity, P.StatsReply(req=msg.req, stats=self._stats()))
        if isinstance(msg, P.Heartbeat):
            return self.reply(identity, P.Heartbeat(session=sid))
        if isinstance(msg, P.ReadDone):
            if self.published is not None:
                self.published.read_done(s.id, s.group, msg.mm_hashes, msg.reader)
            return
        if isinstance(msg, P.Bye):
            return self._end_session(s)
        raise ProtocolError(f"unexpected {type(msg).__name__} from a consumer")

    def _session_of(self, identity: bytes, sid: str, req: int) -> Optional[Session]:
        s = self._sessions.get(sid)
        if s is None or s.identity != identity:
            self._refuse(identity, P.Nack.UNKNOWN_SESSION, "no handshake for this session", req)
            return None
        s.last_seen = time.monotonic()
        if not s.used:
            s.used = True
            # A consumer rank uses one session with us at a time: the first request on a new one
            # means its older ones were lost, or belong to its previous incarnation (a restarted
            # process: rank names are unique). Their pins and interest go now, not at lease end,
            # and so does an older incarnation's NIXL peer (this one's has another agent name).
            # Not at Hello: Hellos of connections it already gave up may still be queued here.
            for o in [o for o in self._sessions.values() if o is not s and o.name == s.name
                      and o.peer is not None and s.peer is not None]:
                self._end_session(o)
        return s

    def _on_hello(self, identity: bytes, msg: P.Hello) -> None:
        logger.debug("hello from %s (%s)", msg.name, "data" if msg.agent_md is not None else "control")

        def refuse(reason: P.Nack, detail: str):
            logger.warning("ec-nixl: refused %s (%s): %s", msg.name, reason.value, detail)
            self._refuse(identity, reason, detail)

        if self.published is None and not handshake.is_observer(msg):  # (observers: `ec-nixl status`)
            return refuse(P.Nack.BAD_REQUEST, "this is a consumer's control port: it answers vLLM EPD control "
                                              "requests (peers, cancel) and its statistics, and serves no items")
        if not handshake.signed(self.me, msg):
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
            return self.reply(identity, s.welcome)
        bad = handshake.check_hello(self.me, msg)
        if bad is not None:
            return refuse(*bad)
        peer = None
        if msg.agent_md is not None and msg.arena is not None and self.transport is not None:
            try:  # refuses, and unloads again, whatever NIXL cannot take: no session, no peer
                peer = self.transport.add_peer(msg.agent_md, msg.arena, msg.incarnation, msg.agent)
            except Exception as e:
                return refuse(P.Nack.INCOMPAT, f"cannot add NIXL peer: {e}")
        sid = secrets.token_hex(8)
        session = self._sessions[sid] = Session(sid, identity, msg.name, peer, msg.arena, msg.group,
                                                handshake.is_observer(msg))
        self._hello_nonces[msg.nonce] = (identity, sid)
        t = self.transport
        session.welcome = handshake.welcome(self.me, sid, msg.nonce, t.metadata if t else None,
                                            t.arena_info if t else None, self.cfg.link_timeout_s,
                                            self.answers)
        self.reply(identity, session.welcome)

    def _table(self) -> Published:
        if self.published is None:
            raise ProtocolError(f"{self.cfg.name} serves no items (it has no pool)")
        return self.published

    def _grant(self, s: Session, msg: P.Hold | P.Get) -> list[P.ItemState]:
        """Where ``msg``'s items are (a Hold: under lease; a Get: pinned for its READ), now: on
        arrival and again while it is parked."""
        return self._table().grant(s.id, s.group, msg.mm_hashes, _readers(msg), getattr(msg, "reader", 0),
                                   pin=isinstance(msg, P.Get))

    def _on_hold_or_get(self, identity: bytes, s: Session, msg) -> None:
        items = self._grant(s, msg)
        wait = _wait_of(msg)
        if wait > 0 and not self.parked.full() and not _all_ready(items):
            answers, native = self.published.answers, False
            if answers is not None:  # the last missing item's publish answers it
                missing = {st.mm_hash for st in items if st.status == P.Nack.MISSING.value}
                native = answers.note(s.id, s.group, identity, msg, _readers(msg), missing) and \
                    not self.published.any_published(missing)  # (else published before the note: ours)
            self.parked.add(Waiting(time.monotonic() + wait, identity, s.id, msg, native))
            self.metrics.count("holds_parked")
            return
        self.reply(identity, P.Grant(req=msg.req, items=items))

    def _on_native_done(self) -> None:
        self._handoff.drain_done()
        self.answer_parked()

    def answer_parked(self, now: Optional[float] = None) -> None:
        """Answer the waiting Holds and Gets whose items are all ready now, or whose wait ran out,
        and start the waiting pushes whose items were published (on every publish and every
        tick). A request whose session ended is dropped unanswered: its consumer's link is gone
        with it."""
        if not self.parked:
            return
        now = time.monotonic() if now is None else now
        answers = self.published.answers if self.published is not None else None
        keep = []
        for w in self.parked:
            deadline, identity, sid, msg = w.deadline, w.identity, w.sid, w.msg
            s = self._sessions.get(sid)
            alive = s is not None and s.identity == identity
            state = "none"
            if answers is not None and not isinstance(msg, P.Push):
                state = answers.settle(sid, msg.req, alive)
                if state == "busy":  # the hand-off is sending its answer
                    keep.append(w)
                    continue
                if state == "sent":
                    self.metrics.count("native_answers")
                    continue
                if state == "unsent":  # no route to the consumer's answer socket (yet), a full queue
                    self.metrics.count("native_answers_unsent")
            if not alive:
                continue
            if isinstance(msg, P.Push):
                rest = self._push(identity, s, msg, park=now < deadline)
                if rest is not None:
                    keep.append(Waiting(deadline, identity, sid, rest, self._armed_for(s, rest)))
                continue
            items = self._grant(s, msg)
            if (now < deadline and not _all_ready(items)) or (answers is not None and not answers.withdraw(sid, msg.req)):
                # (or a publish took it meanwhile); still the hand-off's while its note waits
                keep.append(Waiting(deadline, identity, sid, msg, w.native and state == "waiting"))
                continue
            self.reply(identity, P.Grant(req=msg.req, items=items))
        self.parked.reset(keep)

    def _on_push(self, identity: bytes, s: Session, msg: P.Push) -> None:
        if s.peer is None or self.pusher is None:
            raise ProtocolError("a control-only session cannot receive pushes")
        wait = _wait_of(msg)
        rest = self._push(identity, s, msg, park=wait > 0 and not self.parked.full())
        if rest is not None:
            self.parked.add(Waiting(time.monotonic() + wait, identity, s.id, rest, self._armed_for(s, rest)))
            self.metrics.count("pushes_parked")

    def _armed_for(self, s: Session, rest: P.Push) -> bool:
        """Every item of the parked ``rest`` is armed, and none was published before it was (that
        publish did not see the arming): the publishes start them, the loop need not look."""
        table = self._table()
        hashes = {it.mm_hash for it in rest.items}
        return table.native is not None and table.native.covers(s.id, rest.reader, hashes) and \
            not table.any_published(hashes)

    def _push(self, identity: bytes, s: Session, msg: P.Push, park: bool) -> Optional[P.Push]:
        """Start the pushes of ``msg`` whose items exist and refuse the ones that cannot be
        pushed; with ``park``, items not published yet are not refused but returned (as the
        Push to keep waiting), else None."""
        native = self._table().native  # native_push: the publish itself starts a parked push's WRITE
        if native is not None:
            msg = native.unstarted(s.id, msg)
            if not msg.items:
                return None
        accepted, failed = self._table().claim_pushes(s.id, s.group, s.arena, msg)
        rest, missing = None, set()
        if park:
            missing = {st.mm_hash for st in failed if st.status == P.Nack.MISSING.value}
            if missing:
                rest = msgspec.structs.replace(msg, items=[it for it in msg.items if it.mm_hash in missing])
                failed = [st for st in failed if st.mm_hash not in missing]
        if native is not None:
            native.disarm(s.id, {it.mm_hash for it in msg.items} - missing)
            if rest is not None:
                native.arm(s.id, s.group, s.peer, s.arena, rest, missing)
        if failed:
            self.reply(identity, P.PushFailed(req=msg.req, items=failed))
        self.pusher.add(accepted)
        return rest

    def _on_cancel(self, identity: bytes, s: Session, msg: P.Cancel) -> None:
        self._unpark_pushes(s.id, set(msg.mm_hashes))  # first: a parked push must never write later
        running = self.pusher.still_running if self.pusher is not None else (lambda p: False)
        safe, in_flight = self._table().cancel_pushes(s.id, msg.mm_hashes, running)
        self.reply(identity, P.CancelAck(req=msg.req, safe=safe, in_flight=in_flight))

    def _unpark_pushes(self, sid: str, mm_hashes: set[str]) -> None:
        """Take ``mm_hashes`` out of session ``sid``'s parked pushes (nothing of them was written)."""
        if self.published is not None and self.published.native is not None:
            self.published.native.disarm(sid, mm_hashes)  # (what a publish started is a push now)
        self.parked.drop_pushes(sid, mm_hashes)

    # --- consumers that went away ----------------------------------------------------

    def _seen_on(self, identity: bytes, frame: zmq.Frame) -> None:
        try:
            self._fd_of[identity] = frame.get(zmq.SRCFD)
        except zmq.ZMQError:  # pragma: no cover - a libzmq without the property: probes cover less
            pass

    def _on_monitor(self) -> None:
        now = time.monotonic()
        while True:
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if ev.get("event") != zmq.EVENT_DISCONNECTED:
                continue
            fd = int(ev.get("value", -1))
            for ident in [i for i, f in self._fd_of.items() if f == fd]:
                del self._fd_of[ident]
                if any(s.identity == ident for s in self._sessions.values()):
                    self._suspects[ident] = [now + d for d in _PROBES_S]
        self._tick(now)

    def _tick(self, now: float) -> None:
        """Probe the consumers whose connection dropped; reclaim the sessions of those gone;
        answer waiting Holds whose items became ready behind a fence or whose wait ran out."""
        self.answer_parked(now)
        for ident, when in list(self._suspects.items()):
            if when[0] > now:
                continue
            while when and when[0] <= now:
                when.pop(0)
            sessions = [s for s in self._sessions.values() if s.identity == ident]
            if sessions and self._gone(ident, sessions[0].id):
                for s in sessions:
                    self._reclaim(s)
            if not sessions or not when or not any(s.identity == ident for s in self._sessions.values()):
                self._suspects.pop(ident, None)

    def _gone(self, identity: bytes, sid: str) -> bool:
        """True when ZMQ has no route to ``identity`` any more (ROUTER_MANDATORY refuses the send).
        A live consumer gets a Heartbeat, which it ignores."""
        try:
            self._sock.send_multipart([identity, P.encode(P.Heartbeat(session=sid))], zmq.NOBLOCK)
            return False
        except zmq.ZMQError as e:
            return e.errno == zmq.EHOSTUNREACH

    def _reclaim(self, s: Session) -> None:
        logger.info("ec-nixl: consumer %s went away (connection dropped): its session %s ends", s.name, s.id)
        self.metrics.count("reclaimed_sessions")
        self._end_session(s)

    def _end_session(self, s: Session) -> None:
        """End ``s``; its NIXL peer goes with the last session of that agent (a reconnect of the
        same incarnation shares it)."""
        self._sessions.pop(s.id, None)
        if self.published is not None and self.published.native is not None:
            self.published.native.disarm(s.id)
        if self.published is not None and self.published.answers is not None:
            self.published.answers.forget_session(s.id)
        group_left = any(o.group == s.group for o in self._sessions.values())
        if self.published is not None:
            self.published.drop_session(s.id, s.group, group_left)
        agent = s.peer.name if s.peer is not None else None
        if agent is not None and not any(o.peer is not None and o.peer.name == agent for o in self._sessions.values()):
            self.transport.forget_peer(agent)
