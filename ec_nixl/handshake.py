"""The handshake rules, for both sides in one place: who we are, what a peer must prove.

A consumer sends ``Hello`` (version, compat hash, NIXL metadata with its length and sha256, a
fresh nonce, HMAC over it all with the shared token); the producer checks it (``check_hello``)
and answers ``Welcome`` (its own metadata and session id, HMAC bound to the consumer's nonce),
which the consumer checks (``check_welcome``). Both checks refuse metadata that does not match
its length and digest before NIXL sees it, and each incarnation's NIXL agent has a name of its
own (``agent_name``): NIXL refuses a name for good once it failed to load metadata under it.
What an accepted handshake gives the consumer on the producer's side is a ``Session``. Keeping
the rules here means the producer's server and the consumer's links cannot drift apart, and each
check is testable without a socket. ``keep_alive`` is the one rule both sides apply to the
connection itself: transport-level pings.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import zmq

from ec_nixl import protocol as P
from ec_nixl.config import EndpointConfig

if TYPE_CHECKING:
    from ec_nixl.transport import Peer


@dataclass(frozen=True)
class Identity:
    """What an endpoint says about itself in every handshake."""

    name: str
    compat: str
    """Hash of what must match between peers (model, dtype, width, block); empty for observers."""
    token: Optional[bytes]
    group: str
    observer: bool
    incarnation: str = field(default_factory=lambda: secrets.token_hex(8))
    """New for every process start: a restarted peer is a new peer (stale blocks, dlists)."""

    @property
    def agent(self) -> str:
        """This incarnation's NIXL agent name."""
        return agent_name(self.name, self.incarnation)

    @classmethod
    def of(cls, cfg: EndpointConfig) -> "Identity":
        compat = "" if cfg.observer else P.compat_hash({**cfg.compat, "block": cfg.block_bytes})
        return cls(name=cfg.name, compat=compat, token=cfg.token.encode() if cfg.token else None,
                   group=cfg.group or "", observer=cfg.observer)


def agent_name(name: str, incarnation: str) -> str:
    """The NIXL agent name of incarnation ``incarnation`` of rank ``name``. Never reused: a name
    whose metadata NIXL once failed to load (a bad copy sent by anyone) stays refused by that
    NIXL agent, so a poisoned name costs one incarnation, not every later one."""
    return f"{name}-{incarnation[:8]}"


def keep_alive(sock: zmq.Socket, cfg: EndpointConfig) -> None:
    """Ping the peers of ``sock`` and drop a connection that answers nothing for
    ``link_timeout_s`` (ZMTP heartbeats: ZMQ's own I/O thread sends and answers them, so a peer
    that is idle, busy, or not running its event loop still answers; a stopped, hung or cut-off
    one does not). Pings go every ``heartbeat_s`` but at least four times per timeout, so that a
    cut is noticed between ``link_timeout_s`` and 1.25 times it. Set before connect or bind."""
    ivl = min(cfg.heartbeat_s, cfg.link_timeout_s / 4)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(ivl * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(cfg.link_timeout_s * 1000)))


def hello(me: Identity, nonce: bytes, agent_md: Optional[bytes], arena: Optional[P.ArenaInfo]) -> P.Hello:
    """Our signed handshake to a producer (``agent_md``/``arena`` None: control only)."""
    msg = P.Hello(version=P.PROTOCOL_VERSION, compat=me.compat, name=me.name, incarnation=me.incarnation,
                  nonce=nonce, agent_md=agent_md, arena=arena, group=me.group,
                  agent=me.agent if agent_md is not None else "", **P.md_fields(agent_md))
    P.sign(msg, me.token)
    return msg


def signed(me: Identity, msg: P.Hello) -> bool:
    """The Hello carries a valid HMAC of the shared token (checked before anything else)."""
    return P.verify(msg, me.token)


def check_hello(me: Identity, msg: P.Hello) -> Optional[tuple[P.Nack, str]]:
    """Why a producer must refuse a signed ``msg`` (reason, detail), or None to accept it.

    An observer (no compat hash, no NIXL metadata) may connect without a matching compat hash: it
    can only read statistics. NIXL metadata that does not match the length and sha256 it came
    with is refused here, before NIXL sees it.
    """
    if msg.version != P.PROTOCOL_VERSION:
        return P.Nack.VERSION, f"protocol {msg.version} != {P.PROTOCOL_VERSION}"
    if msg.compat != me.compat and not is_observer(msg):
        return P.Nack.INCOMPAT, f"compat hash {msg.compat} != {me.compat} (model/dtype/width/block differ)"
    bad_md = P.md_problem(msg)
    if bad_md is not None:
        return P.Nack.BAD_REQUEST, bad_md
    return None


def is_observer(msg: P.Hello) -> bool:
    return msg.compat == "" and msg.agent_md is None


def welcome(me: Identity, session: str, consumer_nonce: bytes, agent_md: Optional[bytes],
            arena: Optional[P.ArenaInfo], link_timeout_s: float = 0.0, answers: str = "") -> P.Welcome:
    """Our signed answer to an accepted Hello (the HMAC covers the consumer's nonce)."""
    msg = P.Welcome(version=P.PROTOCOL_VERSION, compat=me.compat, name=me.name, incarnation=me.incarnation,
                    session=session, nonce=P.new_nonce(), agent_md=agent_md, arena=arena,
                    agent=me.agent if agent_md is not None else "", link_timeout_s=link_timeout_s,
                    answers=answers, **P.md_fields(agent_md))
    P.sign(msg, me.token, consumer_nonce)
    return msg


def check_welcome(me: Identity, address: str, msg: P.Welcome, nonce: bytes) -> Optional[tuple[str, str]]:
    """Why a consumer must give up on producer ``address`` (reason, error), or None."""
    if not P.verify(msg, me.token, nonce):
        return "UNAUTHORIZED", f"producer {address} failed authentication (token mismatch)"
    if msg.version != P.PROTOCOL_VERSION:
        return "VERSION", f"producer {address} speaks protocol {msg.version}, we speak {P.PROTOCOL_VERSION}"
    if msg.compat != me.compat and not me.observer:
        return "INCOMPAT", (f"producer {address} is incompatible (compat hash {msg.compat} != {me.compat}: "
                            f"model/dtype/width/block differ)")
    bad_md = P.md_problem(msg)
    if bad_md is not None:
        return "BAD_MESSAGE", f"producer {address} sent {bad_md}"
    return None


class Session:
    """What a consumer's completed handshake gave it."""

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
