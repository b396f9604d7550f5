"""A NixlEC PD under vLLM's EPD push flow (vllm-router's protocol), against vLLM's real types.

The PD's scheduler listens on its ``ec_port`` for the router's control requests (``peers``,
``cancel``: JSON over ZMQ REQ/REP); its requests carry ``ec_items`` (``transfer_id`` per item).
A real ZMQ REQ socket asks, as the router does; the producer is a real process serving over NIXL
(frozen with SIGSTOP where a Hold must stay outstanding: that is the only fault injected).
Each fault case says how long its request took to be decided.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import zmq

pytest.importorskip("vllm", reason="the vLLM CPU build is part of the test environment")

from peers import digest, make_item  # noqa: E402
from test_epd_control import BAD, ask  # noqa: E402
from test_vllm_adapter import (ROWS, WIDTH, admit, consumer_sides, feature, params_for,  # noqa: E402, F401
                               producer, request, tiny_model)  # (consumer_sides, producer, tiny_model: fixtures)


def control_address(sched) -> str:
    return f"127.0.0.1:{sched.endpoint.server.port}"


def pushed(h: str, where: str, tid: str, **items) -> dict:
    """The PD's params in the push flow: the encoder's entry plus ``ec_items``."""
    return dict(params_for(h, where), ec_items=[{"mm_hash": h, "transfer_id": tid}], **items)


def test_the_pd_answers_the_routers_control_requests(producer, consumer_sides):
    """``peers`` names the PD's own port; a cancel for a transfer no request of it has is answered
    ``cancelled: false``; malformed requests get errors naming the problem; ec-nixl frames and a
    handshake from a confused peer are refused. The PD then still admits and loads a request."""
    vc, sched, worker = consumer_sides()
    assert sched.endpoint.server is not None, "a consumer-only PD must listen for the router"
    addr = control_address(sched)
    port = sched.endpoint.server.port
    assert port == vc.ec_transfer_config.ec_port
    assert ask(addr, b'{"op": "peers"}') == {"ok": True, "result": {"ports": [port]}}
    got = ask(addr, json.dumps({"op": "cancel", "transfer_id": "never-seen", "abandon": True}).encode())
    assert got["ok"] is True and got["result"]["cancelled"] is False and "no request" in got["result"]["detail"]
    for payload, words in BAD:
        got = ask(addr, payload)
        assert got["ok"] is False and words in got["error"], (payload, got)

    from ec_nixl import protocol as P

    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVTIMEO, 5000)
    d.connect(f"tcp://{addr}")
    try:
        d.send(b"\x00garbage")  # ec-nixl's frame shape, not a message
        assert isinstance(P.decode(d.recv()), P.Refused)
        d.send(P.encode(P.Hello(version=P.PROTOCOL_VERSION, compat="x", name="confused", incarnation="i", nonce=b"n" * 16)))
        r = P.decode(d.recv())
        assert isinstance(r, P.Refused) and "consumer's control port" in r.detail, r
    finally:
        d.close()

    producer.call("publish", [("after", (ROWS, WIDTH), "bfloat16", 3)])
    req = request("a", [feature("after", media=False)], pushed("after", producer.address, "t-after"))
    assert admit(sched, req)
    sched.update_state_after_alloc(req, 0)
    cache: dict = {}
    worker.start_load_caches(cache, sched.build_connector_meta(None))
    assert digest(cache["after"]) == digest(make_item(3, (ROWS, WIDTH), "bfloat16"))


@pytest.mark.parametrize("media", [False, True], ids=["metadata-only", "with-media"])
def test_a_cancel_stops_a_request_waiting_for_its_transfer(producer, consumer_sides, media):
    """The router abandons a request whose item is still gated (its producer froze before
    answering the Hold): its cancel is answered ``cancelled: true``, and at the next step the
    request stops waiting: failed with the reason when it has no media, encoded locally when it
    has. Nothing is handed to the workers, and once the request ends the id is forgotten."""
    # (with media, early admission would take it at once: nothing would wait for the transfer)
    vc, sched, worker = consumer_sides({"peer_timeout_s": "10", "early_admission": False})
    producer.call("publish", [("warm", (ROWS, WIDTH), "bfloat16", 1), ("held", (ROWS, WIDTH), "bfloat16", 2)])
    assert admit(sched, request("w", [feature("warm")], params_for("warm", producer.address)))
    req = request("c", [feature("held", media=media)], pushed("held", producer.address, "t-held"))
    producer.stop()
    try:
        assert sched.ensure_cache_available(req, 0) is False, "admitted before its producer held the item"
        t0 = time.monotonic()
        got = ask(control_address(sched), json.dumps({"op": "cancel", "transfer_id": "t-held",
                                                      "abandon": True}).encode())
        assert got == {"ok": True, "result": {"cancelled": True, "detail": got["result"]["detail"]}}, got
        meta = sched.build_connector_meta(None)
        assert "held" not in {s.desc.mm_hash for s in meta.loads + meta.prefetch}
        if media:
            assert sched.ensure_cache_available(req, 0) is True  # vLLM encodes it itself
            assert not sched.has_cache_item("held")
            assert sched._reqs["c"].items["held"].status == "local"
        else:
            assert sched.ensure_cache_available(req, 0) is False
            assert sched.take_unavailable_requests() == {"c"}
            assert "CANCELLED" in sched._reqs["c"].failed
        took = time.monotonic() - t0
        print(f"cancel -> request decided in {took * 1000:.1f} ms ({'local encode' if media else 'failed'})")
        assert took < 5
    finally:
        producer.cont()
    sched.request_finished(req)
    got = ask(control_address(sched), b'{"op": "cancel", "transfer_id": "t-held"}')
    assert got["result"]["cancelled"] is False, "a finished request's transfer id was kept"


def test_ec_items_that_do_not_match_the_media_change_nothing_it_loads(producer, consumer_sides, caplog):
    """``ec_items`` naming an item the request does not have, more ids than media, or a malformed
    list: logged with the problem, and the request loads its item by its entry, byte-exact."""
    vc, sched, worker = consumer_sides()
    cases = {
        "a stranger": [{"mm_hash": "not-in-request", "transfer_id": "t1"}],
        "too many": [{"mm_hash": "m1", "transfer_id": "t2"}, {"transfer_id": "t3"}],
        "malformed": [{"transfer_id": 7}],
        "not a list": {"transfer_id": "t4"},
    }
    producer.call("publish", [(f"m{i}", (ROWS, WIDTH), "bfloat16", 10 + i) for i in range(len(cases))])
    for i, (case, items) in enumerate(cases.items()):
        h = f"m{i}"
        req = request(f"r{i}", [feature(h, media=False)], dict(params_for(h, producer.address), ec_items=items))
        with caplog.at_level(logging.WARNING, logger="ec_nixl.vllm"):
            caplog.clear()
            assert admit(sched, req), case
        assert any("ec_items" in r.getMessage() for r in caplog.records), (case, caplog.text)
        sched.update_state_after_alloc(req, 0)
        cache: dict = {}
        worker.start_load_caches(cache, sched.build_connector_meta(None))
        assert digest(cache[h]) == digest(make_item(10 + i, (ROWS, WIDTH), "bfloat16")), case


def test_parse_items_names_each_problem():
    from ec_nixl.vllm.transfers import parse_items

    assert parse_items({}, {"a"}) == ({}, "")
    assert parse_items({"ec_items": [{"mm_hash": "a", "transfer_id": "t"}]}, {"a"}) == ({"t": "a"}, "")
    assert parse_items({"ec_items": [{"transfer_id": "t"}]}, {"a"}) == ({"t": None}, "")
    got, why = parse_items({"ec_items": [{"mm_hash": "b", "transfer_id": "t"}]}, {"a"})
    assert got == {} and "does not have: b" in why
    got, why = parse_items({"ec_items": [{"transfer_id": "t"}, {"transfer_id": "u"}]}, {"a"})
    assert "2 entries for 1 media" in why
    for bad in ("x", [1], [{"transfer_id": ""}], [{"transfer_id": "t", "mm_hash": 5}], [{}] * 2000):
        got, why = parse_items({"ec_items": bad}, {"a"})
        assert got == {} and "ec_items" in why, bad


def test_a_taken_control_port_is_logged_and_the_pd_serves_without_it(consumer_sides, caplog):
    """Two PDs on one host with one ``ec_port``: the second logs that routers' control requests
    to it will fail and runs without the port; ``control_port: false`` listens on nothing."""
    vc, first, _ = consumer_sides()
    with caplog.at_level(logging.WARNING, logger="ec_nixl.vllm"):
        vc2, second, _ = consumer_sides()
    assert first.endpoint.server is not None and second.endpoint.server is None
    assert "control requests (peers, cancel) to this PD will fail" in caplog.text
    first.shutdown()
    vc3, off, _ = consumer_sides({"control_port": False})
    assert off.endpoint is not None and off.endpoint.server is None


@pytest.mark.parametrize("media", [False, True], ids=["metadata-only", "with-media"])
def test_encoder_killed_after_it_answered(producer, consumer_sides, media):
    """E answered the router (its items published), then died before the PD's request arrived:
    the PD's Hold finds no producer, and the request fails with the reason (no media) or is
    encoded by the PD (media), within the PD's peer timeout; it never hangs."""
    vc, sched, worker = consumer_sides({"peer_timeout_s": "1", "missing_grace_s": "0.2"})
    producer.call("publish", [("gone", (ROWS, WIDTH), "bfloat16", 5)])
    where = producer.address
    producer.kill()
    req = request("k", [feature("gone", media=media)], pushed("gone", where, "t-gone"))
    t0 = time.monotonic()
    decided = admit(sched, req, timeout=20)
    took = time.monotonic() - t0
    print(f"E killed: request decided in {took * 1000:.0f} ms ({'local encode' if media else 'failed'})")
    if media:
        assert decided and not sched.has_cache_item("gone") and sched._reqs["k"].items["gone"].status == "local"
    else:
        assert not decided and sched.take_unavailable_requests() == {"k"}
        assert "gone" in sched._reqs["k"].failed and "127.0.0.1" in sched._reqs["k"].failed
    assert took < 10


