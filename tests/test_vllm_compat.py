"""What changed between vLLM 0.26, 0.32, 0.33 and 0.34 that the adapter must absorb, checked against
the vLLM installed in this venv (scripts/test.sh runs this file in one venv per version).

* 0.33+: the WAITING loop asks ``ensure_cache_available`` with ``ec_computed_tokens`` (computed
  tokens minus the prefix-replay tail), and a preempted request is asked again with fewer
  tokens: items the first decision found already computed can be needed again.
* 0.33+: ``collect_ec_item_metadata`` entries carry ``"modality"``; announcements keep vLLM's
  entry as it is and consumers accept it with or without.
* 0.26 (the newest vLLM with the lent GPU's torch 2.11) lacks hooks 0.32 has; ``ec_nixl.vllm.hooks``
  says which, and the adapter stands in for each (``stand_ins``, ``report_channel``): a worker's
  step report reaches the scheduler over a local socket (a malformed one is dropped and counted),
  a load's slot goes back the step after the step that computes its last placeholder token (or
  when its request ends), a producer publishes an announced encoder-cache hit again at
  ``get_finished``, ``fallback: fail`` is refused at start, and the scheduler's totals are what
  ``ec-nixl status`` reads from the PD's ``ec_port``. These tests call only the hooks 0.26 calls;
  on a newer vLLM they run the same stand-ins with the adapter told the hooks are missing
  (``as_026``), so the main venv covers them too. (0.26 also has no metadata-only items and no
  Model Runner V2 EC wrapper: tests/test_vllm_adapter.py and tests/test_vllm_mrv2.py skip those.)
"""

from __future__ import annotations

import json
import pickle
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is part of the test environment")

from mrv2_engine import ROWS, WIDTH, make_request, vllm_config  # noqa: E402
from vllm_fixtures import BF16, compat, tiny_model  # noqa: E402,F401  (fixtures)
import ec_nixl.vllm.hooks as hooks  # noqa: E402
from helpers import report_arrived, wait_until  # noqa: E402
from peers import digest, make_item  # noqa: E402


metadata_only = pytest.mark.skipif(
    not (hooks.METADATA_ONLY and hooks.FAILS_REQUESTS), reason="metadata-only items: this vLLM has none "
    "(no allow_missing_mm_embeddings / collect_ec_item_metadata) and no take_unavailable_requests (vLLM >= 0.32)")


@pytest.fixture(scope="module")
def consumer_config(tiny_model):
    return vllm_config(tiny_model, "ec_consumer", extra={"missing_grace_s": "0.2", "peer_timeout_s": "2"})


@pytest.fixture
def sched(consumer_config):
    from ec_nixl.vllm.options import parse_extra, placement
    from ec_nixl.vllm.scheduler import SchedulerSide

    vc = consumer_config
    s = SchedulerSide(vc, parse_extra(vc.ec_transfer_config.ec_connector_extra_config), placement(vc, worker=False))
    yield s
    s.shutdown()


@pytest.fixture
def producer(compat):
    from peers import ProducerProcess

    p = ProducerProcess(device="cpu", pool_bytes=8 << 20, nixl_progress_thread=False, compat=compat)
    yield p
    p.close()


def announce(producer_address: str, h: str, index: int = 0) -> dict:
    return {h: {"modality": "image", "item_indices": [index], "metadata": {"image_grid_thw": [1, 6, 6]},
                "ec_nixl": {"v": 1, "producer": producer_address, "shape": [ROWS, WIDTH], "dtype": BF16,
                            "nbytes": ROWS * WIDTH * 2}}}


