"""One rank's data plane: the pool, the NIXL transport and the control plane, driven by one thread.

An ``Endpoint`` is both sides at once:

* **producer** — ``publish()`` pins an encoder output in the registered pool and serves it to
  consumers that completed the handshake: ``Hold`` (lease + where is it), ``Get`` (grant a READ),
  ``Push`` (WRITE it into the consumer's reservation). Items are freed when every declared reader
  has read them, or when their lease expires.
* **consumer** — ``load()`` reserves a slot per item and fetches it by READ (pull) or WRITE
  (push), whichever the link probe at handshake found faster; ``LoadBarrier`` waits for them.

Threading: NIXL agents are not thread-safe, so everything that touches NIXL or a ZMQ socket runs
on one *owner thread*: the endpoint's I/O thread (``threaded=True``), or the thread that created
it (``threaded=False``; it must then call ``progress()``, which waits do for it). Other threads
hand work over through a queue. This module owns the state machines; it never blocks on a peer
without a deadline, and it never frees a slot that a DMA may still write.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from ec_nixl import protocol as P
from ec_nixl.arena import Arena
from ec_nixl.config import EndpointConfig, split_address
from ec_nixl.errors import (
    ConfigError,
    ECNixlError,
    IncompatiblePeer,
    ItemTooLarge,
    PoolExhausted,
    ProtocolError,
    TransferFailed,
)
from ec_nixl.metrics import Metrics
from ec_nixl.pool import Fence, Pool, Slot
from ec_nixl.transport import Peer, Transport, Xfer

logger = logging.getLogger("ec_nixl")

# After a peer's last request or notification, a threaded endpoint keeps driving NIXL every 1 ms
# for this long (consumers' READs may need our side's UCX progress), then polls every 50 ms.
_ACTIVE_S = 5.0

_MAX_HELLO_NONCES = 1 << 16  # handshakes remembered against replay

_TORCH_DTYPES = {name: getattr(torch, name) for name in P.DTYPE_SIZES if hasattr(torch, name)}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unsupported dtype {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in P.DTYPE_SIZES:
        raise ProtocolError(f"unsupported dtype {dtype} (known: {sorted(P.DTYPE_SIZES)})")
    return name


def describe(mm_hash: str, t: torch.Tensor) -> P.ItemDesc:
    return P.ItemDesc(mm_hash=mm_hash, shape=list(t.shape), dtype=dtype_name(t.dtype),
                      nbytes=t.numel() * t.element_size())


class Ready:
    """A host-side readiness flag usable as a fence (``query()``); for producers without CUDA."""

    def __init__(self, done: bool = False):
        self._done = done

    def set(self) -> None:
        self._done = True

    def query(self) -> bool:
        return self._done


# --------------------------------------------------------------------------------------------
# consumer side


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


PENDING, LANDED, FAILED = "pending", "landed", "failed"


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


# --------------------------------------------------------------------------------------------
# producer side


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
    __slots__ = ("id", "identity", "name", "peer", "last_seen", "arena", "group", "observer", "used")

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


# --------------------------------------------------------------------------------------------


class Endpoint:
    """Pool + transport + control plane of one rank. See the module docstring."""

    def __init__(self, cfg: EndpointConfig):
        self.cfg = cfg
        self.metrics = Metrics()
        self.incarnation = secrets.token_hex(8)
        self.compat = "" if cfg.observer else P.compat_hash({**cfg.compat, "block": cfg.block_bytes})
        self._token = cfg.token.encode() if cfg.token else None
        self._owner = threading.get_ident()
        self._lock = threading.Lock()  # items table (caller threads publish, owner serves)
        self._cv = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._reqs = itertools.count(1)
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._thread_error: Optional[BaseException] = None

        self.pool: Optional[Pool] = None
        self.transport: Optional[Transport] = None
        if cfg.pool_bytes:
            arena = Arena(cfg.pool_bytes, cfg.device)
            try:
                self.pool = Pool(arena, cfg.block_bytes, reserved_blocks=cfg.probe_blocks)
                self.transport = Transport(cfg.name, arena, cfg.block_bytes, tuple(cfg.backends),
                                           dict(cfg.backend_params), progress_thread=cfg.progress_thread)
            except Exception:
                arena.close()
                raise

        # producer state
        self._items: dict[str, _Item] = {}
        self._sessions: dict[str, _Session] = {}
        self._hello_nonces: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._active_pushes: list[tuple[_Item, _Push]] = []
        # consumer state
        self._conns: dict[str, _Conn] = {}
        self._by_session: dict[str, _Conn] = {}
        self._reads: list[LoadTicket] = []  # READs in flight
        self._retry: list[LoadTicket] = []  # waiting for pool space or a NOT_READY retry
        self._zombies: list[tuple[Xfer, Slot]] = []  # transfers NIXL could not cancel yet
        self._changed = False
        self._next_tick = 0.0
        self._last_activity = 0.0  # last request or notification from a peer (producer side)

        self._ctx = zmq.Context.instance()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self._server: Optional[zmq.Socket] = None
        self.address: Optional[str] = None
        if cfg.listen:
            host, port = split_address(cfg.listen, allow_any_port=True)
            self._server = self._ctx.socket(zmq.ROUTER)
            self._server.setsockopt(zmq.LINGER, 0)
            self._server.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._server.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
            try:
                if port == 0:
                    port = self._server.bind_to_random_port(f"tcp://{host}")
                else:
                    self._server.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as e:
                self._server.close()
                self.close()
                raise ConfigError(f"cannot listen on {cfg.listen}: {e}") from None
            self._poller.register(self._server, zmq.POLLIN)
            self.address = cfg.advertise or f"{host}:{port}"
        if cfg.threaded:
            self._thread = threading.Thread(target=self._run, name=f"ec-nixl-io-{cfg.name}", daemon=True)
            self._owner = -1
            self._thread.start()
            while self._owner == -1 and self._thread.is_alive():
                time.sleep(0.0005)

    # ========================================================================================
    # threading plumbing

    @property
    def is_owner(self) -> bool:
        return threading.get_ident() == self._owner

    def _run(self) -> None:
        self._owner = threading.get_ident()
        if self.transport is not None:
            self.transport.bind_owner()
        try:
            while not self._closed:
                self.progress(self._idle_timeout())
        except BaseException as e:  # pragma: no cover - a bug; make it visible to waiters
            logger.exception("ec-nixl I/O thread died")
            self._thread_error = e
            with self._cv:
                self._cv.notify_all()

    def _idle_timeout(self) -> float:
        if self._reads or self._active_pushes or self._commands:
            return 0.0
        if any(c.busy for c in self._conns.values()) or self._retry:
            return 0.001
        if time.monotonic() - self._last_activity < _ACTIVE_S and self.transport is not None:
            return 0.001  # peers may be reading from us: keep UCX progressing
        return 0.05

    def _exec(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the owner thread (now, if we are it)."""
        if self._thread_error is not None:
            raise RuntimeError(f"ec-nixl I/O thread died: {self._thread_error!r}")
        if self.is_owner:
            fn()
        else:
            self._commands.append(fn)
            os.eventfd_write(self._wake_fd, 1)

    def wait_for(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``pred()`` or ``timeout``; the owner pumps progress meanwhile."""
        deadline = time.monotonic() + timeout
        if self.is_owner:
            spins = 0
            while not pred():
                now = time.monotonic()
                if now >= deadline:
                    return False
                self.progress(0.0)
                spins += 1
                if spins > 200 and not pred():
                    time.sleep(min(0.0005, max(0.0, deadline - now)))
            return True
        with self._cv:
            while not pred():
                if self._thread_error is not None:
                    raise RuntimeError(f"ec-nixl I/O thread died: {self._thread_error!r}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(min(remaining, 0.1))
        return True

    def _notify(self) -> None:
        if self._changed:
            self._changed = False
            with self._cv:
                self._cv.notify_all()

    # ========================================================================================
    # the loop

    def progress(self, timeout: float = 0.0) -> None:
        """One round of I/O: messages, commands, NIXL completions, timers. Owner thread only."""
        if self._closed:
            return
        try:
            events = self._poller.poll(timeout * 1000.0 if timeout > 0 else 0)
        except zmq.ZMQError as e:  # pragma: no cover
            logger.warning("poll failed: %s", e)
            events = []
        for sock, _ in events:
            if sock == self._wake_fd:
                try:
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:
                    pass
            elif sock is self._server:
                self._serve_some()
            else:
                self._on_client_socket(sock)
        while self._commands:
            fn = self._commands.popleft()
            try:
                fn()
            except Exception:
                logger.exception("ec-nixl command failed")
        if self.transport is not None:
            if self._reads:
                self._poll_reads()
            if self._active_pushes:
                self._poll_pushes()
            self._drain_notifs()
        now = time.monotonic()
        if now >= self._next_tick:
            self._tick(now)
            self._next_tick = now + 0.002
        self._flush()
        self._notify()

    # ========================================================================================
    # producer API (any thread)

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
                    fence = _Both(ready, ev) if ready is not None else ev
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

    def _add_item(self, desc: P.ItemDesc, slot: Slot, ready: Optional[Fence]) -> None:
        with self._lock:
            self._items[desc.mm_hash] = _Item(desc, slot, ready, self.cfg.announce_lease_s)
        self.metrics.count("published")

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

    def _need_pool(self) -> Pool:
        if self.pool is None:
            raise ConfigError("this endpoint has no pool (pool_bytes=0): it can only hold/query")
        return self.pool

    # ========================================================================================
    # consumer API (any thread)

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

    # ========================================================================================
    # consumer internals (owner thread)

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
        conn = _Conn(address, sock, monitor, P.new_nonce())
        self._conns[address] = conn
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        hello = P.Hello(version=P.PROTOCOL_VERSION, compat=self.compat, name=self.cfg.name,
                        incarnation=self.incarnation, nonce=conn.nonce,
                        agent_md=self.transport.metadata if self.transport else None,
                        arena=self.transport.arena_info if self.transport else None,
                        group=self.cfg.group or "")
        P.sign(hello, self._token)
        try:
            sock.send(P.encode(hello), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet: IMMEDIATE queues nothing; retried in _tick
        return conn

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

    def query_stats(self, producer: str, timeout: float = 2.0) -> dict:
        """A producer's ``stats()`` (pool occupancy, counters), over an authenticated session."""
        r = StatsRequest(producer, next(self._reqs), time.monotonic() + timeout)
        split_address(producer)
        self._exec(lambda: self._send_hold(r))
        self.wait_for(lambda: r.done, timeout + 0.05)
        if r.stats is None:
            raise TransferFailed(f"no statistics from {producer}: {r.error or 'timed out'}", reason="STATS")
        return r.stats

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

    def cancel(self, tickets: list[LoadTicket], why: str = "cancelled by the caller") -> None:
        """Fail every still-pending ticket now (slots of possibly running DMAs go to quarantine)."""
        pending = [t for t in tickets if t.state == PENDING]
        if not pending:
            return
        self._exec(lambda: self._cancel(pending, why))
        self.wait_for(lambda: all(t.done for t in pending), 2.0)

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

    # ========================================================================================
    # producer internals (owner thread)

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
        def refuse(reason: P.Nack, detail: str):
            self.metrics.fail(reason.value)
            logger.warning("ec-nixl: refused %s (%s): %s", msg.name, reason.value, detail)
            self._reply(identity, P.Refused(reason=reason.value, detail=detail))

        if not P.verify(msg, self._token):
            return refuse(P.Nack.UNAUTHORIZED, "handshake not signed with the shared token")
        # A signed Hello proves the token only once: the same nonce from another connection is a
        # replay (its session would act for the real consumer's NIXL agent). Resends come from the
        # same connection and pass. The memory of nonces is bounded (oldest forgotten first).
        first = self._hello_nonces.setdefault(msg.nonce, identity)
        if len(self._hello_nonces) > _MAX_HELLO_NONCES:
            self._hello_nonces.popitem(last=False)
        if first != identity:
            return refuse(P.Nack.UNAUTHORIZED, "replayed handshake (its nonce came from another connection)")
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
        self._sessions[sid] = _Session(sid, identity, msg.name, peer, msg.arena, msg.group, observer)
        w = P.Welcome(version=P.PROTOCOL_VERSION, compat=self.compat, name=self.cfg.name,
                      incarnation=self.incarnation, session=sid, nonce=P.new_nonce(),
                      agent_md=self.transport.metadata if self.transport else None,
                      arena=self.transport.arena_info if self.transport else None)
        P.sign(w, self._token, msg.nonce)
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

    def _on_notif(self, agent: str, data: bytes) -> None:
        n = P.decode_notif(data)
        if n is None:
            logger.debug("ignoring foreign notification from %s", agent)
            return
        kind, sid, mm_hashes, reader = n
        if kind == P.NOTIF_READ_DONE:
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
        elif kind == P.NOTIF_WRITE_DONE:
            conn = self._by_session.get(sid)
            if conn is None or conn.name != agent:
                return
            for mm_hash in mm_hashes:
                t = conn.pushed.pop(mm_hash, None)
                if t is not None and t.state == PENDING:
                    self._landed(t)

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

    def _drain_notifs(self) -> None:
        try:
            notifs = self.transport.notifs()
        except Exception as e:  # pragma: no cover
            logger.warning("get_new_notifs failed: %s", e)
            return
        if notifs:
            self._last_activity = time.monotonic()
        for agent, data in notifs:
            self._on_notif(agent, data)

    # ========================================================================================
    # timers

    def _tick(self, now: float) -> None:
        # consumer: deadlines, retries, handshakes, heartbeats
        for conn in list(self._conns.values()):
            if conn.state == "connecting":
                if now - conn.t_start > self.cfg.peer_timeout_s:
                    self._fail_conn(conn, f"producer {conn.address} unreachable (no handshake in "
                                    f"{self.cfg.peer_timeout_s:.1f}s)", "UNREACHABLE")
                elif now - conn.last_hb > 0.2:  # IMMEDIATE drops sends before connect: resend
                    conn.last_hb = now
                    hello = P.Hello(version=P.PROTOCOL_VERSION, compat=self.compat, name=self.cfg.name,
                                    incarnation=self.incarnation, nonce=conn.nonce,
                                    agent_md=self.transport.metadata if self.transport else None,
                                    arena=self.transport.arena_info if self.transport else None,
                                    group=self.cfg.group or "")
                    P.sign(hello, self._token)
                    self._send(conn, hello)
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
        # producer: leases
        if self._items:
            self._expire_items(now)
        if self.pool is not None:
            self.pool.reclaim()

    def _timeout_msg(self, t: LoadTicket) -> str:
        waited = time.perf_counter() - t.t_start
        return (f"item {t.mm_hash} from {t.ref.producer} not landed after {waited:.2f}s "
                f"(stuck in phase '{t.phase}')")

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

    # ========================================================================================

    def stats(self) -> dict:
        """Metrics snapshot plus pool occupancy and table sizes (plain data)."""
        snap = self.metrics.snapshot()
        if self.pool is not None:
            snap["pool"] = vars(self.pool.stats())
        with self._lock:
            snap["items"] = len(self._items)
        snap["sessions"] = len(self._sessions)
        snap["peers"] = len(self._conns)
        return snap

    def close(self) -> None:
        """Stop the I/O thread, say goodbye to producers, deregister and free the pool."""
        if self._closed:
            return

        def bye():
            for conn in list(self._conns.values()):
                if conn.state == "ready":
                    self._send(conn, P.Bye(session=conn.session))

        try:
            if self._thread is not None and self._thread.is_alive():
                self._exec(bye)
                time.sleep(0.01)
            elif self.is_owner:
                bye()
        except Exception:
            pass
        self._closed = True
        if self._thread is not None:
            os.eventfd_write(self._wake_fd, 1)
            self._thread.join(timeout=5)
        for conn in list(self._conns.values()):
            try:
                self._drop_conn(conn)
            except Exception:
                pass
        if self._server is not None:
            self._server.close(0)
        os.close(self._wake_fd)
        if self.transport is not None:
            if self._thread is not None:
                self.transport.bind_owner()
            self.transport.close()
        if self.pool is not None:
            self.pool.arena.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _by_reader(tickets: list[LoadTicket]) -> dict[tuple[int, int], list[LoadTicket]]:
    out: dict[tuple[int, int], list[LoadTicket]] = {}
    for t in tickets:
        out.setdefault((t.ref.reader, t.ref.readers), []).append(t)
    return out


class _Both:
    """A fence that completes when both fences have."""

    def __init__(self, a: Fence, b: Fence):
        self.a, self.b = a, b

    def query(self) -> bool:
        return self.a.query() and self.b.query()
