"""vLLM's EPD consumer-control requests (vllm-router, ECMooncake), answered on an endpoint's port.

vllm-router asks a consumer's control address (its ``consumer_zmq``) over ZMQ REQ/REP with JSON:
``{"op": "peers"}`` -> ``{"ok": true, "result": {"ports": [...]}}`` (the consumer's shards on that
host), then ``{"op": "cancel", "transfer_id": ..., "abandon": true}`` on each shard for every
transfer a request abandoned; every answer is ``{"ok": bool, "result" | "error"}``. A REQ peer's
message reaches our ROUTER socket as ``[identity, b"", payload]``, a shape ec-nixl's own peers
never send (``[identity, payload]``), so both protocols share the port and the router's consumer
address for a NixlEC PD is simply its ``tcp://ec_ip:ec_port``.

What NixlEC answers: ``peers``: this endpoint's own port. ``cancel``: whether a request of this
PD has that transfer (``{"cancelled": bool, "detail": ...}``, from the PD's scheduler,
``vllm.transfers``): such a request stops waiting for the item. A NixlEC consumer reserves no
pool slot under a transfer id (its workers allocate one when they load the item, and a request
that ends gives it back behind the barrier's fence), and an item no PD ever claims is freed by
its producer (lease end, or eviction when the pool needs room), so an unknown id costs nothing.
A producer's port answers ``cancelled: false`` (it has no requests of a PD). Anything else gets
``ok: false`` and an error naming the problem; nothing here raises.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

MAX_ID_CHARS = 256


def answer(payload: bytes, port: int, cancel: Optional[Callable[[str], tuple[bool, str]]] = None) -> bytes:
    """The JSON reply to one control request ``payload``; ``cancel(transfer_id)`` -> (whether it was
    ours, detail) is the consumer's (None: a producer's port)."""
    try:
        req = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        return _reply(False, f"malformed control request: not JSON ({e})")
    if not isinstance(req, dict):
        return _reply(False, f"malformed control request: expected an object, got {type(req).__name__}")
    op = req.get("op")
    if op == "peers":
        return _reply(True, {"ports": [port]})
    if op == "cancel":
        tid = req.get("transfer_id")
        if not isinstance(tid, str) or not tid or len(tid) > MAX_ID_CHARS:
            return _reply(False, f"cancel needs a transfer_id (a string of 1-{MAX_ID_CHARS} characters)")
        if cancel is None:
            return _reply(True, {"cancelled": False, "detail": "a producer's port: cancels go to the consumer"})
        try:
            done, detail = cancel(tid)
        except Exception as e:  # a bug there must not take the control port down
            return _reply(False, f"cancel failed: {e!r}")
        return _reply(True, {"cancelled": done, "detail": detail})
    return _reply(False, f"unknown control op: {str(op)[:64]!r} (NixlEC answers 'peers' and 'cancel')")


def _reply(ok: bool, body: Any) -> bytes:
    return json.dumps({"ok": True, "result": body} if ok else {"ok": False, "error": body}).encode()
