"""Late failures re-route instead of failing, and a producer restart the scheduler saw is seen by
the worker too: NixlECConnector's delegates on vLLM's real types, hook by hook (as in
tests/test_vllm_adapter.py, whose helpers these reuse), with producers as real processes.

A load that fails after admission (its producer died in between) must not fail a request that
carries its media: the worker adds the item to the step's ``scheduled_encoder_inputs``, which
vLLM's model runner encodes right after the connector's load hook, before the gather.
"""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

import pytest

from peers import ProducerProcess, digest, make_item
from helpers import timing

vllm = pytest.importorskip("vllm", reason="the vLLM CPU build is part of the test environment")

from test_vllm_adapter import (  # noqa: E402  (helpers on vLLM's real types)
    ROWS,
    WIDTH,
    admit,
    consumer_sides,  # noqa: F401  (fixture)
    feature,
    params_for,
    request,
    tiny_model,  # noqa: F401  (fixture)
    vllm_config,
)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402


@pytest.fixture
def vllm_producer(tiny_model):  # noqa: F811
    """Start (and restart) producers compatible with the tiny model's consumer."""
    from ec_nixl.vllm.options import compat_fields, parse_extra

    compat = compat_fields(vllm_config(tiny_model, "ec_consumer"), parse_extra({}))
    made = []

    def start(**kw):
        p = ProducerProcess(device="cpu", pool_bytes=32 << 20, compat=compat, **kw)
        made.append(p)
        return p

    yield start
    for p in made:
        p.close()


def step(sched, req) -> tuple[SchedulerOutput, object]:
    """One scheduled step with ``req``'s item as an external load, as vLLM builds it: the
    metadata rides in the SchedulerOutput, and the worker gets both pickled together."""
    sched.update_state_after_alloc(req, 0)
    so = SchedulerOutput.make_empty()
    meta = sched.build_connector_meta(so)
    so.ec_connector_metadata = meta
    so = pickle.loads(pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL))  # what the mp executor does
    return so, so.ec_connector_metadata