def admitted(sched, req, computed: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sched.ensure_cache_available(req, computed):
            return True
        if req.request_id in sched._unavailable:
            return False
        time.sleep(0.01)
    return False


def test_item_below_first_computed_count_is_loaded_when_asked_again_with_fewer(sched, producer):
    """First seen with 30 computed tokens (the image at 6..15 already computed), then asked with
    4 (the replay tail, or a preempted request back in WAITING): the image must be held and
    loadable, not left to a local encode of a placeholder that has no pixels."""
    producer.call("publish", [("tail", (ROWS, WIDTH), BF16, 3)])
    req = make_request("t", [("tail", 0, 6)], params=announce(producer.address, "tail"), media=False)
    assert sched.ensure_cache_available(req, 30) is True, "nothing to wait for at 30"
    assert not sched.has_cache_item("tail")
    assert admitted(sched, req, 4), sched._reqs["t"]
    assert sched.has_cache_item("tail")
    sched.update_state_after_alloc(req, 0)
    assert [s.desc.mm_hash for s in sched.build_connector_meta(None).loads] == ["tail"]


@metadata_only
def test_metadata_only_item_below_first_count_fails_when_needed_again(sched):
    """Same, with no usable params: once the image is needed, the request fails (it cannot be
    encoded here), instead of reaching vLLM's encoder with an empty item."""
    req = make_request("n", [("gone", 0, 6)], media=False)
    assert sched.ensure_cache_available(req, 30) is True
    assert sched.ensure_cache_available(req, 4) is False
    assert sched.take_unavailable_requests() == {"n"}


@metadata_only
def test_announcement_keeps_vllms_item_entry(tiny_model, sched, producer):
    """The producer's params are vLLM's ``collect_ec_item_metadata`` entry (with ``modality`` from
    0.33 on) plus ours; a consumer accepts both shapes of entry."""
    from ec_nixl.vllm.metadata import parse_params
    from ec_nixl.vllm.options import parse_extra, placement
    from ec_nixl.vllm.scheduler import SchedulerSide

    vc = vllm_config(tiny_model, "ec_producer", extra={"advertise_host": "10.0.0.1"})
    vc.ec_transfer_config.mm_encoder_output_widths = {"image": WIDTH}
    prod = SchedulerSide(vc, parse_extra(vc.ec_transfer_config.ec_connector_extra_config), placement(vc, worker=False))
    try:
        _, params = prod.request_finished(make_request("p", [("a", 1, 6), ("b", 2, 20)]))
    finally:
        prod.shutdown()
    from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver, collect_ec_item_metadata

    theirs = collect_ec_item_metadata(make_request("p", [("a", 1, 6), ("b", 2, 20)]).mm_features,
                                      PlaceholderMetadataResolver(vc.model_config))
    for h in "ab":
        assert {k: v for k, v in params[h].items() if k != "ec_nixl"} == theirs[h], "vLLM's entry, untouched"
    for entry in (params, {h: {k: v for k, v in e.items() if k != "modality"} for h, e in params.items()}):
        items, errors = parse_params(entry, {"a": ROWS, "b": ROWS}, BF16)
        assert set(items) == {"a", "b"} and not errors


def test_installed_vllm_is_in_the_supported_range(monkeypatch):
    """CI runs every version of the range; the plugin warns (once per process, at registration)
    about a vLLM outside it."""
    import logging

    import vllm

    import ec_nixl.vllm as plugin

    assert plugin.warn_if_untested(), f"vLLM {vllm.__version__} is tested here but outside SUPPORTED_VLLM"
    monkeypatch.setattr(vllm, "__version__", "0.35.0.dev1+gabc")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("ec_nixl.vllm")  # (ec_nixl may not propagate: it logs like vLLM)
    log.addHandler(handler)
    try:
        assert not plugin.warn_if_untested()
    finally:
        log.removeHandler(handler)
    assert any("tested with vLLM 0.26 and 0.32 to 0.34; this is vLLM 0.35.0.dev1+gabc" in m for m in seen), seen


# ------------------------------------------------------------------------------ vLLM 0.26's missing hooks


@pytest.fixture
def as_026(monkeypatch):
    """The adapter told this vLLM has none of the hooks 0.26 lacks (on 0.26 itself: as it is). The
    stand-ins are plain code that vLLM never calls; the tests call only what 0.26 calls."""
    for name in ("WORKER_SERVICES", "SAVE_PREP", "FREE_HOOK", "WORKER_REPORTS", "FAILS_REQUESTS"):
        monkeypatch.setattr(hooks, name, False)


@pytest.fixture(scope="module")
def pd_config(tiny_model):  # noqa: F811
    """A PD's config (the worker's first handshake, link probe included, took over 2 s on a busy
    2-core box: a generous peer timeout, which no test here waits out)."""
    return vllm_config(tiny_model, "ec_consumer", extra={"peer_timeout_s": "10"})


@pytest.fixture
def pd(pd_config, as_026):
    """A PD's two connectors as vLLM 0.26 makes them: the scheduler's, and a worker's (which starts
    its endpoint when created: 0.26 has no start_worker_services)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ec_nixl.vllm.connector import NixlECConnector

    made = []

    def make():
        s = NixlECConnector(pd_config, ECConnectorRole.SCHEDULER)
        made.append(s)
        w = NixlECConnector(pd_config, ECConnectorRole.WORKER)
        made.append(w)
        assert w.worker.endpoint is not None, "the worker's endpoint was not started when it was created"
        return s, w

    yield make
    for c in reversed(made):
        c.shutdown()


def scheduled_step(sched, tokens: dict[str, int]):
    """One step as vLLM builds it: ``tokens`` per request in its SchedulerOutput, the connector's
    metadata in it, and both pickled to the worker together (what the mp executor does)."""
    from vllm.v1.core.sched.output import SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.num_scheduled_tokens = dict(tokens)
    so.total_num_scheduled_tokens = sum(tokens.values())
    so.ec_connector_metadata = sched.build_connector_meta(so)
    return pickle.loads(pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL))


def run_worker_step(worker, so, cache: dict) -> None:
    """V1's mixin as 0.26 runs it: bind, start_load_caches, [the encoder and the gather],
    get_finished, clear."""
    worker.bind_connector_metadata(so.ec_connector_metadata)
    worker.start_load_caches(cache)
    worker.get_finished(set(so.finished_req_ids))
    worker.clear_connector_metadata()


def test_fallback_fail_is_refused_where_requests_cannot_be_failed(tiny_model, as_026):
    """vLLM 0.26 cannot fail a request from its connector: ``fallback: fail`` would leave a failed
    load nowhere to go, so the connector refuses it at start, naming the missing hook."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ec_nixl.errors import ConfigError
    from ec_nixl.vllm.connector import NixlECConnector

    vc = vllm_config(tiny_model, "ec_consumer", extra={"fallback": "fail"})
    for role in (ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=r"fallback 'fail' needs .*take_unavailable_requests"):
            NixlECConnector(vc, role)


def test_late_fallback_reaches_the_scheduler_and_ec_nixl_status(pd, producer, capsys):
    """FAULT INJECTION between admission and load (the producer drops the item and the load carries
    no promise): the worker adds the item to the step's encoder inputs (it carries its pixels), and
    its report goes over ``report_channel`` at ``get_finished``; the scheduler takes it with its next
    step, and its totals, which ``ec-nixl status`` reads from the PD's ``ec_port``, show one late
    fallback among the local ones, and nothing loaded."""
    from ec_nixl.cli import status_main

    s, w = pd()
    sched = s.scheduler
    producer.call("publish", [("lf", (ROWS, WIDTH), BF16, 41)])
    req = make_request("r", [("lf", 42, 6)], params=announce(producer.address, "lf"))
    assert admitted(sched, req, 0) and s.has_cache_item("lf")
    s.update_state_after_alloc(req, 0)
    so = scheduled_step(s, {"r": 40})
    producer.call("unpublish_all")
    for spec in so.ec_connector_metadata.loads + so.ec_connector_metadata.prefetch:
        spec.valid_until = 0.0  # no promise: the worker asks, and hears MISSING
    cache: dict = {}
    run_worker_step(w, so, cache)
    assert so.scheduled_encoder_inputs == {"r": [0]} and "lf" not in cache, "left for vLLM's encoder"
    assert report_arrived(sched, 10), "the worker's report never reached the scheduler"
    scheduled_step(s, {})  # the next step takes it
    c = sched.counts.totals()["counters"]
    assert (c["late_fallbacks"], c["local_fallbacks"], c["loads_landed"]) == (1, 1, 0), c
    assert c["malformed_reports"] == 0
    capsys.readouterr()
    assert status_main([f"127.0.0.1:{sched.endpoint.server.port}", "--timeout", "10"]) == 0
    shown = json.loads(capsys.readouterr().out)["connector"]["counters"]
    assert (shown["late_fallbacks"], shown["local_fallbacks"], shown["loads_landed"]) == (1, 1, 0), shown


def test_malformed_reports_are_dropped_and_counted(pd):
    """Whatever reaches the scheduler's report socket, its step goes on: bytes that are not a report,
    a report of the wrong shape, and one whose stats cannot be added are dropped and counted
    (``malformed_reports``); the good report among them is taken."""
    import msgspec
    import zmq

    from ec_nixl.vllm.metadata import NixlECWorkerMeta
    from ec_nixl.vllm.report_channel import address

    s, w = pd()
    sched = s.scheduler
    enc = msgspec.msgpack.Encoder()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)  # FAULT INJECTION: a sender on the scheduler's socket
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address(sched.place.engine_id, sched.place.dp_rank, sched.place.base_port))
    try:
        for data in (b"\xc1 not msgpack", enc.encode({"loaded": "everything"}),
                     enc.encode(NixlECWorkerMeta(stats={"counters": {"loads_landed": "many"}})),
                     enc.encode(NixlECWorkerMeta(stats={"counters": {"loads_landed": 3}}))):
            sock.send(data)
    finally:
        sock.close()
        ctx.term()

    def taken() -> bool:
        scheduled_step(s, {})  # a step; raises if a report stops it
        c = sched.counts.totals()["counters"]
        return c["malformed_reports"] == 3 and c["loads_landed"] == 3

    assert wait_until(taken, 10), sched.counts.totals()["counters"]


