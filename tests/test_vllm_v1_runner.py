"""NixlECConnector inside the V1 model runner's EC path (vLLM 0.26, 0.32 and 0.33; 0.34 removed it).

Same engine as tests/test_vllm_mrv2.py, with the worker's EC calls made by vLLM's V1 mixin
(``ECConnectorModelRunnerMixin``) in V1's order instead of MRv2's wrapper (``v1_engine.V1Engine``
says what V1 does and which parts are not vLLM's). vLLM 0.26 runs every EC instance this way (it
has no MRv2 EC wrapper), and lacks hooks that 0.32 has (``ec_nixl.vllm.hooks``): the E engine
re-publishes an announced cache hit at ``get_finished`` instead of ``start_save_caches``, the PD's
workers report over ``report_channel`` instead of the step's output, and a load is released the
step after the one that computes its last placeholder token instead of at
``update_state_after_free``. The same tests run on both: each checks what the user sees.

A PD of vLLM 0.26 has no metadata-only items: its requests carry their pixels (``PD_MEDIA``).
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is part of the test environment")
pytest.importorskip("vllm.v1.worker.ec_connector_model_runner_mixin",
                    reason="this vLLM has no V1 model runner (removed in 0.34)")

from mrv2_engine import ROWS, WIDTH, ProducerEngineProcess, encoded, make_request, vllm_config  # noqa: E402
from peers import make_item  # noqa: E402
from v1_engine import V1Engine  # noqa: E402
from vllm_fixtures import BF16, compat, tiny_model  # noqa: E402,F401  (fixtures)
import ec_nixl.vllm.hooks as hooks  # noqa: E402
from helpers import wait_until  # noqa: E402

PD_MEDIA = not hooks.METADATA_ONLY
"""What a PD of this vLLM is sent: a router's placeholders (no pixels) where vLLM has metadata-only
items, else the pixels too (vLLM 0.26)."""


def params_for(producer_address: str, items: list[tuple[str, int]]) -> dict:
    """``ec_transfer_params`` as an E engine would announce ``items`` = [(mm_hash, index)]."""
    return {h: {"item_indices": [i], "metadata": {"image_grid_thw": [1, 6, 6]},
                "ec_nixl": {"v": 1, "producer": producer_address, "shape": [ROWS, WIDTH], "dtype": BF16,
                            "nbytes": ROWS * WIDTH * 2}} for h, i in items}


def totals(pd) -> dict:
    """The PD scheduler's counters and its workers' since start (what ``ec-nixl status`` shows)."""
    return pd.scheduler.get_ec_connector().scheduler.counts.totals()["counters"]


@pytest.fixture(scope="module")
def e_v1(tiny_model):  # noqa: F811
    """An encode-only E engine on the V1 runner, in its own process."""
    p = ProducerEngineProcess(tiny_model, runner="v1")
    yield p
    p.close()


@pytest.fixture
def producer(compat):  # noqa: F811
    from peers import ProducerProcess

    p = ProducerProcess(device="cpu", pool_bytes=8 << 20, nixl_progress_thread=False, compat=compat)
    yield p
    p.close()


@pytest.fixture
def engine(tiny_model):  # noqa: F811
    made = []

    def make(role: str = "ec_consumer", engine_args: dict | None = None, **extra) -> V1Engine:
        e = V1Engine(vllm_config(tiny_model, role, extra=extra, engine=engine_args))
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


def test_e_to_pd_under_v1_runner(e_v1, engine):
    """Two images from an E engine; the V1 path hands save_caches nothing here (nothing is
    encoded on PD), the gather gets E's rows, and the worker report reaches the scheduler (on
    vLLM 0.26 over ``report_channel``, taken by a later step: stepped until it was)."""
    params = e_v1.call("encode", [("v1e", [("v1-a", 81, 4), ("v1-b", 82, 20)])])["v1e"]
    pd = engine()
    pd.add(make_request("v1pd", [("v1-a", 81, 4), ("v1-b", 82, 20)], params=params, media=PD_MEDIA))
    pd.run_until(lambda: "v1pd" in pd.finished, what="v1pd finished")
    assert str(pd.finished["v1pd"].finish_reason).lower() == "length"
    assert torch.equal(pd.rows("v1pd"), torch.cat([encoded(81), encoded(82)]))
    pd.run_until(lambda: pd.worker_meta, what="the worker's report taken by the scheduler", timeout=10)
    assert sorted(h for m in pd.worker_meta for _, h in m.loaded) == ["v1-a", "v1-b"]
    assert totals(pd)["loads_landed"] == 2
    assert pd.model.calls == [] and pd.saved == []


def test_consumer_ignores_v1_saves_of_its_local_encodes(engine):
    """V1 calls save_caches on consumers too: a PD that encodes an image itself (no params) must
    not pin or serve it (it has no serving endpoint), and the request runs normally."""
    pd = engine()
    pd.add(make_request("loc", [("v1-local", 83, 6)]))
    pd.run_until(lambda: "loc" in pd.finished, what="loc finished")
    assert pd.saved == ["v1-local"], "V1 hands every new output to save_caches"
    assert torch.equal(pd.rows("loc"), encoded(83))
    assert pd.worker.endpoint.published() == [] and pd.worker.endpoint.address is None


def test_late_item_waits_without_connector_calls(engine, producer):
    """Throttled producer under V1: steps without tokens do not reach the worker connector at all;
    admission is the scheduler's alone, and the gather still sees only the final bytes."""
    delay = 1.0
    # gated (no early admission): an early-admitted request would wait in the barrier of its first
    # step instead, whenever its producer's link came up before the request was first seen
    pd = engine(load_timeout_s="10", early_admission="false")
    producer.call("publish_late", ("v1-late", (ROWS, WIDTH), BF16, 84, delay))
    t0 = time.monotonic()
    pd.add(make_request("late", [("v1-late", 0, 6)], params=params_for(producer.address, [("v1-late", 0)]),
                        media=PD_MEDIA))
    pd.run_until(lambda: "late" in pd.gathered, what="late gathered")
    assert time.monotonic() - t0 >= delay * 0.9
    assert pd.zero_token_steps > 0
    assert torch.equal(pd.rows("late"), make_item(84, (ROWS, WIDTH), BF16))
    pd.run_until(lambda: "late" in pd.finished, what="late finished")
    assert str(pd.finished["late"].finish_reason).lower() == "length"
    assert pd.model.calls == []


