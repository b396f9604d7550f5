"""A consumer's links to producers: connect, handshake, link probe, heartbeats, silence.

One ``Link`` per producer address: a ZMQ DEALER socket (plus a monitor that reports
disconnects), the session the producer granted, its NIXL peer, and the transfer mode the link
probe chose. ``Links`` runs them on the owner thread and carries the asynchronous queries
(``Hold``, ``Stats``) itself. Everything about *items* belongs to the listener (the loader): it
is told when a link becomes ready, goes down, or delivers a reply that is not a query answer,
and it says whether it has work on a link (only then does a producer's silence count).

A link never blocks, and an unreachable producer is noticed within ``link_timeout_s`` (2 s by
default) however the network fails: a connection attempt that is refused fails at once, one that
gets no transport handshake (ZMTP) in ``link_timeout_s`` fails then (a silent or cut-off host),
and a ready link whose transport-level pings go unanswered that long is lost (ZMQ's I/O threads
answer them on both sides, so a producer that is busy, slow to publish or starved of the GIL
still counts as alive; only ``peer_timeout_s`` of silence from its event loop while work is
pending declares *that* lost). Handshakes are resent with back-off. A link that failed stays
failed for a while, its socket closed, so that callers fail fast (their requests encode locally)
instead of each waiting on a dead address; the while doubles with each silent failure in a row
(``FAILED_BACKOFF_S`` up to ``FAILED_BACKOFF_MAX_S``; refusals keep it short), and a handshake
resets it.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from typing import TYPE_CHECKING, Optional, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from ec_nixl import handshake
from ec_nixl import protocol as P
from ec_nixl.config import EndpointConfig, split_address
from ec_nixl.errors import ConfigError, ECNixlError, TransferFailed
from ec_nixl.handshake import Identity
from ec_nixl.loop import OwnerLoop
from ec_nixl.metrics import Metrics
from ec_nixl.queries import HoldRequest, StatsRequest
from ec_nixl.states import LINK_NEXT, LinkState, advance

if TYPE_CHECKING:
    from ec_nixl.transport import Peer, Transport

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: the flag Enums cost a Python call each
logger = logging.getLogger("ec_nixl")

FAILED_BACKOFF_S = 0.5
"""A failed link is reused (failing new work at once) this long before it is retried. Doubled for
each further *slow* failure in a row (no answer at all: each retry costs the request that makes it
``link_timeout_s``, so a partition costs one request per retry and the others fail over to local
encoding at once), up to ``FAILED_BACKOFF_MAX_S``. A failure that comes at once (refused: a
producer restarting on a live host) costs its retry nothing and is retried every 0.5 s, so that
the first request after a restarted producer listens again is served from it."""
FAILED_BACKOFF_MAX_S = 4.0


HELLO_RESEND_S = 0.2
"""First resend of an unanswered Hello (doubling up to ``HELLO_RESEND_MAX_S``). A Hello dropped
because the connection was not up yet does not wait for it: it goes out on the ZMTP handshake."""
HELLO_RESEND_MAX_S = 2.0


def _dealer(ctx: zmq.Context, identity: bytes) -> zmq.Socket:
    """A socket of a link: no linger, our identity, bounded messages, quick reconnects."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    return sock


