"""vLLM's EPD consumer-control requests on an ec-nixl port (``ec_nixl/epd_control.py``).

vllm-router sends ``peers`` and ``cancel`` as JSON over a ZMQ REQ socket to a consumer's control
address; on a NixlEC instance that address is its ec-nixl port. A real producer process answers
here, asked by a real REQ socket, as the router would; its own consumers keep loading from it
before and after, and garbage on the REQ path gets an error answer, not a crash or a hang.
"""

from __future__ import annotations

import json

import pytest
import zmq

from helpers import fetch, refs_for

TIMEOUT_MS = 5000


def ask(address: str, payload: bytes) -> dict:
    """One REQ/REP exchange, as vllm-router's control client does it."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    s.setsockopt(zmq.SNDTIMEO, TIMEOUT_MS)
    s.connect(f"tcp://{address}")
    try:
        s.send(payload)
        return json.loads(s.recv())
    finally:
        s.close()


BAD = [
    (b"\x93\x01\x02", "not JSON"),
    (b"[1, 2]", "expected an object"),
    (b'{"op": "reserve", "transfer_id": "t"}', "unknown control op"),
    (b'{"no": "op"}', "unknown control op"),
    (b'{"op": "cancel"}', "needs a transfer_id"),
    (b'{"op": "cancel", "transfer_id": 7}', "needs a transfer_id"),
    (json.dumps({"op": "cancel", "transfer_id": "x" * 300}).encode(), "needs a transfer_id"),
]


def test_peers_and_cancel_answered_beside_the_data_plane(make_peer, make_consumer, device):
    prod = make_peer()
    specs = [("a", (8, 64), "float32", 1)]
    descs = prod.call("publish", specs)
    cons = make_consumer()
    fetch(cons, refs_for(prod, descs[:1]), specs, device)  # a consumer session is up before

    port = int(prod.address.rsplit(":", 1)[1])
    assert ask(prod.address, b'{"op": "peers"}') == {"ok": True, "result": {"ports": [port]}}
    got = ask(prod.address, json.dumps({"op": "cancel", "transfer_id": "abc", "reservation_id": "",
                                        "abandon": True}).encode())
    assert got["ok"] is True and got["result"]["cancelled"] is False, got
    for payload, words in BAD:
        got = ask(prod.address, payload)
        assert got["ok"] is False and words in got["error"], (payload, got)

    st = prod.call("stats")
    assert st["sessions"] == 1, f"a control request opened a session: {st['sessions']}"
    specs2 = [("b", (16, 64), "float32", 2)]
    descs2 = prod.call("publish", specs2)
    fetch(cons, refs_for(prod, descs2), specs2, device)  # and it still serves after


@pytest.mark.parametrize("payload,words", BAD)
def test_answer_names_the_problem(payload: bytes, words: str) -> None:
    from ec_nixl.epd_control import answer

    got = json.loads(answer(payload, 1234))
    assert got["ok"] is False and words in got["error"], got
