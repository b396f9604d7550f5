"""One rank's data plane: a thin facade over the parts it is composed of.

An ``Endpoint`` can be a producer, a consumer, or both (vLLM's ``ec_both``); it composes only
the parts its configuration needs, each given its collaborators here and owning its own state:

* ``OwnerLoop`` (``loop``) — the one thread that touches NIXL and the sockets;
* ``Pool`` over an ``Arena`` and the NIXL ``Transport`` — when ``pool_bytes`` > 0;
* ``Published`` (``items``) — the table of items this rank pins for others (with a pool);
* ``Server`` (``server``, with its ``Pusher``) — handshakes, holds, grants, pushes (with ``listen``);
* ``Links`` (``links``) — connections to producers and their queries (always; a control-only
  endpoint, e.g. vLLM's scheduler, uses nothing else);
* ``Loader`` (``loader``) — tickets and their transfers (with a pool); it composes its own parts
  (READ and WRITE lanes, the failure path, the clock).

The public methods below are the whole API; each delegates to the part that owns the work.
NIXL notifications (a producer's WRITE done) arrive on the shared agent: this module routes them.
The agent is named per incarnation (``handshake.agent_name``), not ``cfg.name``: the NIXL of a
peer refuses a name for good once a bad copy of its metadata reached it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Optional

import torch

from ec_nixl import protocol as P
from ec_nixl.arena import Arena
from ec_nixl.config import EndpointConfig
from ec_nixl.errors import ConfigError
from ec_nixl.handshake import Identity
from ec_nixl.links import Links
from ec_nixl.loader import Loader
from ec_nixl.loop import OwnerLoop
from ec_nixl.metrics import Metrics
from ec_nixl.native_push import NativePushes
from ec_nixl.pool import Fence, Pool, Slot
from ec_nixl.published import Published
from ec_nixl.queries import HoldRequest
from ec_nixl.server import Server
from ec_nixl.tickets import ItemRef, LoadTicket
from ec_nixl.transport import Transport

logger = logging.getLogger("ec_nixl")

ACTIVE_S = 5.0
"""After a peer's last request or notification, the loop runs more often for this long (see
``_activity_hint``), then falls back to its idle period."""
STATS_DETAIL_MAX = 32
"""``stats()`` says what keeps each item alive and who is connected while there are at most this
many of them (a full pool's table would swamp the answer)."""


class Endpoint:
    """Pool + transport + control plane of one rank. See the module docstring."""

    def __init__(self, cfg: EndpointConfig):
        self.cfg = cfg
        self.metrics = Metrics()
        self.stats_extra: Optional[Callable[[], dict]] = None
        """What an owner adds to ``stats()`` (a vLLM scheduler: its own and its workers' counters)."""
        self.me = Identity.of(cfg)
        self.loop = OwnerLoop(cfg.name)
        self.pool: Optional[Pool] = None
        self.transport: Optional[Transport] = None
        self.items: Optional[Published] = None
        self.server: Optional[Server] = None
        self.loader: Optional[Loader] = None
        self._last_activity = 0.0
        try:
            if cfg.pool_bytes:
                arena = Arena(cfg.pool_bytes, cfg.device)
                try:
                    self.pool = Pool(arena, cfg.block_bytes, reserved_blocks=cfg.probe_blocks)
                    self.transport = Transport(self.me.agent, arena, cfg.block_bytes, tuple(cfg.backends),
                                               dict(cfg.backend_params), progress_thread=cfg.progress_thread,
                                               progress_wait_s=cfg.nixl_progress_wait_s,
                                               native_handoff=cfg.native_handoff and cfg.listen is not None)
                except Exception:
                    arena.close()
                    raise
                self.items = Published(cfg, self.pool, self.metrics, wait_for=self.loop.wait_for,
                                       on_free=self.loop.changed, on_publish=self._published_some)
                if self.transport.handoff is not None:
                    self.items.native = NativePushes(self.transport.handoff, self.transport.local_dlist,
                                                     cfg.block_bytes)
            self.links = Links(cfg, self.me, self.loop, self.metrics, self.transport)
            if self.pool is not None:
                self.loader = Loader(cfg, self.pool, self.transport, self.metrics, self.loop, self.links)
            if cfg.listen:
                self.server = Server(cfg, self.me, self.loop, self.metrics, self.items, self.transport,
                                     self.stats, self._touch)
            if self.transport is not None:
                self.loop.every_round(self._drain_notifs)
                self.loop.idle_hint(self._activity_hint)
            self.loop.every_tick(self._tick)
        except Exception:
            self._close_parts()
            raise
        if cfg.threaded:
            self.loop.start(on_owner=self.transport.bind_owner if self.transport else (lambda: None),
                            gil_switch_s=cfg.gil_switch_interval_s)

    def _published_some(self, back: bool) -> None:
        """Answer the requests waiting for items now (from the publishing thread: via the loop),
        unless every one is the native hand-off's and the publish gave none back (``parked``):
        waking the loop then would only have it take the GIL from the publisher."""
        server = self.server
        if server is not None and not self.loop.closed and (back or server.parked.python):
            self.metrics.count("publish_wakes")
            try:
                self.loop.call(server.answer_parked)
            except RuntimeError as e:  # the I/O thread died: the endpoint reports that elsewhere
                logger.debug("waiting Holds not answered: %s", e)

    # --- identity --------------------------------------------------------------------

    @property
    def address(self) -> Optional[str]:
        """'host:port' consumers reach this producer at (None: not serving)."""
        return self.server.address if self.server is not None else None

    @property
    def incarnation(self) -> str:
        return self.me.incarnation

    @property
    def compat(self) -> str:
        return self.me.compat

    @property
    def is_owner(self) -> bool:
        return self.loop.is_owner

    # --- producer --------------------------------------------------------------------

    def _table(self) -> Published:
        if self.items is None:
            raise ConfigError("this endpoint has no pool (pool_bytes=0): it can only hold/query")
        return self.items

    def publish(self, mm_hash: str, tensor: torch.Tensor, ready: Optional[Fence] = None) -> P.ItemDesc:
        """Pin ``tensor`` for transfer under ``mm_hash``; returns its description (see ``publish_many``)."""
        return self._table().publish_many([(mm_hash, tensor)], ready)[0]

    def publish_many(self, items: list[tuple[str, torch.Tensor]], ready: Optional[Fence] = None) -> list[P.ItemDesc]:
        """Pin a step's encoder outputs (one pack for all copies); see ``Published.publish_many``."""
        return self._table().publish_many(items, ready)

    def reserve(self, nbytes: int, tag: str = "") -> Slot:
        """A pool slot to write an item into directly (zero-copy publish with ``publish_slot``)."""
        return self._table().reserve(nbytes, tag)

    def publish_slot(self, mm_hash: str, slot: Slot, shape, dtype: torch.dtype,
                     ready: Optional[Fence] = None) -> P.ItemDesc:
        """Publish bytes already written (or being written: ``ready``) into ``slot``; no copy."""
        return self._table().publish_slot(mm_hash, slot, shape, dtype, ready)

    def unpublish(self, mm_hash: str) -> bool:
        """Withdraw an item (no new Hold or Get finds it); its memory goes once no transfer uses it
        and no Hold answer still promises a holder its place. False if it was not published."""
        return self._table().unpublish(mm_hash)

    def published(self) -> list[str]:
        """The hashes of the items published now."""
        return self.items.hashes() if self.items is not None else []

    # --- consumer --------------------------------------------------------------------

    def _need_loader(self) -> Loader:
        if self.loader is None:
            raise ConfigError("this endpoint has no pool (pool_bytes=0): it can only hold/query")
        return self.loader

    def load(self, refs: Iterable[ItemRef], timeout: Optional[float] = None,
             wait_s: float = 0.0) -> list[LoadTicket]:
        """Start loading ``refs``; returns one ticket each at once (see ``LoadBarrier``).

        ``wait_s`` > 0: items the producer has not published yet are expected, not MISSING: it
        keeps the request up to ``wait_s`` (within ``timeout``; a producer caps it at
        ``protocol.MAX_HOLD_WAIT_S``) and serves each item the moment it is published: on a WRITE
        link its WRITE into our slot starts then, with no round trip after the publish; on a READ
        link its grant comes then. (Refs whose place a Hold gave are published already.)"""
        return self._need_loader().load(refs, timeout, wait_s)

    def cancel(self, tickets: list[LoadTicket], why: str = "cancelled by the caller") -> None:
        """Fail every still-pending ticket now (slots of possibly running DMAs go to quarantine)."""
        self._need_loader().cancel(tickets, why)

    def hold_async(self, producer: str, mm_hashes: list[str], readers: int = 1,
                   timeout: float = 2.0, wait_s: float = 0.0) -> HoldRequest:
        """Ask ``producer`` to keep items and say where they are; answers arrive on the request.
        ``wait_s``: items not published yet may be waited for that long (``protocol.Hold``)."""
        return self.links.hold_async(producer, mm_hashes, readers, timeout, wait_s)

    def hold(self, producer: str, mm_hashes: list[str], readers: int = 1,
             timeout: float = 1.0, wait_s: float = 0.0) -> dict[str, P.ItemState]:
        """Blocking ``hold_async``: one ItemState per hash."""
        return self.links.hold(producer, mm_hashes, readers, timeout, wait_s)

    def release(self, producer: str, mm_hashes: list[str], readers: int = 1) -> None:
        """Items a Hold of ours claimed that no reader of our group will read (``Links.release``)."""
        self.links.release(producer, mm_hashes, readers)

    def query_stats(self, producer: str, timeout: float = 2.0) -> dict:
        """A producer's ``stats()`` (pool occupancy, counters), over an authenticated session."""
        return self.links.query_stats(producer, timeout)

    # --- driving ---------------------------------------------------------------------

    def wait_for(self, pred, timeout: float) -> bool:
        """Wait until ``pred()`` or ``timeout``; the owner pumps progress meanwhile."""
        return self.loop.wait_for(pred, timeout)

    def progress(self, timeout: float = 0.0) -> None:
        """One round of I/O (owner thread only; waits call it for you)."""
        self.loop.progress(timeout)

    def _touch(self) -> None:
        self._last_activity = time.monotonic()

    def _activity_hint(self) -> Optional[float]:
        """How often the loop must run for NIXL's sake. Without NIXL's progress thread, only our
        calls run UCX: keep calling every 1 ms while peers were active lately (their transfers may
        need our side). With it (it sleeps on UCX's wake-up fds), UCX needs nothing from the loop:
        messages (ReadDone included) and commands wake it, WRITEs in flight have their own hint."""
        if self.transport.progress_thread:
            return None
        return 0.001 if time.monotonic() - self._last_activity < ACTIVE_S else 0.05

    def _drain_notifs(self) -> None:
        try:
            notifs = self.transport.notifs()
        except Exception as e:  # pragma: no cover
            logger.warning("get_new_notifs failed: %s", e)
            return
        if notifs:
            self._touch()
        for agent, data in notifs:
            n = P.decode_notif(data)
            if n is None:
                logger.debug("ignoring foreign notification from %s", agent)
                continue
            kind, sid, mm_hashes, reader = n
            if kind == P.NOTIF_WRITE_DONE and self.loader is not None:
                self.loader.on_write_done(agent, sid, mm_hashes)

    def _tick(self, now: float) -> None:
        if self.items is not None:
            self.items.expire(now)
        if self.pool is not None and self.pool.reclaim():
            self.loop.changed()  # a publisher may be waiting for that space

    def stats(self) -> dict:
        """Metrics snapshot plus pool occupancy and table sizes (plain data)."""
        snap = self.metrics.snapshot()
        if self.pool is not None:
            snap["pool"] = vars(self.pool.stats())
            snap["mem_type"] = self.pool.arena.mem_type
        snap["items"] = len(self.items) if self.items is not None else 0
        snap["sessions"] = len(self.server) if self.server is not None else 0
        if self.items is not None and len(self.items) <= STATS_DETAIL_MAX:
            snap["holding"] = self.items.inspect()  # why each item is still here
        if self.server is not None and len(self.server) <= STATS_DETAIL_MAX:
            snap["consumers"] = self.server.names()
        snap["peers"] = len(self.links)
        if self.transport is not None:
            snap["native_handoff"] = self.transport.handoff_why  # "on", or why pushes are posted in Python
        if self.items is not None and self.items.native is not None:
            snap["native_armed"] = self.items.native.armed()  # parked pushes whose publish will start them
        if self.items is not None and self.items.answers is not None:
            snap["native_noted"] = len(self.items.answers)  # parked Holds/Gets a publish may answer
        if self.stats_extra is not None:
            snap["connector"] = self.stats_extra()
        return snap

    # --- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Stop the I/O thread, say goodbye to producers, deregister and free the pool."""
        if self.loop.closed:
            return
        try:
            if self.loop.threaded:
                self.loop.call(self.links.say_goodbye)
                time.sleep(0.01)
            elif self.loop.is_owner:
                self.links.say_goodbye()
        except Exception:
            pass
        self.loop.stop()
        if self.transport is not None:
            self.transport.bind_owner()
        self._close_parts()

    def _close_parts(self) -> None:
        links = getattr(self, "links", None)
        if links is not None:
            links.close()
        if self.server is not None:
            self.server.close()
        self.loop.close()
        if self.transport is not None:
            self.transport.close()
        if self.pool is not None:
            self.pool.arena.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