def encoded_by_vllm(so: SchedulerOutput, req) -> list[str]:
    """The hashes vLLM's V1 model runner encodes this step, by its own code."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = SimpleNamespace(requests={req.request_id: SimpleNamespace(mm_features=req.mm_features)})
    return GPUModelRunner._batch_mm_inputs_from_scheduler(runner, so)[0]


def test_worker_follows_the_producer_restart_the_scheduler_saw(vllm_producer, consumer_sides):  # noqa: F811
    """Issue 14 end to end on the adapter: a request loads from E; E is killed and restarted on
    the same port; the next request is held by the new E (scheduler) and must land on the
    worker, whose link still led to the old one, instead of failing."""
    vc, sched, worker = consumer_sides()
    first = vllm_producer()
    port = int(first.address.rsplit(":", 1)[1])
    first.call("publish", [("r1", (ROWS, WIDTH), "bfloat16", 11)])
    req = request("one", [feature("r1")], params_for("r1", first.address))
    assert admit(sched, req)
    so, meta = step(sched, req)
    cache: dict = {}
    worker.start_load_caches(cache, meta)
    assert digest(cache["r1"]) == digest(make_item(11, (ROWS, WIDTH), "bfloat16"))
    assert worker.worker_meta().loaded == [(0, "r1")]
    first.kill()
    second = vllm_producer(listen=f"127.0.0.1:{port}")
    second.call("publish", [("r2", (ROWS, WIDTH), "bfloat16", 12)])
    req2 = request("two", [feature("r2")], params_for("r2", second.address))
    t0 = time.monotonic()
    assert admit(sched, req2, timeout=30)
    so, meta = step(sched, req2)
    assert meta.loads[0].incarnation == second.incarnation
    worker.start_load_caches(cache, meta)
    timing("adapter: first request after the producer restart landed after", time.monotonic() - t0)
    assert digest(cache["r2"]) == digest(make_item(12, (ROWS, WIDTH), "bfloat16"))
    wm = worker.worker_meta()
    assert wm.loaded == [(0, "r2")] and not wm.failed and not wm.rerouted, wm
    assert so.scheduled_encoder_inputs == {}, "nothing re-encoded"


@pytest.mark.parametrize("media", [True, False], ids=["with-media", "metadata-only"])
def test_load_failing_after_admission(vllm_producer, consumer_sides, media):  # noqa: F811
    """The producer dies between admission and load. With its media the item joins this step's
    encoder inputs (vLLM's own runner code picks it up), the request goes on and the fallback
    is counted; without media the request fails, its message naming the item and the cause."""
    vc, sched, worker = consumer_sides({"peer_timeout_s": "1", "load_timeout_s": "1"})
    prod = vllm_producer()
    prod.call("publish", [("late", (ROWS, WIDTH), "bfloat16", 21)])
    req = request("r", [feature("late", media=media)], params_for("late", prod.address))
    assert admit(sched, req)
    prod.kill()
    so, meta = step(sched, req)
    assert meta.loads[0].has_media is media and meta.step is so
    cache: dict = {}
    t0 = time.monotonic()
    worker.start_load_caches(cache, meta)
    timing(f"adapter: load failing after admission ({'media' if media else 'no media'}) decided after",
           time.monotonic() - t0)
    assert meta.step is None, "the worker drops the SchedulerOutput reference"
    wm = worker.worker_meta()
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    counters = sched.get_stats().reduce()
    if media:
        assert so.scheduled_encoder_inputs == {"r": [0]} and encoded_by_vllm(so, req) == ["late"]
        assert "late" not in cache, "the entry is left for the encoder to fill"
        assert wm.rerouted and wm.rerouted[0][1:3] == ("r", "late") and not wm.failed, wm
        assert sched.take_unavailable_requests() == set()
        assert counters["local_fallbacks"] == 1 and counters["late_fallbacks"] == 1, counters
        assert sched.request_finished(req)[1] == {"ec_nixl_consumer": {"loaded": [], "local": ["late"]}}
    else:
        assert so.scheduled_encoder_inputs == {} and not cache["late"].any(), "zero placeholder, no encode"
        assert wm.failed and wm.failed[0][1:3] == ("r", "late") and not wm.rerouted, wm
        why = wm.failed[0][3]
        assert prod.address in why and "no media" in why, why
        assert sched.take_unavailable_requests() == {"r"}
        assert counters["late_fallbacks"] == 0, counters
    assert worker.endpoint.pool.stats().used == 0


def test_no_reroute_without_the_steps_own_scheduler_output(vllm_producer, consumer_sides):  # noqa: F811
    """If the metadata did not arrive inside its SchedulerOutput (a serialisation that does not
    keep shared references), adding to a copy would not reach the encoder and the gather would
    crash the engine: the worker fails the request instead."""
    vc, sched, worker = consumer_sides({"peer_timeout_s": "1", "load_timeout_s": "1"})
    prod = vllm_producer()
    prod.call("publish", [("copy", (ROWS, WIDTH), "bfloat16", 31)])
    req = request("c", [feature("copy")], params_for("copy", prod.address))
    assert admit(sched, req)
    prod.kill()
    so, meta = step(sched, req)
    meta.step = pickle.loads(pickle.dumps(so))  # a copy: not the runner's object
    worker.start_load_caches({}, meta)
    wm = worker.worker_meta()
    assert wm.failed and not wm.rerouted and so.scheduled_encoder_inputs == {}, wm


def test_an_early_load_from_a_producer_that_stopped_answering_is_encoded_here(vllm_producer, consumer_sides):  # noqa: F811
    """FAULT INJECTION: the producer freezes (SIGSTOP) as a request with its media arrives: it is
    admitted early (the producer answered until then), and its Hold stays unanswered, so its load
    goes to the worker without a place. The worker's Get cannot be answered: the step waits ``early_load_wait_s`` for it, not
    ``load_timeout_s``, and the item joins the step's encoder inputs (encoded by vLLM in the same
    step). The scheduler then admits no more early from that producer: the next request waits for
    its Hold."""
    vc, sched, worker = consumer_sides({"admission_wait_s": "0"})
    prod = vllm_producer()
    prod.call("publish", [("warm", (ROWS, WIDTH), "bfloat16", 1), ("stuck", (ROWS, WIDTH), "bfloat16", 2),
                          ("next", (ROWS, WIDTH), "bfloat16", 3)])
    warm = request("w", [feature("warm")], params_for("warm", prod.address))
    assert admit(sched, warm)
    so, meta = step(sched, warm)
    worker.start_load_caches({}, meta)  # the worker's link is up too
    assert worker.worker_meta().loaded == [(0, "warm")]
    req = request("s", [feature("stuck")], params_for("stuck", prod.address))
    prod.stop()  # before the Hold goes out (it would be answered in about a millisecond): it stays unanswered
    try:
        assert sched.ensure_cache_available(req, 0) is True, "connected and answering: admitted early"
        so, meta = step(sched, req)
        assert meta.loads[0].block == -1 and meta.loads[0].has_media
        t0 = time.monotonic()
        worker.start_load_caches({}, meta)
        took = timing("adapter: early load from a frozen producer encoded here after", time.monotonic() - t0)
    finally:
        prod.cont()
    assert took < worker.opts.early_load_wait_s + 1.5, f"the step waited {took:.2f}s (load_timeout_s is 5 s)"
    assert so.scheduled_encoder_inputs == {"s": [0]} and encoded_by_vllm(so, req) == ["stuck"]
    wm = worker.worker_meta()
    assert wm.rerouted and wm.rerouted[0][1:3] == ("s", "stuck") and not wm.failed, wm
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    nxt = request("n", [feature("next")], params_for("next", prod.address))
    assert sched.ensure_cache_available(nxt, 0) is False, "admitted early from a producer whose load just failed"
    assert admit(sched, nxt) and sched.has_cache_item("next")
    assert worker.endpoint.wait_for(lambda: worker.endpoint.pool.stats().used == 0, 10)