def test_e_engine_republishes_a_cache_hit_it_announces(e_v1, engine):
    """E serves an image, the PD reads it and E frees it; a second request hits E's encoder cache
    for it (not encoded, not saved), and E announces it again: it must be published again (vLLM
    0.26 at ``get_finished`` of the step after, having no ``start_save_caches``) so that the next
    PD request loads it, nothing encoded on the PD."""
    p1 = e_v1.call("encode", [("rp1", [("rp-a", 91, 4)])])["rp1"]
    pd = engine()
    pd.add(make_request("pd1", [("rp-a", 91, 4)], params=p1, media=PD_MEDIA))
    pd.run_until(lambda: "pd1" in pd.finished, what="pd1 finished")
    assert wait_until(lambda: "rp-a" not in e_v1.call("state")["published"], 10), "E kept an item that was read"
    mid = e_v1.call("state")
    p2 = e_v1.call("encode", [("rp2", [("rp-a", 91, 4), ("rp-c", 93, 20)])])["rp2"]
    after = e_v1.call("state")
    assert set(p2) == {"rp-a", "rp-c"}, "the cache hit is announced"
    assert after["saved"][len(mid["saved"]):] == ["rp-c"] and sum(after["encoder_calls"][len(mid["encoder_calls"]):]) == 1
    assert "rp-a" in after["published"], "the announced cache hit was not published again"
    pd.add(make_request("pd2", [("rp-a", 91, 4), ("rp-c", 93, 20)], params=p2, media=PD_MEDIA))
    pd.run_until(lambda: "pd2" in pd.finished, what="pd2 finished")
    assert str(pd.finished["pd2"].finish_reason).lower() == "length"
    assert torch.equal(pd.rows("pd2"), torch.cat([encoded(91), encoded(93)]))
    assert pd.model.calls == [], "the PD encoded an image E should have served"


