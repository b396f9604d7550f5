"""A PD's transfer ids: vLLM's EPD push flow names each item of a PD request with one.

vllm-router (and our proxy's push flow) sends the PD ``ec_transfer_params.ec_items``:
``[{"mm_hash": ..., "transfer_id": ...}, ...]``, and later, for a request it abandoned,
``{"op": "cancel", "transfer_id": ...}`` to the PD's control port. NixlEC loads each item from
the coordinates in its entry, so the ids are not needed to load; they say which request's item a
cancel means. A cancel reaches us on the control endpoint's I/O thread, the requests live on the
engine's thread: ``cancel`` only reads a dict and appends to a deque (both thread-safe), and the
scheduler takes what was cancelled at its next hook (``take_cancelled``).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Optional

logger = logging.getLogger("ec_nixl.vllm")

MAX_ID_CHARS = 256
MAX_ITEMS = 1024
ITEMS_KEY = "ec_items"


def parse_items(params: Any, hashes: set[str]) -> tuple[dict[str, Optional[str]], str]:
    """``ec_items`` of a request whose items are ``hashes``: transfer id -> mm_hash (None where the
    entry names none), and a problem with them ("" if none). A malformed list is dropped whole, and
    entries naming an mm_hash the request does not have are dropped: ec_items only name transfers,
    so neither changes what the request loads (its entries say that)."""
    items = params.get(ITEMS_KEY) if isinstance(params, dict) else None
    if items is None:
        return {}, ""
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        return {}, f"{ITEMS_KEY} must be a list of at most {MAX_ITEMS} objects"
    out: dict[str, Optional[str]] = {}
    strangers = []
    for e in items:
        tid = e.get("transfer_id") if isinstance(e, dict) else None
        h = e.get("mm_hash") if isinstance(e, dict) else None
        if not isinstance(tid, str) or not 0 < len(tid) <= MAX_ID_CHARS or (h is not None and not isinstance(h, str)):
            return {}, (f"each of {ITEMS_KEY} must be an object with a transfer_id (a string of 1-{MAX_ID_CHARS} "
                        f"characters) and an optional mm_hash (a string); got {str(e)[:80]!r}")
        if h is not None and h not in hashes:
            strangers.append(h)
            continue
        out[tid] = h
    if strangers:
        return out, f"{ITEMS_KEY} name items this request does not have: {', '.join(strangers[:4])}"
    if len(items) > len(hashes):
        return out, f"{ITEMS_KEY} has {len(items)} entries for {len(hashes)} media items"
    return out, ""


class TransferIds:
    """Transfer id -> (request id, mm_hash) of the requests this PD has, and the cancels received."""

    def __init__(self):
        self._of: dict[str, tuple[str, Optional[str]]] = {}
        self._by_req: dict[str, list[str]] = {}
        self._cancelled: collections.deque[str] = collections.deque()

    def seen(self, req_id: str, params: Any, hashes: set[str]) -> None:
        """A request arrived: remember its ``ec_items`` (a problem with them is logged, never fatal)."""
        ids, why = parse_items(params, hashes)
        if why:
            logger.warning("request %s: %s (ignored: its items load by their entries)", req_id, why)
        for tid, h in ids.items():
            self._of[tid] = (req_id, h)
        if ids:
            self._by_req[req_id] = list(ids)

    def forget(self, req_id: str) -> None:
        for tid in self._by_req.pop(req_id, ()):
            self._of.pop(tid, None)

    def cancel(self, transfer_id: str) -> tuple[bool, str]:
        """The router abandoned ``transfer_id`` (any thread). Whether a request of ours had it."""
        got = self._of.get(transfer_id)
        if got is None:
            return False, "no request of this PD has that transfer (finished, never arrived, or another PD's)"
        self._cancelled.append(transfer_id)
        return True, f"request {got[0]} stops waiting for it; a load already started ends with the request"

    def take_cancelled(self) -> dict[str, list[Optional[str]]]:
        """Request id -> the mm_hashes (None: every item) of the transfers cancelled since last time."""
        out: dict[str, list[Optional[str]]] = {}
        while self._cancelled:
            got = self._of.get(self._cancelled.popleft())
            if got is not None:  # (None: its request finished since)
                out.setdefault(got[0], []).append(got[1])
        return out
