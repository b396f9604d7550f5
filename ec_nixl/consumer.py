"""Loading items: the consumer side of an endpoint.

``load()`` reserves a pool slot per item and fetches it the way the link prefers: a READ of the
producer's slot (pull; at once when a Hold already told where it is, else after a Get/Grant), or a
Push asking the producer to WRITE into our slot. A step's items from one producer travel as one
NIXL request. ``LoadTicket``s report the outcome; ``LoadBarrier`` waits on them. Connections to
producers (``_Conn``) carry the handshake, link choice, heartbeats and failure detection.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from ec_nixl import protocol as P
from ec_nixl.config import split_address
from ec_nixl.errors import ECNixlError, ItemTooLarge, PoolExhausted, TransferFailed
from ec_nixl.pool import Fence, Slot
from ec_nixl.tensors import torch_dtype
from ec_nixl.transport import Peer, Xfer

if TYPE_CHECKING:
    from ec_nixl.endpoint import Endpoint

logger = logging.getLogger("ec_nixl")

PENDING, LANDED, FAILED = "pending", "landed", "failed"


@dataclass(frozen=True)
class ItemRef:
    """What a consumer needs to fetch one item: its description and where it lives.

    ``block``/``valid_until`` come from a producer's Hold reply: while the hold is valid the item
    cannot move, so a READ can be posted at once without asking for a grant.
    """

    desc: P.ItemDesc
    producer: str
    block: int = -1
    valid_until: float = 0.0
    reader: int = 0
    readers: int = 1
    incarnation: str = ""
    """The producer incarnation whose Hold gave ``block`` (``HoldRequest.incarnation``): the block
    is used only on a session with that incarnation; a producer restarted at the same address is
    asked for a grant instead. Empty: trust ``block`` (callers that cannot tell)."""

    @property
    def mm_hash(self) -> str:
        return self.desc.mm_hash


class LoadTicket:
    """One item being loaded; LANDED once its bytes are in this endpoint's pool."""

    __slots__ = ("ref", "slot", "state", "phase", "error", "reason", "retryable", "deadline",
                 "t_start", "t_post", "t_done", "xfer", "retry_at", "mode", "_ep", "released", "event", "_view")

    def __init__(self, ref: ItemRef, deadline: float, ep: "Endpoint"):
        self.ref = ref
        self.slot: Optional[Slot] = None
        self.state = PENDING
        self.phase = "queued"
        self.error = ""
        self.reason = ""
        self.retryable = False
        self.deadline = deadline
        self.t_start = time.perf_counter()
        self.t_post = 0.0
        self.t_done = 0.0
        self.xfer: Optional[Xfer] = None
        self.retry_at = 0.0
        self.mode = ""
        self._ep = ep
        self.released = False
        self.event = None  # a CUDA event, when the bytes became visible through stream work
        self._view: Optional[torch.Tensor] = None

    @property
    def mm_hash(self) -> str:
        return self.ref.desc.mm_hash

    @property
    def done(self) -> bool:
        return self.state != PENDING

    def tensor(self) -> torch.Tensor:
        """The landed item as a view into the pool (valid until ``release``); built once."""
        if self.state != LANDED or self.slot is None:
            raise RuntimeError(f"item {self.mm_hash} is {self.state}, not landed")
        if self._view is None:
            d = self.ref.desc
            self._view = self.slot.view(d.shape, torch_dtype(d.dtype))
        return self._view

    def release(self, fence: Optional[Fence] = None) -> None:
        """Give the slot back once ``fence`` (e.g. the gather's CUDA event) has completed."""
        if not self.released and self.state == LANDED and self.slot is not None:
            self.released = True
            self._ep.pool.release(self.slot, fence)

    def __repr__(self) -> str:
        return f"LoadTicket({self.mm_hash!r}, {self.state}/{self.phase}{', ' + self.error if self.error else ''})"


class _Conn:
    """The consumer's connection to one producer address."""

    def __init__(self, address: str, sock: zmq.Socket, monitor: zmq.Socket, nonce: bytes):
        self.address = address
        self.sock = sock
        self.monitor = monitor
        self.nonce = nonce
        self.state = "connecting"
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
        self.idle = True  # no work pending at the last tick
        self.waiting: list[LoadTicket] = []  # until the handshake completes
        self.get_queue: list[LoadTicket] = []  # to send in the next Get
        self.push_queue: list[LoadTicket] = []
        self.read_queue: list[tuple[LoadTicket, int]] = []  # (ticket, producer block) to READ this round
        self.by_req: dict[int, list[LoadTicket]] = {}
        self.pushed: dict[str, LoadTicket] = {}  # mm_hash -> ticket awaiting the W notification
        self.holds: dict[int, "HoldRequest | StatsRequest"] = {}  # req -> query awaiting its answer
        self.zombies: list[tuple[Slot, float]] = []  # push targets awaiting a CancelAck

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.get_queue or self.push_queue or self.read_queue or self.by_req
                    or self.pushed or self.zombies or self.holds)