def test_failed_load_with_media_is_encoded_in_the_same_step(engine, producer):
    """FAULT INJECTION between admission and load: the producer drops the item (it answers
    MISSING to the worker's Get). The request carries its pixels: the worker adds the item to the
    step's encoder inputs, V1 encodes it before the gather (the PD's own encoding of the pixels,
    not a zero placeholder), the request ends normally, and the late fallback reaches the
    scheduler's counters (vLLM 0.26: over ``report_channel``)."""
    producer.call("publish", [("gone", (ROWS, WIDTH), BF16, 55)])
    pd = engine(load_timeout_s="2", peer_timeout_s="2")
    pd.add(make_request("lf", [("gone", 56, 6)], params=params_for(producer.address, [("gone", 0)]), max_tokens=2))
    while not pd.gathered.get("lf"):
        so = pd.scheduler.schedule()
        meta = so.ec_connector_metadata
        if meta.loads:
            producer.call("unpublish_all")
            for s in meta.loads + meta.prefetch:
                s.valid_until = 0.0  # no promise: the worker asks, and hears MISSING
        pd.finish_step(so, pd.execute_model(so))
        assert pd.steps < 500, "never gathered"
    assert torch.equal(pd.rows("lf"), encoded(56)), "the gather must see the PD's own encoding"
    assert pd.model.calls == [1]
    pd.run_until(lambda: "lf" in pd.finished, what="lf finished")
    assert str(pd.finished["lf"].finish_reason).lower() == "length"
    pd.run_until(lambda: any(m.rerouted for m in pd.worker_meta), what="the fallback reported", timeout=10)
    assert [r[1:3] for m in pd.worker_meta for r in m.rerouted] == [("lf", "gone")]
    assert not any(m.failed for m in pd.worker_meta)
    c = totals(pd)
    assert c["late_fallbacks"] == 1 and c["local_fallbacks"] == 1, c


def test_loaded_slot_is_released_the_step_after_its_last_placeholder_token(engine, producer):
    """Chunked prefill (16 tokens a step): the image's rows are gathered over two steps. Its pool
    slot must stay the cache entry's until the second gather has run, and go back with the next
    step's metadata (vLLM 0.32+: ``update_state_after_free``; 0.26 has no such hook, the scheduler
    reads the step that computes the last placeholder token off its SchedulerOutput)."""
    producer.call("publish", [("chunked", (ROWS, WIDTH), BF16, 61)])
    pd = engine(engine_args={"max_num_batched_tokens": 16})
    pd.add(make_request("ck", [("chunked", 62, 10)], params=params_for(producer.address, [("chunked", 0)]),
                        media=PD_MEDIA))
    seen = []  # per step that ran "ck" or released: (its tokens, loads, releases, a pool slot taken after it)
    while "ck" not in pd.finished or not any(st[2] for st in seen):
        so = pd.scheduler.schedule()
        meta = so.ec_connector_metadata
        loads, release = [s.desc.mm_hash for s in meta.loads], list(meta.release)
        pd.finish_step(so, pd.execute_model(so))
        if so.num_scheduled_tokens.get("ck") or release:
            seen.append((so.num_scheduled_tokens.get("ck", 0), loads, release, pd.worker.endpoint.pool.stats().used > 0))
        assert pd.steps < 500, seen
    assert seen[:3] == [(16, ["chunked"], [], True), (16, [], [], True), (16, [], ["chunked"], False)], seen
    assert torch.equal(pd.rows("ck"), make_item(61, (ROWS, WIDTH), BF16)), "both gathers read the producer's rows"
    assert pd.model.calls == []
