"""Encoder-cache events from vLLM's own scheduler and a real encoder's pool (tests/mrv2_engine.py).

The PD here is vLLM's ``Scheduler`` with NixlECConnector (``MRv2Engine``); its encoder cache is
vLLM's ``EncoderCacheManager``, shrunk to three images so that a fourth evicts one (a setting of
the real object, not a fake). A subscriber in this process must see exactly what that manager
caches after every request: what it allocates (``update_state_after_alloc``) and what it evicts
(``free_encoder_mm_hashes``). The E is an encode-only engine in its own process whose pool frees
an item once the PD has read it. Counters: what each item cost (prefix cache, encoder cache,
encode) and the misroutes of a router that believed an item was held.
"""

from __future__ import annotations

import collections
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is part of the test environment")

from ec_nixl.events import schema as S  # noqa: E402
from ec_nixl.events.subscriber import Subscriber, parse_source  # noqa: E402
from ec_nixl.params import build_route  # noqa: E402
from ports import free_port_block  # noqa: E402
from mrv2_engine import (ROWS, WIDTH, MRv2Engine, ProducerEngineProcess, image_feature, make_request,  # noqa: E402
                         vllm_config)
from vllm_fixtures import tiny_model  # noqa: E402,F401  (fixture)


def events_extra(port: int, instance: str) -> dict:
    return {"events": True, "events_port": port, "events_host": "127.0.0.1", "events_instance": instance,
            "events_heartbeat_s": 0.2}


def poll_until(sub: Subscriber, pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"{sub.index.dump()} {sub.status()} {dict(sub.counters)}"
        sub.poll(0.02)


def totals_of(engine: MRv2Engine) -> collections.Counter:
    """Every counter the scheduler side reports, summed over steps (vLLM resets them per step)."""
    side = engine.scheduler.ec_connector.scheduler
    totals: collections.Counter = collections.Counter()
    inner = side.get_stats

    def get_stats():
        st = inner()
        if st is not None:
            totals.update({k: v for k, v in st.data["counters"].items() if v})
        return st

    side.get_stats = get_stats  # observation only: vLLM still gets the stats
    return totals


def long_request(engine: MRv2Engine, rid: str, images, params=None):
    """``make_request`` with a prompt of two KV blocks and the block hashes EngineCore gives every
    request when prefix caching is on (the prefix cache finds a request only by them)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(engine.vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    sp = SamplingParams(max_tokens=1, ignore_eos=True,
                        extra_args={"ec_transfer_params": params} if params is not None else None)
    return Request(rid, prompt_token_ids=[7] * (2 * engine.vc.cache_config.block_size + 8), sampling_params=sp,
                   pooling_params=None, mm_features=[image_feature(h, seed, off) for h, seed, off in images],
                   block_hasher=get_request_block_hasher(engine.vc.cache_config.block_size, fn))


def test_pd_events_are_vllms_own_encoder_cache(tiny_model):
    port = free_port_block(4)
    pd = MRv2Engine(vllm_config(tiny_model, "ec_consumer", extra=events_extra(port, "http://pd0")))
    subs = []
    try:
        mgr = pd.scheduler.encoder_cache_manager
        mgr.cache_size = mgr.num_free_slots = mgr.num_freeable_slots = 3 * ROWS
        totals = totals_of(pd)
        sub = Subscriber([parse_source(f"tcp://127.0.0.1:{port}")])
        subs.append(sub)

        def cached() -> dict:
            return {"http://pd0": {S.MEDIUM_CACHE: sorted(mgr.cached)}} if mgr.cached else {}

        def run(rid: str, images, params=None) -> None:
            pd.add(long_request(pd, rid, images, params=params))
            pd.run_until(lambda: rid in pd.finished, what=f"{rid} finished")
            poll_until(sub, lambda: sub.index.dump() == cached())

        for i, h in enumerate(("h1", "h2", "h3")):
            run(f"r{h}", [(h, i, 5)])
        assert sorted(mgr.cached) == ["h1", "h2", "h3"] and totals["encoded"] == 3
        run("again", [("h1", 0, 20)])  # another prompt place (no prefix-cache hit): the encoder cache has it
        assert totals["encoded"] == 3 and totals["mm_cache_hits"] == 1 and totals["mm_items"] == 4
        run("r4", [("h4", 4, 5)])  # the cache is full: vLLM evicts the oldest unreferenced item, h2
        assert "h2" not in mgr.cached and not sub.index.holders("h2")
        assert [(x.instance, x.medium, x.modality) for x in sub.index.holders("h4")] == \
            [("http://pd0", S.MEDIUM_CACHE, "image")]
        # a router sent h1 and h2 as held here: h1 is, h2 was evicted (a misroute, encoded here)
        run("routed", [("h1", 0, 10), ("h2", 1, 30)], params=build_route(["h1", "h2"]))
        assert totals["cache_route_misses"] == 1 and totals["encoded"] == 5
        run("same-prompt", [("h1", 0, 5)])  # the first request's prompt again: the prefix cache covers h1
        assert totals["mm_kv_hits"] == 1
        late = Subscriber([parse_source(f"tcp://127.0.0.1:{port}")])  # started now: from a snapshot
        subs.append(late)
        poll_until(late, lambda: late.index.dump() == sub.index.dump() == cached())
        assert late.counters["batches"] == 0 and sub.counters["gaps"] == 0
    finally:
        for s in subs:
            s.close()
        pd.shutdown()


def test_encoder_publishes_its_pool_and_its_cache(tiny_model):
    port = free_port_block(4)
    e = ProducerEngineProcess(tiny_model, extra=events_extra(port, "http://e0"))
    sub = Subscriber([parse_source(f"tcp://127.0.0.1:{port}"), parse_source(f"tcp://127.0.0.1:{port + 2}")])
    pd = None
    try:
        params = e.call("encode", [("r1", [("img1", 1, 5)])])["r1"]

        def held() -> set:
            return {(x.instance, x.medium, x.modality, x.nbytes) for x in sub.index.holders("img1")}

        nbytes = ROWS * WIDTH * 2
        poll_until(sub, lambda: held() == {("http://e0", S.MEDIUM_CACHE, "image", nbytes),
                                           ("http://e0", S.MEDIUM_POOL, "image", nbytes)})
        # a PD reads it: E's pool lets it go (free_when_consumed); E's vLLM encoder cache keeps it
        pd = MRv2Engine(vllm_config(tiny_model, "ec_consumer"))
        pd.add(make_request("p1", [("img1", 1, 5)], params=params, media=False))
        pd.run_until(lambda: "p1" in pd.finished, what="p1 finished")
        poll_until(sub, lambda: held() == {("http://e0", S.MEDIUM_CACHE, "image", nbytes)})
        assert sub.counters["bad_messages"] == 0 and sub.synced()
    finally:
        sub.close()
        if pd is not None:
            pd.shutdown()
        e.close()