class Link:
    """The consumer's connection to one producer address."""

    def __init__(self, address: str, sock: zmq.Socket, monitor: zmq.Socket, nonce: bytes):
        self.address = address
        self.sock = sock
        self.monitor = monitor
        self.answers: Optional[zmq.Socket] = None  # connected to the producer's answer socket, if it has one
        self.nonce = nonce
        self.state = LinkState.CONNECTING
        self.error = ""
        self.reason = ""
        self.session = ""
        self.name = ""
        self.incarnation = ""
        self.peer: Optional[Peer] = None
        self.mode = ""
        self.t_start = time.monotonic()
        self.last_heard = self.t_start
        self.last_hb = self.t_start
        self.hellos = 1  # Hellos sent (resends back off: a slow producer must not get a flood)
        self.hello_dropped = False  # the last Hello found no connection yet: send it once ZMTP is up
        self.connected = False  # ZMTP handshake done (the host answers); reset by a disconnect
        self.t_unconnected = self.t_start  # since when there has been no connection
        self.idle = True  # no work pending at the last tick
        self.queries: dict[int, "HoldRequest | StatsRequest"] = {}  # req -> query awaiting its answer
        self.unsent: list["HoldRequest | StatsRequest"] = []  # queries waiting for the handshake
        self.resend = False  # lost under requests the producer cannot have acted on: send them again
        self.drops_after_s = 0.0  # the producer drops a connection silent this long (its link_timeout_s)

    def move(self, state: LinkState) -> None:
        self.state = advance(self.state, state, LINK_NEXT)

    def listen_for_answers(self, ctx: zmq.Context, address: str, cfg: EndpointConfig) -> bool:
        """Connect to the producer's answer socket under our identity: the Grants its publishes
        send from there (``native_answers``) arrive as if on the link. Nothing is sent on it."""
        try:
            host, port = split_address(address)
        except ConfigError as e:
            logger.warning("producer %s offers a bad answer address (%s): its answers come on the link", self.address, e)
            return False
        self.answers = _dealer(ctx, self.sock.getsockopt(zmq.IDENTITY))
        handshake.keep_alive(self.answers, cfg)  # a dead connection is dropped and made again
        self.answers.connect(f"tcp://{host}:{port}")
        return True

    def close_sockets(self, loop: OwnerLoop) -> None:
        if not self.sock.closed:
            loop.close_socket(self.sock, self.monitor)
        if self.answers is not None and not self.answers.closed:
            loop.close_socket(self.answers)

    def __repr__(self) -> str:
        return f"Link({self.address!r}, {self.state}, {self.name or '?'})"


class LinkListener(Protocol):
    """What ``Links`` tells the part that moves items over them (the loader)."""

    def has_work(self, link: Link) -> bool: ...

    def on_ready(self, link: Link) -> None: ...

    def on_down(self, link: Link, error: str, reason: str) -> None: ...

    def on_reply(self, link: Link, msg) -> None: ...

    def on_dropped(self, link: Link) -> None: ...


class _NoListener:
    """A control-only endpoint: links carry queries only."""

    def has_work(self, link: Link) -> bool:
        return False

    def on_ready(self, link: Link) -> None:
        pass

    def on_down(self, link: Link, error: str, reason: str) -> None:
        pass

    def on_reply(self, link: Link, msg) -> None:
        logger.warning("unexpected %s from producer %s", type(msg).__name__, link.address)

    def on_dropped(self, link: Link) -> None:
        pass


class Pauses:
    """This endpoint's own pauses, as its timers saw them: a stopped process, a long GC or GIL
    stall. A producer drops a connection that answered no ping for its ``link_timeout_s``, so a
    request sent in the first rounds after such a pause may go out on a connection that is
    already gone; ``Links.lose`` may then send it again (see ``Loader.on_down``)."""

    def __init__(self, cfg: EndpointConfig):
        self.cfg = cfg
        self._last_tick = time.monotonic()
        self._gap = (float("-inf"), 0.0)  # (when it ended, how long): the longest recent pause

    def tick(self, now: float) -> None:
        gap, (when, longest) = now - self._last_tick, self._gap
        if gap > 0.1 and (gap >= longest or now - when > self.cfg.link_timeout_s):
            self._gap = (now, gap)
        self._last_tick = now

    def were_away(self, link: Link) -> bool:
        """Did we just come back from a pause long enough for ``link``'s producer to drop us?
        "Long enough": most of the producer's own ``link_timeout_s`` (its Welcome says it; ours
        if not); "just": within our ``link_timeout_s`` of the pause's end."""
        now = time.monotonic()
        when, gap = self._gap
        if now - self._last_tick > gap:  # this round has not ticked yet: its pause is the latest
            when, gap = now, now - self._last_tick
        drops_after = 0.8 * (link.drops_after_s or self.cfg.link_timeout_s)
        return gap > drops_after and now - when < self.cfg.link_timeout_s


