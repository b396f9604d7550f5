"""What changed between vLLM 0.32, 0.33 and 0.34 that the adapter must absorb, checked against the
vLLM installed in this venv (scripts/test.sh runs this file in one venv per version).

* 0.33+: the WAITING loop asks ``ensure_cache_available`` with ``ec_computed_tokens`` (computed
  tokens minus the prefix-replay tail), and a preempted request is asked again with fewer
  tokens: items the first decision found already computed can be needed again.
* 0.33+: ``collect_ec_item_metadata`` entries carry ``"modality"``; announcements keep vLLM's
  entry as it is and consumers accept it with or without.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is part of the test environment")

from mrv2_engine import ROWS, WIDTH, make_request, vllm_config  # noqa: E402
from vllm_fixtures import BF16, compat, tiny_model  # noqa: E402,F401  (fixtures)


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


def test_metadata_only_item_below_first_count_fails_when_needed_again(sched):
    """Same, with no usable params: once the image is needed, the request fails (it cannot be
    encoded here), instead of reaching vLLM's encoder with an empty item."""
    req = make_request("n", [("gone", 0, 6)], media=False)
    assert sched.ensure_cache_available(req, 30) is True
    assert sched.ensure_cache_available(req, 4) is False
    assert sched.take_unavailable_requests() == {"n"}


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
