"""Holds and Gets answered by the publish itself: the Grant sent off the GIL (issue 40).

A consumer's Hold (or Get) that waits for an item not published yet is parked by the server
and *noted* here (owner thread) when the consumer listens on the endpoint's answer socket
(``Welcome.answers``). The publish of its last missing item (any thread, the items table's
lock held) grants it there and then, as the server would, and hands the encoded Grant to the
native hand-off (``handoff.NativeHandoff.send``), whose thread sends it once the item's copy is
complete (its CUDA event). Neither the GIL nor a sleeping Python thread stands between the
publish and the answer: in a serving process the runner goes on in Python after it publishes,
and the I/O thread that answered before had to wait for the interpreter lock to do it.

The server *settles* each noted request on its rounds: sent (answered), still going, or back to
it (no route to the consumer yet, a full queue, a copy guarded by anything but one CUDA event,
another item of the request not ready): then it answers as before, from Python. A request the
server answers itself is *withdrawn* first, so that exactly one answer goes out.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import zmq

from ec_nixl import protocol as P
from ec_nixl.handoff import NativeHandoff
from ec_nixl.native_push import cuda_event_of

logger = logging.getLogger("ec_nixl")

KEY_BASE = 1 << 48  # the hand-off's keys are shared with the native pushes (which count from 1)

WAITING, FIRED, QUEUED, RETURNED = "waiting", "fired", "queued", "returned"
"""A note's states: waiting for its items; taken by a publish (being granted and encoded); queued
on the hand-off's thread (its outcome is the hand-off's); back to the server."""


@dataclass(eq=False)
class Noted:
    key: int
    sid: str
    group: str
    identity: bytes
    msg: P.Hold | P.Get
    readers: int
    missing: set[str] = field(default_factory=set)
    state: str = WAITING


Answer = tuple[Noted, Optional[int], bytes]
"""A granted request ready to go: its note, the CUDA event its send waits for, the encoded Grant."""


class NativeAnswers:
    def __init__(self, handoff: NativeHandoff):
        self.hx = handoff
        self._lock = threading.Lock()  # taken inside the items table's lock, never around it
        self._noted: dict[tuple[str, int], Noted] = {}  # (session, req) -> its note
        self._waiting: dict[str, list[Noted]] = {}  # mm_hash -> notes still missing it
        self._next_key = KEY_BASE

    def __len__(self) -> int:
        with self._lock:
            return len(self._noted)

    # --- owner thread (the server) ---------------------------------------------------

    def note(self, sid: str, group: str, identity: bytes, msg: P.Hold | P.Get, readers: int,
             missing: set[str]) -> bool:
        """The parked ``msg`` waits for the items ``missing`` (not published yet). True: noted
        (the last one's publish answers it); False: nothing missing, it stays the server's."""
        if not missing:
            return False
        with self._lock:
            if (sid, msg.req) in self._noted:
                return True
            n = Noted(self._next_key, sid, group, identity, msg, readers, set(missing))
            self._next_key += 1
            self._noted[(sid, msg.req)] = n
            for h in n.missing:
                self._waiting.setdefault(h, []).append(n)
        self.hx.expect()
        return True

    def settle(self, sid: str, req: int, alive: bool) -> str:
        """Where the parked request ``(sid, req)`` stands: 'none' (not noted, or back to the
        server now: answer it from Python, or drop it if its session is gone), 'waiting' (the
        publish may still answer it), 'busy' (being sent; cancelled if not ``alive``), 'sent', or
        'unsent' (the hand-off could not send it: as 'none')."""
        with self._lock:
            n = self._noted.get((sid, req))
            if n is None:
                return "none"
            if n.state == WAITING and alive:
                return "waiting"
            if n.state == FIRED:
                return "busy"  # a publish is granting it right now
            if n.state != QUEUED:
                self._forget(n)
                return "none"
        out = self.hx.take(n.key)
        if out.state in ("FIRED", "POSTED"):
            if not alive:
                self.hx.cancel(n.key)
            return "busy"
        with self._lock:
            self._forget(n)
        if out.state != "DONE":
            logger.debug("native answer to %s req %d not sent (%s, status %d): answered on the link",
                         sid, req, out.state, out.status)
        return "sent" if out.state == "DONE" else "unsent"

    def withdraw(self, sid: str, req: int) -> bool:
        """The server answers ``(sid, req)`` itself: True, unless the publish took it meanwhile."""
        with self._lock:
            n = self._noted.get((sid, req))
            if n is None or n.state in (WAITING, RETURNED):
                if n is not None:
                    self._forget(n)
                return True
            return False

    def forget_session(self, sid: str) -> None:
        """Session ``sid`` ended: its notes no publish took yet go (what is being sent settles)."""
        with self._lock:
            for n in [n for n in self._noted.values() if n.sid == sid and n.state in (WAITING, RETURNED)]:
                self._forget(n)

    def _forget(self, n: Noted) -> None:
        self._noted.pop((n.sid, n.msg.req), None)
        for h in n.missing:
            lst = self._waiting.get(h)
            if lst is not None and n in lst:
                lst.remove(n)
                if not lst:
                    del self._waiting[h]

    # --- the publishing thread --------------------------------------------------------

    def take(self, item, grant: Callable[..., list[P.ItemState]]) -> tuple[list[Answer], bool]:
        """Items table's lock held: the noted requests ``item`` was the last missing item of,
        granted now with ``grant`` (the table's, taking the lock-held path) and encoded, with
        the CUDA event their send waits for. Those that cannot go natively go back to the server:
        the second value says whether any did (the server must run for them now)."""
        h = item.desc.mm_hash
        with self._lock:
            notes = self._waiting.pop(h, [])
            done = []
            for n in notes:
                n.missing.discard(h)
                if not n.missing:
                    n.state = FIRED
                    done.append(n)
        if not done:
            return [], False
        native, event = cuda_event_of(item.ready)
        now, out, back = time.monotonic(), [], []
        for n in done:
            states = grant(n.sid, n.group, n.msg.mm_hashes, n.readers, getattr(n.msg, "reader", 0),
                           isinstance(n.msg, P.Get), now, item) if native else []
            if states and all(st.status == "ready" for st in states):
                out.append((n, event, P.encode(P.Grant(req=n.msg.req, items=states))))
            else:
                back.append(n)
        self._back(back)
        return out, bool(back)

    def send(self, answers: list[Answer]) -> bool:
        """After the table's lock: queue each Grant on the hand-off's thread. False: one could not
        be queued (back to the server, which must run for it now)."""
        went = [(n, self.hx.send(n.key, event, n.identity, body)) for n, event, body in answers]
        with self._lock:
            for n, queued in went:
                n.state = QUEUED if queued else RETURNED
        return all(queued for _, queued in went)

    def _back(self, notes: list[Noted]) -> None:
        if notes:
            with self._lock:
                for n in notes:
                    n.state = RETURNED


def open_answer_socket(ctx: zmq.Context, host: str, port: int, advertised_host: str,
                       published) -> tuple[Optional[zmq.Socket], str]:
    """The producer's second ROUTER socket, the native hand-off's alone, and its 'host:port' (None,
    '' where the hand-off is off or the socket cannot be had): the Grants a publish answers go
    out on it. Consumers connect to it under their link's identity (``Welcome.answers``)."""
    if published is None or published.native is None or not published.cfg.native_answers:
        return None, ""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # no route to a consumer: the send fails, Python answers
    try:
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        why = published.native.hx.answer_on(sock)
    except zmq.ZMQError as e:
        why = str(e)
    if why:
        sock.close()
        logger.info("ec-nixl: no answer socket (%s): parked Holds are answered from Python", why)
        return None, ""
    published.answers = NativeAnswers(published.native.hx)
    return sock, f"{advertised_host}:{port}"


def close_answer_socket(sock: zmq.Socket, published) -> None:
    """Publishes stop answering natively, the hand-off lets go of ``sock`` (once no send uses it),
    and it closes."""
    published.answers = None
    published.native.hx.answer_off()
    sock.close()
