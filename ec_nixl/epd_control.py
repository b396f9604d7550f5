"""vLLM's EPD consumer-control requests (vllm-router, ECMooncake), answered on an endpoint's port.

vllm-router asks a consumer's control address (its ``consumer_zmq``) over ZMQ REQ/REP with JSON:
``{"op": "peers"}`` -> ``{"ok": true, "result": {"ports": [...]}}`` (the consumer's shards on that
host), then ``{"op": "cancel", "transfer_id": ..., "abandon": true}`` on each shard for every
transfer a request abandoned; every answer is ``{"ok": bool, "result" | "error"}``. A REQ peer's
message reaches our ROUTER socket as ``[identity, b"", payload]``, a shape ec-nixl's own peers
never send (``[identity, payload]``), so both protocols share the port and the router's consumer
address for a NixlEC PD is simply its ``tcp://ec_ip:ec_port``.

What NixlEC answers: ``peers``: this endpoint's own port. ``cancel``: ``{"cancelled": false}``,
because a NixlEC consumer reserves nothing under a transfer id: its PD pulls once the request
arrives and gives a finished request's items back to their producer, and an item no PD ever
claims is freed by its producer (lease end, or eviction when the pool needs room). Anything else
gets ``ok: false`` and an error naming the problem; nothing here raises.
"""

from __future__ import annotations

import json
from typing import Any

MAX_ID_CHARS = 256


def answer(payload: bytes, port: int) -> bytes:
    """The JSON reply to one control request ``payload``."""
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
        return _reply(True, {"cancelled": False,
                             "detail": "NixlEC reserves nothing under a transfer id: the PD pulls at admission"})
    return _reply(False, f"unknown control op: {str(op)[:64]!r} (NixlEC answers 'peers' and 'cancel')")


def _reply(ok: bool, body: Any) -> bytes:
    return json.dumps({"ok": True, "result": body} if ok else {"ok": False, "error": body}).encode()