def test_loaded_slot_goes_back_the_step_after_its_last_placeholder_token(pd, producer):
    """No ``update_state_after_free``: the scheduler reads off each step which loaded items it
    completes. Chunked prefill over the image (16 tokens a step, placeholder at 10..18): the slot
    stays the cache entry through both gathers and goes back with the step after the second; a
    request that ends first gives its slot back with the next step; nothing is released twice."""
    s, w = pd()
    producer.call("publish", [("ch", (ROWS, WIDTH), BF16, 51), ("gone", (ROWS, WIDTH), BF16, 52)])
    req = make_request("c", [("ch", 0, 10)], params=announce(producer.address, "ch"))
    assert admitted(s.scheduler, req, 0)
    s.update_state_after_alloc(req, 0)
    pool = w.worker.endpoint.pool
    cache: dict = {}
    so = scheduled_step(s, {"c": 16})  # tokens 0..15: the first gather, rows 0..5
    assert [x.desc.mm_hash for x in so.ec_connector_metadata.loads] == ["ch"] and not so.ec_connector_metadata.release
    run_worker_step(w, so, cache)
    view = cache["ch"]
    assert pool.stats().used > 0
    req.num_computed_tokens += 16  # (vLLM's _update_after_schedule)
    so = scheduled_step(s, {"c": 16})  # tokens 16..31: the second gather, rows 6..8
    assert so.ec_connector_metadata.release == [], "released before its last gather"
    run_worker_step(w, so, cache)
    assert cache["ch"] is view and pool.stats().used > 0
    req.num_computed_tokens += 16
    so = scheduled_step(s, {"c": 16})
    assert so.ec_connector_metadata.release == ["ch"], "not released the step after its last placeholder token"
    run_worker_step(w, so, cache)
    assert cache["ch"] is not view and digest(cache["ch"]) == digest(make_item(51, (ROWS, WIDTH), BF16))
    assert pool.stats().used == 0
    s.request_finished(req)
    assert scheduled_step(s, {"x": 1}).ec_connector_metadata.release == [], "released twice"
    # A request that ends before its placeholder was computed: released with the next step.
    other = make_request("g", [("gone", 0, 30)], params=announce(producer.address, "gone"))
    assert admitted(s.scheduler, other, 0)
    s.update_state_after_alloc(other, 0)
    run_worker_step(w, scheduled_step(s, {"g": 16}), cache)
    assert pool.stats().used > 0
    s.request_finished(other)  # (aborted)
    so = scheduled_step(s, {"x": 1})
    assert so.ec_connector_metadata.release == ["gone"]
    run_worker_step(w, so, cache)
    assert pool.stats().used == 0