class HoldRequest:
    """An asynchronous Hold; ``states`` is None until answered (or failed/timed out)."""

    __slots__ = ("producer", "mm_hashes", "readers", "req", "deadline", "states", "incarnation")
    kind = "hold"

    def __init__(self, producer: str, mm_hashes: list[str], readers: int, req: int, deadline: float):
        self.producer, self.mm_hashes, self.readers, self.req = producer, mm_hashes, readers, req
        self.deadline = deadline
        self.states: Optional[dict[str, P.ItemState]] = None
        self.incarnation = ""  # of the producer that answered (goes into ItemRef.incarnation)

    @property
    def done(self) -> bool:
        return self.states is not None

    def answer(self, items: list[P.ItemState]) -> None:
        got = {s.mm_hash: s for s in items if s.mm_hash in self.mm_hashes}
        for h in self.mm_hashes:
            got.setdefault(h, P.ItemState(mm_hash=h, status="BAD_GRANT", detail="left out of the answer"))
        self.states = got

    def finish(self, status: str, detail: str) -> None:
        if self.states is None:
            self.states = {h: P.ItemState(mm_hash=h, status=status, detail=detail) for h in self.mm_hashes}

    def message(self, session: str):
        return P.Hold(session=session, req=self.req, mm_hashes=self.mm_hashes, readers=self.readers)

    def resolve(self, msg) -> None:
        if isinstance(msg, P.Grant):
            self.answer(msg.items)
        else:
            self.finish("BAD_REPLY", f"unexpected {type(msg).__name__}")


class StatsRequest:
    """An asynchronous Stats query; ``stats`` is None until answered, ``error`` set on failure."""

    __slots__ = ("producer", "req", "deadline", "stats", "error")
    kind = "stats"

    def __init__(self, producer: str, req: int, deadline: float):
        self.producer, self.req, self.deadline = producer, req, deadline
        self.stats: Optional[dict] = None
        self.error = ""

    @property
    def done(self) -> bool:
        return self.stats is not None or bool(self.error)

    def message(self, session: str):
        return P.Stats(session=session, req=self.req)

    def resolve(self, msg) -> None:
        if isinstance(msg, P.StatsReply):
            self.stats = dict(msg.stats)
        else:
            self.finish("BAD_REPLY", f"unexpected {type(msg).__name__}")

    def finish(self, status: str, detail: str) -> None:
        if not self.done:
            self.error = f"{status}: {detail}"


def _by_reader(tickets: list[LoadTicket]) -> dict[tuple[int, int], list[LoadTicket]]:
    out: dict[tuple[int, int], list[LoadTicket]] = {}
    for t in tickets:
        out.setdefault((t.ref.reader, t.ref.readers), []).append(t)
    return out


