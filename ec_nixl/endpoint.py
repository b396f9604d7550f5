"""One rank's data plane: the pool, the NIXL transport and the control plane, driven by one thread.

An ``Endpoint`` is both sides at once:

* **producer** (``producer.Server``) — ``publish()`` pins encoder outputs in the registered pool
  and serves them to consumers that completed the handshake: ``Hold`` (lease + where is it),
  ``Get`` (grant a READ), ``Push`` (WRITE it into the consumer's reservation).
* **consumer** (``consumer.Loader``) — ``load()`` reserves a slot per item and fetches it by READ
  (pull) or WRITE (push), whichever the link probe at handshake found faster; ``LoadBarrier``
  waits for them.

Threading: NIXL agents are not thread-safe, so everything that touches NIXL or a ZMQ socket runs
on one *owner thread*: the endpoint's I/O thread (``threaded=True``), or the thread that created
it (``threaded=False``; it must then call ``progress()``, which waits do for it). Other threads
hand work over through a queue. This module owns the state, the thread and the loop that drives
both halves; it never blocks on a peer without a deadline.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import secrets
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

import zmq

from ec_nixl import protocol as P
from ec_nixl.arena import Arena
from ec_nixl.config import EndpointConfig, split_address
from ec_nixl.consumer import FAILED, LANDED, PENDING, HoldRequest, ItemRef, Loader, LoadTicket, StatsRequest
from ec_nixl.errors import ConfigError
from ec_nixl.metrics import Metrics
from ec_nixl.pool import Pool
from ec_nixl.producer import Server
from ec_nixl.tensors import Ready, describe, dtype_name, torch_dtype
from ec_nixl.transport import Transport

if TYPE_CHECKING:
    from ec_nixl.consumer import _Conn
    from ec_nixl.pool import Slot
    from ec_nixl.producer import _Item, _Push, _Session
    from ec_nixl.transport import Xfer

logger = logging.getLogger("ec_nixl")

# After a peer's last request or notification, a threaded endpoint keeps driving NIXL every 1 ms
# for this long (consumers' READs may need our side's UCX progress), then polls every 50 ms.
# With NIXL's progress thread, that thread runs UCX: the loop only drains notifications (every
# 5 ms, then 50 ms, while it holds items) and, holding nothing, sleeps until a message or a
# command wakes it (0.5 s at most, for timers).
_ACTIVE_S = 5.0
# While a WRITE of ours is in flight, sleep between polls instead of spinning: its completion
# needs the consumer's UCX (and our progress thread) to run, on CPUs that may be scarce. The
# sleep starts at 0.2 ms and grows with the WRITE's age up to 2 ms (a consumer that stopped
# driving its UCX can leave it in flight for long).
_PUSH_POLL_S = (0.0002, 0.002)

__all__ = ["Endpoint", "ItemRef", "LoadTicket", "HoldRequest", "StatsRequest", "Ready", "PENDING", "LANDED",
           "FAILED", "describe", "dtype_name", "torch_dtype"]


class Endpoint(Loader, Server):
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
                                           dict(cfg.backend_params), progress_thread=cfg.progress_thread,
                                           progress_wait_s=cfg.nixl_progress_wait_s)
            except Exception:
                arena.close()
                raise

        # producer state
        self._items: dict[str, _Item] = {}
        self._sessions: dict[str, _Session] = {}
        self._hello_nonces: collections.OrderedDict[bytes, tuple[bytes, Optional[str]]] = collections.OrderedDict()
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
        if self._reads or self._commands:
            return 0.0
        if self._active_pushes:  # posted WRITEs; or items not written yet (their fence)
            posted = [p.xfer.t_posted for _, p in self._active_pushes if p.state == "posted"]
            if not posted:
                return 0.001
            lo, hi = _PUSH_POLL_S
            return min(hi, max(lo, (time.monotonic() - max(posted)) / 4))
        if any(c.busy for c in self._conns.values()) or self._retry:
            return 0.001
        if self.transport is not None:
            recent = time.monotonic() - self._last_activity < _ACTIVE_S
            if not self.transport.progress_thread:
                return 0.001 if recent else 0.05  # peers' transfers may need our UCX progress
            if self._items:
                return 0.005 if recent else 0.05  # read-done notifications free what we hold
        return 0.5  # nothing held: only messages and commands (which wake the poller) matter

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

    def progress(self, timeout: float = 0.0) -> None:
        """One round of I/O: messages, commands, NIXL completions, timers. Owner thread only."""
        if self._closed:
            return
        try:
            events = self._poller.poll(timeout * 1000.0 if timeout >= 0.001 else 0)
        except zmq.ZMQError as e:  # pragma: no cover
            logger.warning("poll failed: %s", e)
            events = []
        if not events and 0 < timeout < 0.001:
            time.sleep(timeout)  # ZMQ polls in whole ms
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

    def _on_notif(self, agent: str, data: bytes) -> None:
        n = P.decode_notif(data)
        if n is None:
            logger.debug("ignoring foreign notification from %s", agent)
            return
        kind, sid, mm_hashes, reader = n
        if kind == P.NOTIF_READ_DONE:
            self._on_read_done(agent, sid, mm_hashes, reader)
        elif kind == P.NOTIF_WRITE_DONE:
            self._on_write_done(agent, sid, mm_hashes)

    def _need_pool(self) -> Pool:
        if self.pool is None:
            raise ConfigError("this endpoint has no pool (pool_bytes=0): it can only hold/query")
        return self.pool

    def _tick(self, now: float) -> None:
        self._tick_loads(now)
        if self._items:
            self._expire_items(now)
        if self.pool is not None:
            self.pool.reclaim()

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