def test_producer_publishes_an_announced_cache_hit_again_at_get_finished(tiny_model, compat, as_026):
    """No ``start_save_caches``: an encoder-cache hit that E announces again (its copy left the
    pool once read) is published again at the end of the step whose metadata names it, from the
    encoder cache ``save_caches`` was handed before; a consumer then reads E's bytes."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ec_nixl.barrier import LoadBarrier
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint
    from ec_nixl.tickets import ItemRef
    from ec_nixl.vllm.connector import NixlECConnector
    from ec_nixl.vllm.metadata import NixlECMetadata

    e = NixlECConnector(vllm_config(tiny_model, "ec_producer"), ECConnectorRole.WORKER)
    try:
        ep = e.worker.endpoint
        assert ep is not None and ep.address, "the producer's endpoint was not started when it was created"
        cache = {"hit": make_item(61, (ROWS, WIDTH), BF16)}
        e.bind_connector_metadata(NixlECMetadata())  # the step that encodes it (V1: save_caches per output)
        e.save_caches(encoder_cache=cache, mm_hash="hit")
        e.get_finished(set())
        e.clear_connector_metadata()
        assert ep.published() == ["hit"]
        assert ep.unpublish("hit") and ep.published() == []  # (as once read: the copy left the pool)
        e.bind_connector_metadata(NixlECMetadata(publish=["hit"]))  # a later request hit the cache
        assert ep.published() == [], "published before the step ran"
        e.get_finished(set())
        e.clear_connector_metadata()
        assert ep.published() == ["hit"], "the announced cache hit was not published again"
        with Endpoint(EndpointConfig(name="reader", pool_bytes=8 << 20, threaded=False, compat=compat)) as cons:
            t = cons.load([ItemRef(desc=_desc_of("hit"), producer=ep.address)])
            out = LoadBarrier(cons).wait(t)
            assert torch.equal(out["hit"], cache["hit"])
    finally:
        e.shutdown()


def _desc_of(h: str):
    from ec_nixl import protocol as P

    return P.ItemDesc(mm_hash=h, shape=[ROWS, WIDTH], dtype=BF16, nbytes=ROWS * WIDTH * 2)