class Loader:
    """The consumer half of ``Endpoint`` (a mixin: the state lives in ``Endpoint.__init__``).

    Public calls (any thread): ``load``, ``hold_async``/``hold``, ``query_stats``, ``cancel``;
    everything else runs on the owner thread. Never hands over an item before its bytes landed;
    never frees a slot a DMA may still write (``_fail_xfer`` quarantines, zombies wait).
    """

    def load(self, refs: Iterable[ItemRef], timeout: Optional[float] = None) -> list[LoadTicket]:
        """Start loading ``refs``; returns one ticket each at once (see ``LoadBarrier``)."""
        self._need_pool()
        deadline = time.monotonic() + (timeout if timeout is not None else self.cfg.load_timeout_s)
        tickets = [LoadTicket(r, deadline, self) for r in refs]
        bad = []
        for t in tickets:
            try:
                P.validate_item(t.ref.desc)
                split_address(t.ref.producer)
            except ECNixlError as e:
                bad.append((t, e))
        for t, e in bad:
            self._fail(t, str(e), "BAD_REQUEST")
        good = [t for t in tickets if t.state == PENDING]
        if good:
            self._exec(lambda: self._start(good))
        return tickets

    def hold_async(self, producer: str, mm_hashes: list[str], readers: int = 1,
                   timeout: float = 2.0) -> "HoldRequest":
        """Ask ``producer`` to keep items (extends their lease) and say where they are.

        Returns at once; ``HoldRequest.states`` fills in when the producer answers, or with
        UNREACHABLE/TIMEOUT for every item when it cannot (never blocks the caller).
        """
        h = HoldRequest(producer, list(mm_hashes), readers, next(self._reqs), time.monotonic() + timeout)
        try:
            split_address(producer)
        except ECNixlError as e:
            h.finish("BAD_REQUEST", str(e))
            return h
        self._exec(lambda: self._send_hold(h))
        return h

    def hold(self, producer: str, mm_hashes: list[str], readers: int = 1,
             timeout: float = 1.0) -> dict[str, P.ItemState]:
        """Blocking ``hold_async``: one ItemState per hash."""
        h = self.hold_async(producer, mm_hashes, readers, timeout)
        self.wait_for(lambda: h.done, timeout + 0.05)
        if not h.done:
            h.finish("TIMEOUT", f"no answer from {producer} in {timeout:.3f}s")
        return h.states

    def query_stats(self, producer: str, timeout: float = 2.0) -> dict:
        """A producer's ``stats()`` (pool occupancy, counters), over an authenticated session."""
        r = StatsRequest(producer, next(self._reqs), time.monotonic() + timeout)
        split_address(producer)
        self._exec(lambda: self._send_hold(r))
        self.wait_for(lambda: r.done, timeout + 0.05)
        if r.stats is None:
            raise TransferFailed(f"no statistics from {producer}: {r.error or 'timed out'}", reason="STATS")
        return r.stats

    def cancel(self, tickets: list[LoadTicket], why: str = "cancelled by the caller") -> None:
        """Fail every still-pending ticket now (slots of possibly running DMAs go to quarantine)."""
        pending = [t for t in tickets if t.state == PENDING]
        if not pending:
            return
        self._exec(lambda: self._cancel(pending, why))
        self.wait_for(lambda: all(t.done for t in pending), 2.0)

    def _conn(self, address: str) -> _Conn:
        conn = self._conns.get(address)
        if conn is not None and conn.state != "failed":
            return conn
        if conn is not None and time.monotonic() - conn.t_start < 0.5:
            return conn  # recently failed: do not hammer a dead address
        if conn is not None:
            self._drop_conn(conn)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(12))
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        host, port = split_address(address)
        sock.connect(f"tcp://{host}:{port}")
        logger.debug("connecting to producer %s", address)
        conn = _Conn(address, sock, monitor, P.new_nonce())
        self._conns[address] = conn
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        try:
            sock.send(P.encode(self._hello(conn)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet: IMMEDIATE queues nothing; retried in _tick
        return conn

    def _hello(self, conn: _Conn) -> P.Hello:
        """Our handshake to a producer: who we are, our NIXL metadata and arena, signed."""
        hello = P.Hello(version=P.PROTOCOL_VERSION, compat=self.compat, name=self.cfg.name,
                        incarnation=self.incarnation, nonce=conn.nonce,
                        agent_md=self.transport.metadata if self.transport else None,
                        arena=self.transport.arena_info if self.transport else None,
                        group=self.cfg.group or "")
        P.sign(hello, self._token)
        return hello

    def _send_hold(self, h: "HoldRequest | StatsRequest") -> None:
        conn = self._conn(h.producer)
        if conn.state == "failed":
            return h.finish(conn.reason or "UNREACHABLE", conn.error)
        self._wake_conn(conn)
        conn.holds[h.req] = h
        if conn.state == "ready":
            self._send(conn, h.message(conn.session))
        else:
            conn.waiting.append(h)  # sent once the handshake completes

    def _start(self, tickets: list[LoadTicket]) -> None:
        for t in tickets:
            if t.state != PENDING:
                continue
            conn = self._conn(t.ref.producer)
            self._wake_conn(conn)
            if conn.state == "failed":
                self._fail(t, conn.error, conn.reason or "UNREACHABLE")
            elif conn.state == "connecting":
                t.phase = "connecting"
                conn.waiting.append(t)
            else:
                self._dispatch(conn, t)

    @staticmethod
    def _wake_conn(conn: _Conn) -> None:
        """New work on a connection that had none: its peer's silence is counted from now (an
        inline endpoint runs no timers while its owner is away, so older silence proves nothing)."""
        if conn.state == "ready" and not conn.busy:
            conn.last_heard = max(conn.last_heard, time.monotonic())
            conn.idle = False

    def _dispatch(self, conn: _Conn, t: LoadTicket) -> None:
        """Reserve the slot and ask for the item the way this link prefers."""
        if t.slot is None:
            try:
                t.slot = self.pool.allocate(t.ref.desc.nbytes, tag=t.mm_hash)
            except ItemTooLarge as e:
                return self._fail(t, str(e), "TOO_LARGE")
            except PoolExhausted as e:
                t.phase, t.error = "pool", str(e)
                self._retry.append(t)
                return
        t.mode = conn.mode
        if conn.mode == "write":
            t.phase = "push"
            conn.push_queue.append(t)
        elif t.ref.block >= 0 and time.time() < t.ref.valid_until and \
                t.ref.incarnation in ("", conn.incarnation):
            self._post_read(conn, t, t.ref.block)
        else:
            t.phase = "grant"
            conn.get_queue.append(t)

    def _post_read(self, conn: _Conn, t: LoadTicket, remote_block: int) -> None:
        """Queue a READ; ``_flush`` posts this round's READs from one producer as ONE request."""
        t.phase = "read-queued"
        conn.read_queue.append((t, remote_block))

    def _post_reads(self, conn: _Conn) -> None:
        # No notification rides the READ: NIXL would report DONE only once the producer's side
        # has taken it, which needs the producer's progress. The read-done notification is sent
        # after DONE instead (_poll_reads), off the waiting path.
        batch = [(t, b) for t, b in conn.read_queue if t.state == PENDING]
        conn.read_queue = []
        if not batch:
            return
        t_post = time.perf_counter()
        try:
            x = self.transport.post_many("READ", conn.peer, [(t.slot.block, b, self.pool.blocks_for(t.ref.desc.nbytes))
                                                             for t, b in batch])
        except TransferFailed as e:
            for t, _ in batch:
                self._fail(t, str(e), e.reason)
            return
        for t, _ in batch:
            t.xfer, t.t_post, t.phase = x, t_post, "read"
            self._reads.append(t)

    def _flush(self) -> None:
        """Send the Get and Push batches gathered this round: one message per producer and reader."""
        for conn in self._conns.values():
            if conn.state != "ready" or not (conn.get_queue or conn.push_queue or conn.read_queue):
                continue
            if conn.read_queue:
                self._post_reads(conn)
            gets, conn.get_queue = conn.get_queue, []
            for (reader, readers), batch in _by_reader(gets).items():
                req = next(self._reqs)
                conn.by_req[req] = batch
                self._send(conn, P.Get(session=conn.session, req=req, mm_hashes=[t.mm_hash for t in batch],
                                       reader=reader, readers=readers))
            pushes, conn.push_queue = conn.push_queue, []
            for (reader, readers), batch in _by_reader(pushes).items():
                for t in batch:
                    conn.pushed[t.mm_hash] = t
                    t.t_post = time.perf_counter()
                self._send(conn, P.Push(session=conn.session, req=next(self._reqs), reader=reader, readers=readers,
                                        items=[P.PushItem(mm_hash=t.mm_hash, block=t.slot.block,
                                                          nbytes=t.ref.desc.nbytes) for t in batch]))

    def _send(self, conn: _Conn, msg) -> None:
        try:
            conn.sock.send(P.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("send to %s failed: %s", conn.address, e)

    def _on_client_socket(self, sock: zmq.Socket) -> None:
        for conn in list(self._conns.values()):
            if sock is conn.monitor:
                try:
                    ev = recv_monitor_message(conn.monitor, zmq.NOBLOCK)
                except zmq.Again:
                    return
                if ev.get("event") == zmq.EVENT_DISCONNECTED and conn.state == "ready":
                    self._lose_conn(conn, f"producer {conn.address} disconnected")
                return
            if sock is conn.sock:
                for _ in range(64):
                    try:
                        data = conn.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        return
                    conn.last_heard = time.monotonic()
                    try:
                        msg = P.decode(data)
                    except ECNixlError as e:
                        # A producer that sends what is no message cannot be trusted with what is
                        # pending on it: fail that now, naming the problem, instead of timing out.
                        self.metrics.fail("BAD_MESSAGE")
                        why = f"producer {conn.address} sent a malformed message: {e}"
                        if conn.state == "ready":
                            self._lose_conn(conn, why)
                        elif conn.state == "connecting":
                            self._fail_conn(conn, why, "BAD_MESSAGE")
                        return
                    try:
                        self._on_reply(conn, msg)
                    except ECNixlError as e:
                        logger.warning("bad message from producer %s: %s", conn.address, e)
                        self.metrics.fail("BAD_MESSAGE")
                    if conn.state == "failed":
                        return
                return

    def _on_reply(self, conn: _Conn, msg) -> None:
        if isinstance(msg, P.Welcome):
            return self._on_welcome(conn, msg)
        if isinstance(msg, P.Refused):
            if conn.state == "connecting" or msg.req == 0:
                return self._fail_conn(conn, f"producer {conn.address} refused: {msg.reason}: {msg.detail}",
                                       msg.reason)
            h = conn.holds.pop(msg.req, None)
            if h is not None:
                h.finish(msg.reason, msg.detail)
                self._changed = True
            for t in conn.by_req.pop(msg.req, []):
                self._fail(t, f"{msg.reason}: {msg.detail}", msg.reason)
            return
        if isinstance(msg, (P.Grant, P.StatsReply)):
            h = conn.holds.pop(msg.req, None)
            if h is not None:
                if isinstance(h, HoldRequest):
                    h.incarnation = conn.incarnation
                h.resolve(msg)
                self._changed = True
                return
            if isinstance(msg, P.Grant):
                self._on_grant(conn, msg)
            return
        if isinstance(msg, P.PushFailed):
            for s in msg.items:
                t = conn.pushed.pop(s.mm_hash, None)
                if t is not None:
                    self._fail_slot_safe(t, f"producer could not push: {s.status}: {s.detail}", s.status)
            return
        if isinstance(msg, P.CancelAck):
            safe = set(msg.safe)
            keep = []
            for slot, until in conn.zombies:
                if slot.tag in safe:
                    self.pool.quarantine(slot, 0.0)
                else:
                    keep.append((slot, until))
            conn.zombies = keep
            return
        if isinstance(msg, P.Heartbeat):
            return
        logger.warning("unexpected %s from producer %s", type(msg).__name__, conn.address)

    def _on_welcome(self, conn: _Conn, msg: P.Welcome) -> None:
        if conn.state != "connecting":
            return
        if not P.verify(msg, self._token, conn.nonce):
            return self._fail_conn(conn, f"producer {conn.address} failed authentication (token mismatch)",
                                   "UNAUTHORIZED")
        if msg.version != P.PROTOCOL_VERSION:
            return self._fail_conn(conn, f"producer {conn.address} speaks protocol {msg.version}, "
                                   f"we speak {P.PROTOCOL_VERSION}", "VERSION")
        if msg.compat != self.compat and not self.cfg.observer:
            return self._fail_conn(conn, f"producer {conn.address} is incompatible (compat hash "
                                   f"{msg.compat} != {self.compat}: model/dtype/width/block differ)", "INCOMPAT")
        logger.debug("handshake with %s (%s) done: session %s", conn.address, msg.name, msg.session)
        conn.session, conn.name, conn.incarnation = msg.session, msg.name, msg.incarnation
        if self.transport is not None:
            if msg.agent_md is None or msg.arena is None:
                return self._fail_conn(conn, f"producer {conn.address} serves no data (control-only)",
                                       "INCOMPAT")
            try:
                conn.peer = self.transport.add_peer(msg.agent_md, msg.arena, msg.incarnation, msg.name)
            except Exception as e:
                return self._fail_conn(conn, f"cannot add producer {conn.address} as NIXL peer: {e}", "INCOMPAT")
            conn.mode = self._choose_mode(conn)
        conn.state = "ready"
        self._by_session[conn.session] = conn
        waiting, conn.waiting = conn.waiting, []
        for w in waiting:
            if isinstance(w, LoadTicket):
                self._dispatch(conn, w)
            else:
                self._send(conn, w.message(conn.session))

    def _choose_mode(self, conn: _Conn) -> str:
        """Time a small READ and WRITE over the real path; pick the faster unless forced."""
        peer = conn.peer
        n = self.cfg.probe_blocks
        if self.cfg.mode != "auto":
            mode = self.cfg.mode
            read_s = write_s = float("nan")
        else:
            read_s = self.transport.probe(peer, "READ", n)
            write_s = self.transport.probe(peer, "WRITE", n)
            mode = "read" if read_s <= write_s else "write"
        gbps = (n * self.cfg.block_bytes) / (read_s if mode == "read" else write_s) / 1e9 \
            if self.cfg.mode == "auto" else float("nan")
        self.metrics.link_modes[conn.name] = mode
        logger.info("ec-nixl link %s -> %s: mode=%s (probe %d KiB: READ %.1f us, WRITE %.1f us)",
                    conn.name, self.cfg.name, mode, n * self.cfg.block_bytes >> 10, read_s * 1e6, write_s * 1e6)
        slow = 5.0 if self.transport.arena.mem_type == "VRAM" else 0.5
        if gbps == gbps and gbps < slow:
            logger.warning(
                "ec-nixl link %s uses %s at only %.2f GB/s: the path looks emulated (e.g. UCX tcp instead "
                "of cuda_ipc/rdma/cma); check UCX_TLS and UCX_PROTO_INFO=y", conn.name, mode.upper(), gbps)
        return mode

    def _on_grant(self, conn: _Conn, msg: P.Grant) -> None:
        batch = conn.by_req.pop(msg.req, None)
        if batch is None:
            return  # a late answer for tickets already failed
        by_hash = {t.mm_hash: t for t in batch}
        for s in msg.items:
            t = by_hash.pop(s.mm_hash, None)
            if t is None or t.state != PENDING:
                continue
            if s.status == "ready":
                try:
                    P.validate_state_matches(s, t.ref.desc, conn.peer.arena)
                except ECNixlError as e:
                    self._fail(t, str(e), "BAD_GRANT")
                    continue
                self._post_read(conn, t, s.block)
            elif s.status in (P.Nack.NOT_READY.value, P.Nack.BUSY.value):
                self.metrics.count("retries")
                t.phase = "grant"
                t.retry_at = time.monotonic() + 0.0005
                self._retry.append(t)
            else:
                self.metrics.count("nacks")
                self._fail(t, f"{s.status}: {s.detail}", s.status)
        for t in by_hash.values():
            self._fail(t, "producer's grant left this item out", "BAD_GRANT")

    def _poll_reads(self) -> None:
        still: list[LoadTicket] = []
        done: dict[int, tuple[Xfer, list[LoadTicket]]] = {}
        for t in self._reads:
            if t.state != PENDING:
                continue
            st = self.transport.poll(t.xfer)
            if st == "PROC":
                still.append(t)
            elif st == "DONE":
                done.setdefault(id(t.xfer), (t.xfer, []))[1].append(t)
            else:
                self._fail_xfer(t, f"READ from {t.ref.producer} failed (NIXL ERR)", "XFER_ERR")
        self._reads = still
        for x, tickets in done.values():
            self._record(x, tickets[0].t_post)
            for t in tickets:
                t.xfer = None
                self._landed(t, record=False)
            self._notify_read(tickets)

    def _record(self, x: Xfer, t_post: float) -> None:
        """Telemetry of one finished request (all its items), then release it."""
        tel = self.transport.telemetry(x)
        self.transport.release(x)
        if tel is not None:
            self.metrics.transfer(x.nbytes, tel[0] * 1e-6, tel[1] * 1e-6, tel[3])
        else:
            self.metrics.transfer(x.nbytes, 0.0, time.perf_counter() - t_post)

    def _notify_read(self, tickets: list[LoadTicket]) -> None:
        """Tell the producer these readers are done with the items (it frees each after all readers)."""
        conn = self._conns.get(tickets[0].ref.producer)
        if conn is None or conn.peer is None:
            return  # producer gone: its lease expiry frees the items
        by_reader: dict[int, list[str]] = {}
        for t in tickets:
            by_reader.setdefault(t.ref.reader, []).append(t.mm_hash)
        for reader, hashes in by_reader.items():
            try:
                self.transport.send_notif(conn.peer.name, P.encode_notif(P.NOTIF_READ_DONE, conn.session,
                                                                         hashes, reader))
            except Exception as e:  # the lease still frees the items
                logger.debug("read-done notification to %s failed: %s", conn.address, e)

    def _landed(self, t: LoadTicket, record: bool = True) -> None:
        """The item's bytes are in our pool (READ done, or the producer's WRITE notification)."""
        t.t_done = time.perf_counter()
        if record:  # a pushed item: the producer timed the WRITE; we see post -> notification
            self.metrics.transfer(t.ref.desc.nbytes, 0.0, t.t_done - t.t_post)
        t.state, t.phase = LANDED, "done"
        t.tensor()  # build the view now, off the waiter's path
        self.metrics.count("loads_landed")
        self._changed = True

    def _fail(self, t: LoadTicket, error: str, reason: str, retryable: bool = False) -> None:
        """Fail a ticket whose slot no DMA can touch (none posted, or it finished)."""
        if t.state != PENDING:
            return
        if t.slot is not None:
            self.pool.release(t.slot)
            t.slot = None
        self._set_failed(t, error, reason, retryable)

    def _fail_slot_safe(self, t: LoadTicket, error: str, reason: str) -> None:
        self._fail(t, error, reason, retryable=reason in (P.Nack.NOT_READY.value, P.Nack.BUSY.value))

    def _fail_xfer(self, t: LoadTicket, error: str, reason: str) -> None:
        """Fail a ticket whose READ may still be running: its slot waits in quarantine."""
        if t.state != PENDING:
            return
        slot, t.slot = t.slot, None
        x, t.xfer = t.xfer, None
        self.metrics.count("failed_transfers")
        if x is not None and not self.transport.release(x):
            self._zombies.append((x, slot))
        elif slot is not None:
            self.pool.quarantine(slot, self.cfg.quarantine_s, reason=reason)
            self.metrics.count("quarantined")
        self._set_failed(t, error, reason, False)

    def _cancel(self, tickets: list[LoadTicket], why: str) -> None:
        for t in tickets:
            if t.state != PENDING:
                continue
            msg = f"item {t.mm_hash} from {t.ref.producer}: {why} (was in phase '{t.phase}')"
            if t.phase == "read":
                self._fail_xfer(t, msg, "CANCELLED")
            elif t.phase == "push":
                conn = self._conns.get(t.ref.producer)
                slot, t.slot = t.slot, None
                if conn is not None:
                    conn.pushed.pop(t.mm_hash, None)
                    conn.zombies.append((slot, time.monotonic() + self.cfg.quarantine_s))
                    self._send(conn, P.Cancel(session=conn.session, req=next(self._reqs), mm_hashes=[t.mm_hash]))
                elif slot is not None:
                    self.pool.quarantine(slot, self.cfg.quarantine_s, reason="CANCELLED")
                self.metrics.count("quarantined")
                self._set_failed(t, msg, "CANCELLED", True)
            else:
                self._fail(t, msg, "CANCELLED", retryable=True)

    def _set_failed(self, t: LoadTicket, error: str, reason: str, retryable: bool) -> None:
        t.state, t.phase, t.error, t.reason, t.retryable = FAILED, "done", error, reason, retryable
        t.t_done = time.perf_counter()
        self.metrics.count("loads_failed")
        self.metrics.fail(reason)
        self._changed = True

    def _fail_conn(self, conn: _Conn, error: str, reason: str) -> None:
        logger.warning("ec-nixl: %s", error)
        conn.state, conn.error, conn.reason = "failed", error, reason
        conn.t_start = time.monotonic()
        waiting, conn.waiting = conn.waiting, []
        for w in waiting:
            if isinstance(w, LoadTicket):
                self._fail(w, error, reason)
        for h in conn.holds.values():
            h.finish(reason, error)
        conn.holds.clear()
        self._changed = True

    def _lose_conn(self, conn: _Conn, error: str) -> None:
        """The producer went away: fail what waits on it, quarantine what a DMA may touch."""
        logger.warning("ec-nixl: %s", error)
        for t in list(self._reads):
            if t.state == PENDING and t.ref.producer == conn.address:
                self._fail_xfer(t, error, "PEER_LOST")
        for batch in conn.by_req.values():
            for t in batch:
                self._fail(t, error, "PEER_LOST")
        conn.by_req.clear()
        for t in conn.get_queue + conn.push_queue + conn.waiting + [t for t, _ in conn.read_queue]:
            if isinstance(t, LoadTicket):
                self._fail(t, error, "PEER_LOST")
        conn.read_queue = []
        conn.get_queue, conn.push_queue, conn.waiting = [], [], []
        for t in list(conn.pushed.values()):
            # A WRITE may have been posted by the (maybe only partitioned) producer.
            slot, t.slot = t.slot, None
            if slot is not None:
                self.pool.quarantine(slot, self.cfg.quarantine_s, reason="PEER_LOST")
                self.metrics.count("quarantined")
            self._set_failed(t, error, "PEER_LOST", False)
        conn.pushed.clear()
        for slot, _ in conn.zombies:
            self.pool.quarantine(slot, self.cfg.quarantine_s, reason="PEER_LOST")
        conn.zombies = []
        for h in conn.holds.values():
            h.finish("UNREACHABLE", error)
        conn.holds.clear()
        self._drop_conn(conn)
        self._changed = True

    def _drop_conn(self, conn: _Conn) -> None:
        self._conns.pop(conn.address, None)
        self._by_session.pop(conn.session, None)
        for s in (conn.sock, conn.monitor):
            try:
                self._poller.unregister(s)
            except KeyError:
                pass
        try:
            conn.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        conn.monitor.close(0)
        conn.sock.close(0)
        if self.transport is not None and conn.name and conn.name in self.transport.peers:
            self.transport.forget_peer(conn.name)

    def _timeout_msg(self, t: LoadTicket) -> str:
        waited = time.perf_counter() - t.t_start
        return (f"item {t.mm_hash} from {t.ref.producer} not landed after {waited:.2f}s "
                f"(stuck in phase '{t.phase}')")

    def _on_write_done(self, agent: str, sid: str, mm_hashes: list[str]) -> None:
        """A producer's WRITE into our pool finished: those items landed."""
        conn = self._by_session.get(sid)
        if conn is None or conn.name != agent:
            return
        for mm_hash in mm_hashes:
            t = conn.pushed.pop(mm_hash, None)
            if t is not None and t.state == PENDING:
                self._landed(t)

    def _tick_loads(self, now: float) -> None:
        """Deadlines, retries, handshakes, heartbeats, zombies: the consumer's timers."""
        for conn in list(self._conns.values()):
            if conn.state == "connecting":
                if now - conn.t_start > self.cfg.peer_timeout_s:
                    self._fail_conn(conn, f"producer {conn.address} unreachable (no handshake in "
                                    f"{self.cfg.peer_timeout_s:.1f}s)", "UNREACHABLE")
                elif now - conn.last_hb > min(2.0, 0.1 * (1 << min(conn.hellos, 5))):
                    # IMMEDIATE drops sends before the connection is up: resend, 0.2 s, 0.4 s, ... 2 s
                    conn.last_hb = now
                    conn.hellos += 1
                    self._send(conn, self._hello(conn))
                continue
            if conn.state != "ready":
                continue
            for req, h in list(conn.holds.items()):
                if now >= h.deadline:
                    del conn.holds[req]
                    h.finish("TIMEOUT", f"no answer from {conn.address} to a {h.kind}")
                    self._changed = True
            if conn.busy:
                if conn.idle:  # the silence clock starts with the work (however long we were idle)
                    conn.idle = False
                    conn.last_heard = max(conn.last_heard, now)
                if now - conn.last_heard > self.cfg.peer_timeout_s:
                    self._lose_conn(conn, f"producer {conn.address} silent for {self.cfg.peer_timeout_s:.1f}s")
                    continue
                if now - conn.last_hb > self.cfg.heartbeat_s:
                    conn.last_hb = now
                    self._send(conn, P.Heartbeat(session=conn.session))
            else:
                conn.idle = True
            for req, batch in list(conn.by_req.items()):
                if all(t.state != PENDING for t in batch):
                    del conn.by_req[req]
                    continue
                for t in batch:
                    if now >= t.deadline:
                        self._fail(t, self._timeout_msg(t), "TIMEOUT", retryable=True)
            for h, t in list(conn.pushed.items()):
                if t.state != PENDING:
                    conn.pushed.pop(h, None)
                elif now >= t.deadline:
                    conn.pushed.pop(h, None)
                    slot, t.slot = t.slot, None
                    conn.zombies.append((slot, now + self.cfg.quarantine_s))
                    self.metrics.count("quarantined")
                    self._send(conn, P.Cancel(session=conn.session, req=next(self._reqs), mm_hashes=[h]))
                    self._set_failed(t, self._timeout_msg(t), "TIMEOUT", True)
            if conn.zombies:
                keep = []
                for slot, until in conn.zombies:
                    if now >= until + self.cfg.quarantine_s:
                        self.pool.quarantine(slot, 0.0)  # no ack for long: producer must be gone
                    else:
                        keep.append((slot, until))
                conn.zombies = keep
        for t in self._reads:
            if t.state == PENDING and now >= t.deadline:
                self._fail_xfer(t, self._timeout_msg(t), "TIMEOUT")
        if self._retry:
            retry, self._retry = self._retry, []
            for t in retry:
                if t.state != PENDING:
                    continue
                if now >= t.deadline:
                    self._fail(t, self._timeout_msg(t), "TIMEOUT", retryable=True)
                elif now < t.retry_at:
                    self._retry.append(t)
                else:
                    conn = self._conns.get(t.ref.producer)
                    if conn is None or conn.state != "ready":
                        self._fail(t, f"producer {t.ref.producer} lost", "PEER_LOST")
                    else:
                        self._dispatch(conn, t)
        for conn in list(self._conns.values()):
            for t in conn.waiting:
                if isinstance(t, LoadTicket) and now >= t.deadline:
                    self._fail(t, self._timeout_msg(t), "TIMEOUT", retryable=True)
            conn.waiting = [w for w in conn.waiting if not isinstance(w, LoadTicket) or w.state == PENDING]
        if self._zombies:
            keep = []
            for x, slot in self._zombies:
                if self.transport.release(x):
                    self.pool.quarantine(slot, self.cfg.quarantine_s, reason="ZOMBIE")
                else:
                    keep.append((x, slot))
            self._zombies = keep
