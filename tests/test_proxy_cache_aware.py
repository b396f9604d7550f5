"""The proxy's cache-aware route against stub backends and real event publishers.

The backends are aiohttp stubs (as in tests/test_proxy.py); what each holds is published by a
real ``EventPublisher`` (real ZMQ sockets) that the proxy's own subscriber thread follows, so
each test states the engines' caches and checks where every request and item went: straight to
the PD that holds everything (no encoder call), each item to the encoder that holds it (a call
with only its items, answers mapped back to the body's positions), the PD chosen by the items it
holds, the balance guard passing over an overloaded holder, an encoder failing in a split
request. The engines' side (misroutes counted, real caches) is tests/test_vllm_cache_events.py
and tests/e2e/test_e2e_cache_routing.py.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from ec_nixl.disagg.items import map_back, subset_body, with_content_ids
from ec_nixl.disagg.placeholders import media_parts
from ec_nixl.disagg.proxy import Proxy, ProxyConfig
from ec_nixl.disagg.routing import BalanceGuard
from ec_nixl.events import schema as S
from ec_nixl.events.publisher import EventPublisher, PublisherConfig
from ports import free_port_block
from test_proxy import Stub, fail, serve

IMG = ["data:image/png;base64,QUFB", "data:image/png;base64,QkJC", "data:image/png;base64,Q0ND"]
ID = [with_content_ids({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}}]}]})[1][0]
      for u in IMG]


def chat(*images: int, **kw: Any) -> dict:
    content = [{"type": "image_url", "image_url": {"url": IMG[i]}} for i in images] + [{"type": "text", "text": "hi"}]
    return dict({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}, **kw)


async def encoder(stub: Stub, request: web.Request, body: Any) -> web.Response:
    """An encoder that answers an entry per media part of its body (keyed by the part's uuid)."""
    if request.path == "/health":
        return web.Response(text="")
    params = {p["uuid"]: {"item_indices": [i], "metadata": {"image_grid_thw": [1, 2, 2]},
                          "ec_nixl": {"v": 1, "producer": f"{stub.name}:1"}}
              for i, p in enumerate(media_parts(body))}
    return web.json_response({"choices": [], "ec_transfer_params": params})


async def pd(stub: Stub, request: web.Request, body: Any) -> web.Response:
    if request.path == "/health":
        return web.Response(text="")
    return web.json_response({"served_by": stub.name, "received": body})


class Rig:
    """Stub encoders and PDs, one publisher per backend, and the proxy in front."""

    def __init__(self, stack: AsyncExitStack, session: aiohttp.ClientSession):
        self.stack, self.session = stack, session
        self.pubs: dict[str, EventPublisher] = {}

    async def start(self, n_e: int = 2, n_pd: int = 2, e_handler=encoder, **cfg: Any) -> "Rig":
        self.es = [await Stub(f"e{i}", e_handler).start(self.stack) for i in range(n_e)]
        self.pds = [await Stub(f"pd{i}", pd).start(self.stack) for i in range(n_pd)]
        events = []
        for b in self.es + self.pds:
            port = free_port_block(2)
            mediums = (S.MEDIUM_CACHE, S.MEDIUM_POOL) if b in self.es else (S.MEDIUM_CACHE,)
            p = EventPublisher(PublisherConfig(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", b.url,
                                               mediums, heartbeat_s=0.2))
            self.stack.callback(p.close)
            self.pubs[b.name] = p
            events.append(p.endpoint)
        self.proxy = Proxy(ProxyConfig(encoders=[e.url for e in self.es], pd=[p.url for p in self.pds],
                                       route="cache-aware", events=events, **cfg))
        self.url = await serve(self.proxy.app(), self.stack)
        return self

    async def holds(self, name: str, *items: int, medium: str = S.MEDIUM_CACHE) -> None:
        """Backend ``name`` announces it holds ``items``; returns once the proxy's index has them."""
        p = self.pubs[name]
        for i in items:
            p.stored(ID[i], "image", 100, medium)
        p.drain()
        url = next(b.url for b in self.es + self.pds if b.name == name)
        deadline = time.monotonic() + 10
        while not all(any(h.instance == url and h.medium == medium for h in self.proxy.router.index.holders(ID[i]))
                      for i in items):
            assert time.monotonic() < deadline, "the proxy's index never got the events"
            await asyncio.sleep(0.02)

    async def post(self, body: dict) -> tuple[int, Any, dict]:
        async with self.session.post(self.url + "/v1/chat/completions", json=body) as r:
            return r.status, await r.json(), dict(r.headers)


def with_rig(body, **cfg: Any) -> None:
    """Run ``await body(rig)`` against a fresh rig (``Rig.start(**cfg)``)."""
    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            await body(await Rig(stack, s).start(**cfg))

    asyncio.run(main())


def test_all_items_held_by_a_pd_go_straight_to_it():
    async def check(rig: Rig) -> None:
        await rig.holds("pd1", 0, 1)
        status, answer, headers = await rig.post(chat(0, 1))
        assert status == 200 and answer["served_by"] == "pd1" and headers["X-EC-Route"] == "pd-cache"
        assert [len(e.seen) for e in rig.es] == [0, 0], "no encoder call"
        got = answer["received"]
        assert got["ec_transfer_params"] == {"ec_nixl_route": {"v": 1, "held": [ID[0], ID[1]]}}
        assert [p["uuid"] for p in media_parts(got)] == [ID[0], ID[1]]  # the ids the PD's cache knows them by
        assert rig.proxy.router.counters["pd_cache_routes"] == 1

    with_rig(check)


def test_items_go_to_the_encoders_that_hold_them_with_only_their_items():
    async def check(rig: Rig) -> None:
        await rig.holds("e1", 0)
        await rig.holds("e0", 2, medium=S.MEDIUM_POOL)
        status, answer, headers = await rig.post(chat(0, 2))
        assert status == 200 and headers["X-EC-Route"] == "encoder"
        (_, b0), = rig.es[0].seen
        (_, b1), = rig.es[1].seen
        assert [p["uuid"] for p in media_parts(b1)] == [ID[0]] and [p["uuid"] for p in media_parts(b0)] == [ID[2]]
        assert b1["ec_transfer_params"] == {"ec_nixl_route": {"v": 1, "held": [ID[0]]}}
        assert b0["max_tokens"] == 1 and b0["stream"] is False
        params = answer["received"]["ec_transfer_params"]
        assert params[ID[0]]["item_indices"] == [0] and params[ID[2]]["item_indices"] == [1]  # whole-body positions
        assert params[ID[0]]["ec_nixl"]["producer"] == "e1:1" and params[ID[2]]["ec_nixl"]["producer"] == "e0:1"
        assert rig.proxy.router.counters["items_to_holding_encoder"] == 2

    with_rig(check)


def test_the_pd_is_the_one_holding_most_items_and_the_encoder_gets_the_rest():
    async def check(rig: Rig) -> None:
        await rig.holds("pd1", 0)
        status, answer, _ = await rig.post(chat(0, 1))
        assert status == 200 and answer["served_by"] == "pd1"
        (_, e_body), = [x for e in rig.es for x in e.seen]
        assert [p["uuid"] for p in media_parts(e_body)] == [ID[1]]
        params = answer["received"]["ec_transfer_params"]
        assert set(params) == {ID[1], "ec_nixl_route"} and params[ID[1]]["item_indices"] == [1]
        assert params["ec_nixl_route"]["held"] == [ID[0]]

    with_rig(check)


def test_the_balance_guard_passes_over_an_overloaded_holder():
    async def check(rig: Rig) -> None:
        await rig.holds("pd0", 0)
        for _ in range(3):  # pd0 has 3 requests in flight, pd1 none: 3 - 0 > 2 and 3 > 1.5 * 0
            rig.proxy.loads.inc(rig.pds[0].url)
        status, answer, headers = await rig.post(chat(0))
        assert status == 200 and answer["served_by"] == "pd1" and headers["X-EC-Route"] == "encoder"
        assert rig.proxy.router.counters["pd_balance_overrides"] == 1
        rig.proxy.loads.dec(rig.pds[0].url)  # 2 in flight: within the guard, the holder again
        status, answer, headers = await rig.post(chat(0))
        assert answer["served_by"] == "pd0" and headers["X-EC-Route"] == "pd-cache"

    with_rig(check, balance_abs=2, balance_rel=1.5)


def test_an_encoder_failing_in_a_split_request_leaves_its_items_to_the_pd():
    async def check(rig: Rig) -> None:
        rig.es[0].handler = fail
        await rig.holds("e0", 0)
        await rig.holds("e1", 1)
        status, answer, headers = await rig.post(chat(0, 1))
        assert status == 200 and "X-EC-Fallback" in headers and rig.es[0].url in headers["X-EC-Fallback"]
        params = answer["received"]["ec_transfer_params"]
        assert set(params) == {ID[1]}, "the failed encoder's item has no entry: the PD encodes its media"
        assert [p.get("uuid") for p in media_parts(answer["received"])] == [ID[0], ID[1]]

    with_rig(check)


def test_routing_endpoint_and_config_errors():
    async def check(rig: Rig) -> None:
        await rig.holds("pd0", 2)
        deadline = time.monotonic() + 10  # (E's publisher, silent, is live once its snapshot or a
        while True:                        # heartbeat came: on a loaded box after pd0's events)
            async with rig.session.get(rig.url + "/ec-nixl/routing") as r:
                info = await r.json()
            states = [x["state"] for x in info["events"]["sources"]]
            if states == ["live", "live"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert info["route"] == "cache-aware" and info["index_entries"] == 1
        assert states == ["live", "live"]

    with_rig(check, n_e=1, n_pd=1)
    with pytest.raises(ValueError, match="needs flow 'pull'"):
        ProxyConfig(encoders=["http://e"], pd=["http://p"], route="cache-aware", events=["tcp://h:1"], flow="overlap")
    with pytest.raises(ValueError, match="event publishers"):
        ProxyConfig(encoders=["http://e"], pd=["http://p"], route="cache-aware")
    with pytest.raises(ValueError, match="'tcp://h' is not tcp://host:port"):
        ProxyConfig(encoders=["http://e"], pd=["http://p"], route="cache-aware", events=["tcp://h"])
    with pytest.raises(ValueError, match="balance thresholds"):
        BalanceGuard(2, 0.5)
    g = BalanceGuard(4, 1.5)
    assert g.tips(10, 5) and not g.tips(9, 5) and not g.tips(12, 8)


def test_content_ids_subsets_and_mapping_back():
    body = chat(0, 1)
    body["messages"][0]["content"][1]["uuid"] = "client-id"
    new, ids = with_content_ids(body)
    assert ids == [ID[0], "client-id"] and "uuid" not in body["messages"][0]["content"][0], "body left as it was"
    assert new["messages"][0]["content"][0]["uuid"] == ID[0] and len(ID[0]) == 64
    assert with_content_ids(dict(body, mm_processor_kwargs={"max_pixels": 1}))[1] == [None, None]
    assert with_content_ids({"prompt": "x"}) == ({"prompt": "x"}, [])
    sub = subset_body(new, [1])
    assert sub["messages"] == [{"role": "user", "content": [new["messages"][0]["content"][1]]}]
    assert map_back({"h": {"item_indices": [0, 5, "x"]}, "other": 3}, [7]) == {"h": {"item_indices": [7]}, "other": 3}