class Links:
    """All links of one endpoint. Public calls: ``hold_async``/``hold``/``query_stats`` (any thread);
    the rest runs on the owner thread."""

    def __init__(self, cfg: EndpointConfig, me: Identity, loop: OwnerLoop, metrics: Metrics,
                 transport: "Optional[Transport]"):
        self.cfg, self.me, self.loop, self.metrics, self.transport = cfg, me, loop, metrics, transport
        self.listener: LinkListener = _NoListener()
        self._ctx = zmq.Context.instance()
        self._links: dict[str, Link] = {}
        self._by_session: dict[str, Link] = {}
        self._failures: dict[str, int] = {}  # address -> slow failed attempts in a row (back-off)
        self._reqs = itertools.count(1)
        self.pauses = Pauses(cfg)
        loop.every_tick(self.tick)
        loop.idle_hint(self._idle_hint)

    def next_req(self) -> int:
        return next(self._reqs)

    def __len__(self) -> int:
        return len(self._links)

    def all(self) -> list[Link]:
        return list(self._links.values())

    def find(self, address: str) -> Optional[Link]:
        return self._links.get(address)

    def by_session(self, sid: str) -> Optional[Link]:
        return self._by_session.get(sid)

    # --- queries (any thread) --------------------------------------------------------

    def hold_async(self, producer: str, mm_hashes: list[str], readers: int = 1,
                   timeout: float = 2.0, wait_s: float = 0.0) -> HoldRequest:
        """Ask ``producer`` to keep items (extends their lease) and say where they are.

        Returns at once; ``HoldRequest.states`` fills in when the producer answers, or with
        UNREACHABLE/TIMEOUT for every item when it cannot (never blocks the caller). With
        ``wait_s`` the producer may keep the question that long for items not published yet;
        the timeout runs on top of it.
        """
        wait_s = min(max(0.0, wait_s), P.MAX_HOLD_WAIT_S) if wait_s == wait_s else 0.0
        h = HoldRequest(producer, list(mm_hashes), readers, self.next_req(), time.monotonic() + timeout + wait_s,
                        wait_s)
        try:
            split_address(producer)
        except ECNixlError as e:
            h.finish("BAD_REQUEST", str(e))
            return h
        self.loop.call(lambda: self.ask(h))
        return h

    def hold(self, producer: str, mm_hashes: list[str], readers: int = 1,
             timeout: float = 1.0, wait_s: float = 0.0) -> dict[str, P.ItemState]:
        """Blocking ``hold_async``: one ItemState per hash."""
        h = self.hold_async(producer, mm_hashes, readers, timeout, wait_s)
        self.loop.wait_for(lambda: h.done, timeout + h.wait_s + 0.05)
        if not h.done:
            h.finish("TIMEOUT", f"no answer from {producer} in {timeout:.3f}s")
        return h.states

    def query_stats(self, producer: str, timeout: float = 2.0) -> dict:
        """A producer's ``stats()`` (pool occupancy, counters), over an authenticated session."""
        r = StatsRequest(producer, self.next_req(), time.monotonic() + timeout)
        split_address(producer)
        self.loop.call(lambda: self.ask(r))
        self.loop.wait_for(lambda: r.done, timeout + 0.05)
        if r.stats is None:
            raise TransferFailed(f"no statistics from {producer}: {r.error or 'timed out'}", reason="STATS")
        return r.stats

    def release(self, producer: str, mm_hashes: list[str], readers: int = 1) -> None:
        """Tell ``producer`` that no reader of this consumer group will read ``mm_hashes``, which a
        Hold of ours claimed (vLLM had them cached, or their request ended before its load): it
        counts every reader done, so it frees them now instead of at lease end. Any thread; only
        over a ready link (else the lease ends them). The caller must know that no reader of the
        group reads them any more: the producer may reuse the memory at once."""
        def send() -> None:
            link = self._links.get(producer)
            if link is not None and link.state is LinkState.READY:
                for r in range(readers):
                    self.send(link, P.ReadDone(session=link.session, mm_hashes=list(mm_hashes), reader=r))

        self.loop.call(send)

    def ask(self, q: "HoldRequest | StatsRequest") -> None:
        """Send a query now, or once the handshake completes (owner thread)."""
        link = self.get(q.producer)
        if link.state is LinkState.FAILED:
            return q.finish(link.reason or "UNREACHABLE", link.error)
        self.wake(link)
        link.queries[q.req] = q
        if link.state is LinkState.READY:
            self.send(link, q.message(link.session))
        else:
            link.unsent.append(q)

    # --- links (owner thread) --------------------------------------------------------

    def get(self, address: str) -> Link:
        """The link to ``address``, connecting (and sending our Hello) if there is none."""
        link = self._links.get(address)
        if link is not None and link.state is not LinkState.FAILED:
            return link
        if link is not None and time.monotonic() - link.t_start < self.backoff(address):
            return link  # recently failed: do not hammer a dead address
        if link is not None:
            self._drop(link)
        sock = _dealer(self._ctx, secrets.token_bytes(12))  # (the answer socket takes the same identity)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        handshake.keep_alive(sock, self.cfg)  # a producer that stops answering is dropped, idle or not
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                          | zmq.EVENT_CONNECT_RETRIED)
        host, port = split_address(address)
        sock.connect(f"tcp://{host}:{port}")
        logger.debug("connecting to producer %s", address)
        link = Link(address, sock, monitor, P.new_nonce())
        self._links[address] = link
        self.loop.add_socket(sock, lambda: self._on_readable(link, link.sock))
        self.loop.add_socket(monitor, lambda: self._on_monitor(link))
        self._send_hello(link)
        return link

    def backoff(self, address: str) -> float:
        """How long a failed link to ``address`` fails new work before it is retried."""
        n = self._failures.get(address, 0)
        return min(FAILED_BACKOFF_MAX_S, FAILED_BACKOFF_S * (1 << max(0, min(n - 1, 8))))

    def _send_hello(self, link: Link) -> None:
        """Send our Hello now. IMMEDIATE drops it while the connection is not up yet (a queued
        Hello could reach a producer long after we gave up on it): then it goes out as soon as
        the monitor reports the ZMTP handshake, not at the next resend (that cost the first
        request to each producer 0.2 s, measured 2026-12-04); ``tick`` still resends."""
        try:
            link.sock.send(P.encode(self._hello(link)), zmq.NOBLOCK)
            link.hello_dropped = False
        except zmq.Again:
            link.hello_dropped = True

    def _hello(self, link: Link) -> P.Hello:
        t = self.transport
        return handshake.hello(self.me, link.nonce, t.metadata if t else None, t.arena_info if t else None)

    def unread(self, link: Link) -> bool:
        """A disconnect may wait in the link's monitor (ZMQ's ``EVENTS`` check, no poll): a
        direct path must let the loop take it in first (the producer may have restarted)."""
        try:
            return bool(link.monitor.getsockopt(_EVENTS) & _POLLIN)
        except zmq.ZMQError:
            return True

    def busy(self, link: Link) -> bool:
        return bool(link.queries or link.unsent) or self.listener.has_work(link)

    def wake(self, link: Link) -> None:
        """New work on a link that had none: its peer's silence is counted from now (an inline
        endpoint runs no timers while its owner is away, so older silence proves nothing)."""
        if link.state is LinkState.READY and not self.busy(link):
            link.last_heard = max(link.last_heard, time.monotonic())
            link.idle = False

    def send(self, link: Link, msg) -> None:
        try:
            link.sock.send(P.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("send to %s failed: %s", link.address, e)

    def fail(self, link: Link, error: str, reason: str, slow: bool = False) -> None:
        """The link cannot be used (refused, unreachable, bad handshake): fail what waits on it.
        ``slow``: it took a timeout to find out (the retry back-off grows)."""
        logger.warning("ec-nixl: %s", error)
        link.move(LinkState.FAILED)
        link.error, link.reason = error, reason
        link.t_start = time.monotonic()
        self._failures[link.address] = self._failures.get(link.address, 0) + 1 if slow else 1
        self.listener.on_down(link, error, reason)
        self._finish_queries(link, reason, error)
        # The link stays (callers fail fast) but its socket goes: ZMQ would keep reconnecting to a
        # dead address in the background (and on loopback may even connect to itself, taking the
        # port a restarting producer needs).
        link.close_sockets(self.loop)

    def lose(self, link: Link, error: str, resend: bool = False) -> None:
        """The producer went away: fail what waits on it (the listener quarantines what a DMA
        may touch), then drop the link. ``resend``: the producer dropped our session, not the
        other way round (it says it no longer knows it, or the connection broke just after we were
        away long enough to be dropped): requests it never answered were never acted on, so they go
        out again, once, on a new connection instead of failing: the listener's Gets
        (``Loader.on_down``) and our own Hold and Stats queries (``_end``)."""
        logger.warning("ec-nixl: %s", error)
        link.resend = resend
        self._end(link, error)

    def replace(self, link: Link, why: str) -> Link:
        """Drop a ready link and connect to its address afresh: the caller was told of another
        incarnation than the link's, so the link may lead to a process that is gone (an
        unthreaded endpoint learns of disconnects only when it runs). The new link's handshake
        says who answers now."""
        logger.info("ec-nixl: reconnecting to %s: %s", link.address, why)
        self._end(link, why)
        return self.get(link.address)

    def _end(self, link: Link, error: str) -> None:
        link.move(LinkState.LOST)
        self.listener.on_down(link, error, "PEER_LOST")
        again = [q for q in link.queries.values() if not q.resent] if link.resend else []
        for q in again:  # unanswered, so never acted on: asked once more below, not failed
            q.resent = True
            del link.queries[q.req]
        self._finish_queries(link, "UNREACHABLE", error)
        self._drop(link)
        if again:
            self.metrics.count("resent", len(again))
        for q in again:
            self.ask(q)  # on a new connection (the address is free again)

    def _finish_queries(self, link: Link, status: str, error: str) -> None:
        for q in list(link.queries.values()) + link.unsent:
            q.finish(status, error)
        link.queries.clear()
        link.unsent = []
        self.loop.changed()

    def _drop(self, link: Link) -> None:
        if self._links.get(link.address) is link:
            del self._links[link.address]
        if self._by_session.get(link.session) is link:
            del self._by_session[link.session]
        link.close_sockets(self.loop)
        agent = link.peer.name if link.peer is not None else None
        if self.transport is not None and agent in self.transport.peers \
                and not any(o.peer is not None and o.peer.name == agent for o in self._links.values()):
            self.transport.forget_peer(agent)
        self.listener.on_dropped(link)

    # --- incoming --------------------------------------------------------------------

    def _on_monitor(self, link: Link) -> None:
        while not link.monitor.closed:
            try:
                ev = recv_monitor_message(link.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event = ev.get("event")
            if event == zmq.EVENT_DISCONNECTED and link.state is LinkState.READY:
                self.lose(link, f"producer {link.address} disconnected", resend=self.pauses.were_away(link))
            elif event == zmq.EVENT_DISCONNECTED and link.connected:
                link.connected, link.t_unconnected = False, time.monotonic()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and link.state is LinkState.CONNECTING:
                link.connected = True
                if link.hello_dropped:
                    self._send_hello(link)
            elif event == zmq.EVENT_CONNECT_RETRIED and link.state is LinkState.CONNECTING \
                    and not link.connected:
                # Nobody listens there (refused), or no route: a dead process on a live host is
                # known at once; waiting for a producer that may start later is the caller's call.
                return self.fail(link, f"producer {link.address} unreachable (connection refused or "
                                 f"no route)", "UNREACHABLE")

    def _on_readable(self, link: Link, sock: zmq.Socket) -> None:
        for _ in range(64):
            if link.state in (LinkState.FAILED, LinkState.LOST) or sock.closed:
                return
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            link.last_heard = time.monotonic()
            try:
                msg = P.decode(data)
            except ECNixlError as e:
                # A producer that sends what is no message cannot be trusted with what is
                # pending on it: fail that now, naming the problem, instead of timing out.
                self.metrics.fail("BAD_MESSAGE")
                why = f"producer {link.address} sent a malformed message: {e}"
                if link.state is LinkState.READY:
                    self.lose(link, why)
                else:
                    self.fail(link, why, "BAD_MESSAGE")
                return
            try:
                self._on_message(link, msg)
            except ECNixlError as e:
                logger.warning("bad message from producer %s: %s", link.address, e)
                self.metrics.fail("BAD_MESSAGE")

    def _on_message(self, link: Link, msg) -> None:
        if isinstance(msg, P.Welcome):
            return self._on_welcome(link, msg)
        if isinstance(msg, P.Heartbeat):
            return
        if isinstance(msg, P.Refused) and (link.state is LinkState.CONNECTING or msg.req == 0):
            return self.fail(link, f"producer {link.address} refused: {msg.reason}: {msg.detail}", msg.reason)
        if isinstance(msg, P.Refused) and msg.reason == P.Nack.UNKNOWN_SESSION.value:
            # Our session is gone there (the producer restarted, or dropped our connection as
            # silent): nothing more can be done on this link; the next request reconnects.
            return self.lose(link, f"producer {link.address} no longer knows our session: {msg.detail}",
                             resend=True)
        q = link.queries.pop(msg.req, None) if isinstance(msg, (P.Refused, P.Grant, P.StatsReply)) else None
        if q is not None:
            if isinstance(msg, P.Refused):
                q.finish(msg.reason, msg.detail)
            else:
                q.resolve(msg, link.incarnation)
            self.loop.changed()
            return
        self.listener.on_reply(link, msg)

    def _on_welcome(self, link: Link, msg: P.Welcome) -> None:
        if link.state is not LinkState.CONNECTING:
            return
        bad = handshake.check_welcome(self.me, link.address, msg, link.nonce)
        if bad is not None:
            return self.fail(link, bad[1], bad[0])
        logger.debug("handshake with %s (%s) done: session %s", link.address, msg.name, msg.session)
        link.session, link.name, link.incarnation = msg.session, msg.name, msg.incarnation
        link.drops_after_s = msg.link_timeout_s
        if self.transport is not None:
            if msg.agent_md is None or msg.arena is None:
                return self.fail(link, f"producer {link.address} serves no data (control-only)", "INCOMPAT")
            try:
                link.peer = self.transport.add_peer(msg.agent_md, msg.arena, msg.incarnation, msg.agent)
            except Exception as e:
                return self.fail(link, f"cannot add producer {link.address} as NIXL peer: {e}", "INCOMPAT")
            link.mode = choose_mode(self.cfg, self.transport, self.metrics, link)
        if msg.answers and link.listen_for_answers(self._ctx, msg.answers, self.cfg):
            self.loop.add_socket(link.answers, lambda: self._on_readable(link, link.answers))
        link.move(LinkState.READY)
        self._by_session[link.session] = link
        unsent, link.unsent = link.unsent, []
        for q in unsent:
            self.send(link, q.message(link.session))
        self._failures.pop(link.address, None)
        self.listener.on_ready(link)

    # --- timers ----------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Handshake resends and timeouts, query timeouts, heartbeats, silence."""
        self.pauses.tick(now)
        for link in list(self._links.values()):
            if link.state is LinkState.CONNECTING:
                if not link.connected and now - link.t_unconnected > self.cfg.link_timeout_s:
                    self.fail(link, f"producer {link.address} unreachable (no connection in "
                              f"{self.cfg.link_timeout_s:.1f}s)", "UNREACHABLE", slow=True)
                elif now - link.t_start > self.cfg.peer_timeout_s:
                    self.fail(link, f"producer {link.address} unreachable (no handshake in "
                              f"{self.cfg.peer_timeout_s:.1f}s)", "UNREACHABLE", slow=True)
                elif now - link.last_hb > min(HELLO_RESEND_MAX_S, HELLO_RESEND_S * (1 << min(link.hellos - 1, 4))):
                    # a Hello lost on a connection that broke, or a producer slow to answer: resend,
                    # backing off (0.2 s, 0.4 s, ... 2 s)
                    link.last_hb = now
                    link.hellos += 1
                    self._send_hello(link)
                continue
            if link.state is not LinkState.READY:
                continue
            for req, q in list(link.queries.items()):
                if now >= q.deadline:
                    del link.queries[req]
                    q.finish("TIMEOUT", f"no answer from {link.address} to a {q.kind}")
                    self.loop.changed()
            if self.busy(link):
                if link.idle:  # the silence clock starts with the work (however long we were idle)
                    link.idle = False
                    link.last_heard = max(link.last_heard, now)
                if now - link.last_heard > self.cfg.peer_timeout_s:
                    self.lose(link, f"producer {link.address} silent for {self.cfg.peer_timeout_s:.1f}s")
                    continue
                if now - link.last_hb > self.cfg.heartbeat_s:
                    link.last_hb = now
                    self.send(link, P.Heartbeat(session=link.session))
            else:
                link.idle = True

    def _idle_hint(self) -> Optional[float]:
        return 0.001 if any(self.busy(link) for link in self._links.values()) else None

    # --- shutdown --------------------------------------------------------------------

    def say_goodbye(self) -> None:
        """Tell every producer we are leaving (frees our sessions there at once)."""
        for link in list(self._links.values()):
            if link.state is LinkState.READY:
                self.send(link, P.Bye(session=link.session))

    def close(self) -> None:
        for link in list(self._links.values()):
            try:
                self._drop(link)
            except Exception:
                pass


def choose_mode(cfg: EndpointConfig, transport: "Transport", metrics: Metrics, link: Link) -> str:
    """The link probe: time a small READ and WRITE over the real path; pick the faster unless forced."""
    peer = link.peer
    n = cfg.probe_blocks
    if cfg.mode != "auto":
        mode = cfg.mode
        read_s = write_s = float("nan")
    else:
        read_s = transport.probe(peer, "READ", n)
        write_s = transport.probe(peer, "WRITE", n)
        mode = "read" if read_s <= write_s else "write"
    gbps = (n * cfg.block_bytes) / (read_s if mode == "read" else write_s) / 1e9 \
        if cfg.mode == "auto" else float("nan")
    metrics.link_modes[link.name] = mode
    metrics.link_mode_at[link.address] = mode
    if gbps == gbps:  # measured (not a forced mode): what the consumer's scheduler plans loads with
        metrics.link_gbps[link.address] = gbps
    logger.info("ec-nixl link %s -> %s: mode=%s (probe %d KiB: READ %.1f us, WRITE %.1f us)",
                link.name, cfg.name, mode, n * cfg.block_bytes >> 10, read_s * 1e6, write_s * 1e6)
    slow = 5.0 if transport.arena.mem_type == "VRAM" else 0.5
    if gbps == gbps and gbps < slow:
        logger.warning(
            "ec-nixl link %s uses %s at only %.2f GB/s: the path looks emulated (e.g. UCX tcp instead "
            "of cuda_ipc/rdma/cma); check UCX_TLS and UCX_PROTO_INFO=y", link.name, mode.upper(), gbps)
    return mode