def test_a_metadata_only_request_is_admitted_in_its_first_step(producer, consumer_sides):
    """``early_without_media`` (default): a request whose item is an ``image_embeds`` placeholder
    is scheduled in the step it arrives, as one with its media is, not after its Hold's round trip.
    The producer is frozen (SIGSTOP) from before the request arrives until the step is built, so
    no order depends on timing: the load goes to the worker without a place, and once the producer
    resumes the worker's own Get lands it byte-exact. If the producer stays frozen past
    ``load_timeout_s``, the request fails naming the item (nothing to encode here); the step does
    not hang, and the slot goes back."""
    from vllm.v1.outputs import ECConnectorOutput

    vc, sched, worker = consumer_sides({"admission_wait_s": "0", "load_timeout_s": "1", "mode": "read"})
    producer.call("publish", [("warm", (ROWS, WIDTH), "bfloat16", 1), ("ph", (ROWS, WIDTH), "bfloat16", 6),
                              ("late", (ROWS, WIDTH), "bfloat16", 7)])
    warm = request("w", [feature("warm")], params_for("warm", producer.address))
    assert admit(sched, warm)  # the link is up
    req = request("m", [feature("ph", media=False)], pushed("ph", producer.address, "t-ph"))
    producer.stop()
    try:
        assert sched.ensure_cache_available(req, 0) is True, "a metadata-only request waited for its Hold"
        sched.update_state_after_alloc(req, 0)
        meta = sched.build_connector_meta(None)
    finally:
        producer.cont()
    (spec,) = [s for s in meta.loads if s.desc.mm_hash == "ph"]
    assert spec.block == -1 and not spec.has_media
    cache: dict = {}
    worker.start_load_caches(cache, meta)
    assert digest(cache["ph"]) == digest(make_item(6, (ROWS, WIDTH), "bfloat16"))
    wm = worker.worker_meta()
    assert (0, "ph") in wm.loaded and not wm.failed, wm
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    assert sched.metrics.snapshot()["counters"]["early_admissions"] >= 1

    late = request("l", [feature("late", media=False)], pushed("late", producer.address, "t-late"))
    producer.stop()
    try:
        assert sched.ensure_cache_available(late, 0) is True
        sched.update_state_after_alloc(late, 0)
        meta = sched.build_connector_meta(None)
        t0 = time.monotonic()
        worker.start_load_caches({}, meta)
        took = time.monotonic() - t0
    finally:
        producer.cont()
    print(f"metadata-only early load from a frozen producer failed after {took * 1000:.0f} ms")
    assert took < 3, f"the step waited {took:.1f}s (load_timeout_s is 1 s)"
    wm = worker.worker_meta()
    assert [f[1:3] for f in wm.failed] == [("l", "late")] and "no media" in wm.failed[0][3], wm
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    assert "l" in sched.take_unavailable_requests()
    sched.request_finished(late)
    sched.update_state_after_free(req, 0)  # the first request's item is in the KV cache now
    sched.request_finished(req)
    sched.request_finished(warm)  # (its item was prefetched, never loaded)
    worker.start_load_caches({}, sched.build_connector_meta(None))  # (their releases)
    assert worker.endpoint.wait_for(lambda: worker.endpoint.pool.stats().used == 0, 10), worker.endpoint.pool.stats()
