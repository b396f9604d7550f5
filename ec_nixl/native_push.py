"""Pushes started by the publish itself: a parked Push's WRITE posted off the GIL (issue 40).

A consumer's Push that waits for an item not published yet (``Push.wait_s``) is *armed* here by
the server (owner thread): where the item goes (the consumer's prepped list and block) and the
notification that lands it, in the native hand-off (``handoff.NativeHandoff``). The publish
(any thread, the items table's lock held) *takes* the armed entries of the item it adds: each
becomes a push of the table (POSTED, so nothing frees or reuses the item's slot under it), and
the publish *fires* it at once, so its WRITE starts from the hand-off's thread without the GIL.
The pusher *adopts* those pushes on its next round and ends them as it ends its own: done,
refused (``PushFailed``), or released when the consumer went away; a Cancel or a session's end
takes back what is still armed (it never writes), and the pushes already fired are in flight.

What cannot go natively goes the Python way as before: an item whose copy is guarded by anything
but one CUDA event, a table full, an item whose size is not the one the consumer asked for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import msgspec

from ec_nixl import protocol as P
from ec_nixl.handoff import NativeHandoff
from ec_nixl.published import Item, Push
from ec_nixl.states import PushState
from ec_nixl.transport import NativeXfer


@dataclass
class Armed:
    key: int
    sid: str
    group: str
    readers: int
    reader: int
    req: int
    block: int
    nbytes: int
    peer: str


def cuda_event_of(ready) -> tuple[bool, Optional[int]]:
    """(whether the hand-off can wait for ``ready``, the raw CUevent or None). It waits for
    nothing (no fence) or for one CUDA event; any other fence stays Python's to query."""
    if ready is None:
        return True, None
    try:
        import torch

        if isinstance(ready, torch.cuda.Event):
            ptr = ready.cuda_event
            return bool(ptr), ptr or None
    except Exception:  # pragma: no cover - a torch without CUDA events
        pass
    return False, None


class NativePushes:
    def __init__(self, handoff: NativeHandoff, local_dlist, block_size: int):
        self.hx, self._local, self.block_size = handoff, local_dlist, block_size
        self._lock = threading.Lock()  # taken inside the items table's lock, never around it
        self._armed: dict[str, list[Armed]] = {}
        self._fired: list[tuple[Item, Push]] = []
        self._started: set[tuple[str, int, str, int]] = set()  # (sid, reader, mm_hash, req) a publish started
        self._next_key = 1

    # --- owner thread (the server) ---------------------------------------------------

    def arm(self, sid: str, group: str, peer, arena: P.ArenaInfo, msg: P.Push, hashes: set[str]) -> int:
        """Arm the items ``hashes`` of a parked Push (not published yet) that are not armed yet.
        Returns how many were armed now (the others go the Python way at their publish)."""
        n = 0
        for it in msg.items:
            if it.mm_hash not in hashes:
                continue
            capacity = P.blocks_for(it.nbytes, arena.block)
            if it.block < 0 or (it.block + capacity) * arena.block > arena.size or arena.block != self.block_size:
                continue  # refused at its publish, the Python way (claim_pushes says why)
            with self._lock:
                armed = self._armed.setdefault(it.mm_hash, [])
                if any(a.sid == sid and a.reader == msg.reader for a in armed):
                    continue
                key, self._next_key = self._next_key, self._next_key + 1
                notif = P.encode_notif(P.NOTIF_WRITE_DONE, sid, [it.mm_hash], msg.reader)
                if not self.hx.arm(key, peer.dlist, it.block, capacity, notif):
                    if not armed:
                        del self._armed[it.mm_hash]
                    continue
                armed.append(Armed(key, sid, group, max(1, msg.readers), msg.reader, msg.req, it.block, it.nbytes,
                                   peer.name))
                n += 1
        return n

    def unstarted(self, sid: str, msg: P.Push) -> P.Push:
        """``msg`` (a parked Push seen again) without the items a publish started already: their
        pushes are the pusher's, not to be claimed twice."""
        with self._lock:
            done = {it.mm_hash for it in msg.items if (sid, msg.reader, it.mm_hash, msg.req) in self._started}
            self._started -= {(sid, msg.reader, h, msg.req) for h in done}
        if not done:
            return msg
        return msgspec.structs.replace(msg, items=[it for it in msg.items if it.mm_hash not in done])

    def disarm(self, sid: str, hashes: Optional[set[str]] = None) -> None:
        """Take back session ``sid``'s armed entries (of ``hashes``; all when None): they never
        write. Entries a publish already took are pushes now, in flight."""
        taken = []
        with self._lock:
            self._started = {k for k in self._started if k[0] != sid or (hashes is not None and k[2] not in hashes)}
            for h in list(self._armed) if hashes is None else [h for h in hashes if h in self._armed]:
                keep = []
                for a in self._armed[h]:
                    (taken if a.sid == sid else keep).append(a)
                if keep:
                    self._armed[h] = keep
                else:
                    del self._armed[h]
        for a in taken:
            self.hx.take(a.key)

    def covers(self, sid: str, reader: int, hashes) -> bool:
        """Every item of ``hashes`` is armed for session ``sid``'s ``reader``: their publishes
        start the WRITEs, and nothing of that parked Push waits for the server's loop."""
        with self._lock:
            return all(any(a.sid == sid and a.reader == reader for a in self._armed.get(h, ())) for h in hashes)

    def take_fired(self) -> list[tuple[Item, Push]]:
        """The pushes publishes started since the last call (the pusher adopts them)."""
        with self._lock:
            out, self._fired = self._fired, []
        return out

    def armed(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._armed.values())

    # --- the publish (any thread) ------------------------------------------------------

    def take_armed(self, item: Item, claim: Callable[[Item, str, int, float], None],
                   now: float) -> tuple[list[Push], bool]:
        """The items table adds ``item`` (its lock held): each entry armed for it becomes a
        POSTED push of the table (its WRITE starts at ``fire``, right after the lock). Returns
        them, and whether any went back the Python way (the server must run for it now)."""
        with self._lock:
            armed = self._armed.pop(item.desc.mm_hash, None)
        if not armed:
            return [], False
        can, _ = cuda_event_of(item.ready)
        pushes, back = [], False
        for a in armed:
            if not can or a.nbytes != item.desc.nbytes:
                self.hx.take(a.key)  # the Python way: the re-run of the parked Push posts or refuses it
                back = True
                continue
            claim(item, a.group, a.readers, now)
            push = Push(a.sid, a.reader, a.block, item.desc.nbytes, a.req)
            push.native = True
            push.xfer = NativeXfer(a.key, item.desc.nbytes, a.peer, item.ready)
            push.state = PushState.POSTED
            item.pushes[(a.sid, a.reader)] = push
            pushes.append(push)
            with self._lock:
                self._started.add((a.sid, a.reader, item.desc.mm_hash, a.req))
        return pushes, back

    def fire(self, item: Item, pushes: list[Push]) -> bool:
        """Start the WRITEs of ``pushes`` (after the table's lock); the pusher adopts them (when
        the hand-off says they ended). False: one did not start (the server must run for it now)."""
        _, event = cuda_event_of(item.ready)
        nblocks = P.blocks_for(item.desc.nbytes, self.block_size)  # the item's blocks, as the consumer sized them
        started = True
        for push in pushes:
            if not self.hx.fire(push.xfer.key, self._local, item.slot.block, nblocks, event):
                # Taken back meanwhile (its consumer's link was dropped): it ends as a failed transfer.
                push.xfer.state = "ERR"
                self.hx.take(push.xfer.key)
                started = False
        with self._lock:
            self._fired.extend((item, p) for p in pushes)
        return started
