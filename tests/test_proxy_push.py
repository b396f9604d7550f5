"""Unit tests of the proxy's ``--flow push`` (vLLM's EPD protocol, as vllm-router speaks it) and
of ``--pd-media placeholders`` (metadata-only PD requests).

In the push flow the encoder is told the consumer up front (ECMooncake's encoder pushes there), so
the proxy has to pick the PD first, tell the encoder that PD's consumer control address and one
``transfer_id`` per media item, and hand the PD the same ids with the encoder's entries. These
tests check the body transformations and, with the aiohttp stubs of tests/test_proxy.py standing
in for vLLM, what each backend receives. No test here starts real vLLM servers (the e2e suites do:
tests/e2e/test_e2e_nixl.py for NixlEC, bench/test_bench_serve.py for ECMooncake).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from ec_nixl.disagg.proxy import (
    ProxyConfig,
    config_from_args,
    encoder_body,
    media_items,
    parse_args,
    pd_body,
    push_encoder_body,
    push_pd_params,
)
from ec_nixl.disagg.placeholders import placeholder_body
from test_proxy import IMAGE_CHAT, TEXT_CHAT, Stub, dead_url, fail, pd_echo, post, run, start_proxy

ZMQ = ["tcp://127.0.0.1:15608", "tcp://127.0.0.1:15616"]


def chat(*parts: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return dict({"model": "m", "messages": [{"role": "user", "content": list(parts)}], "max_tokens": 8}, **kw)


IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
TXT = {"type": "text", "text": "x"}


def test_media_items_counts_non_text_parts_in_every_message():
    assert media_items(TEXT_CHAT) == 0 and media_items({"prompt": "p"}) == 0
    assert media_items(IMAGE_CHAT) == 1
    two_messages = {"messages": [{"role": "user", "content": [IMG, TXT, IMG]}, {"role": "assistant", "content": "ok"},
                                 {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "v"}}]}]}
    assert media_items(two_messages) == 3


def test_encoder_body_names_the_consumer_and_one_id_per_item():
    body = chat(IMG, TXT, IMG, stream=True, stream_options={"include_usage": True})
    e = push_encoder_body(body, ZMQ[0], ["t0", "t1"])
    # the 1-token copy of the default flow, plus where to push and under which ids (by position)
    assert {k: v for k, v in e.items() if k != "ec_transfer_params"} == encoder_body(body)
    assert e["ec_transfer_params"] == {"consumer_zmq": ZMQ[0], "ec_items": [{"transfer_id": "t0"},
                                                                             {"transfer_id": "t1"}]}
    assert "ec_transfer_params" not in body, "the client's body must not be modified"


def test_pd_body_carries_the_same_ids_with_the_engine_reported_hashes():
    body = chat(IMG, TXT, IMG, IMG, stream=True)
    # what ECMooncakeScheduler.request_finished answers: keyed by mm_hash, item_indices = positions;
    # a repeated image is one entry with two indices (and the last position's transfer_id)
    answer = {"h-a": {"item_indices": [0, 2], "metadata": {"image_grid_thw": [1, 4, 4]}, "transfer_id": "t2"},
              "h-b": {"item_indices": [1], "metadata": {}, "transfer_id": "t1"}}
    pd, media = pd_body(body, push_pd_params(["t0", "t1", "t2"], answer), "media", answer)
    # the encoder's entries go along (a pulling consumer reads its coordinates there)
    assert media == "media" and pd == dict(body, ec_transfer_params=dict(answer, ec_items=[
        {"transfer_id": "t0", "mm_hash": "h-a"}, {"transfer_id": "t1", "mm_hash": "h-b"},
        {"transfer_id": "t2", "mm_hash": "h-a"}]))
    assert "ec_transfer_params" not in body


@pytest.mark.parametrize("answer", [None, {}, "junk", {"h": "junk"}, {"h": {"item_indices": "0"}},
                                    {"h": {"item_indices": [5, -1, "0"]}}])
def test_pd_body_without_usable_hashes_matches_by_position(answer: Any):
    params = push_pd_params(["t0", "t1"], answer)
    assert params["ec_items"] == [{"transfer_id": "t0"}, {"transfer_id": "t1"}]
    assert all(isinstance(v, dict) for k, v in params.items() if k != "ec_items"), params


def test_pd_body_replaces_a_client_supplied_ec_transfer_params():
    pd, _ = pd_body(chat(IMG, ec_transfer_params={"from": "client"}), push_pd_params(["t0"], None), "media", None)
    assert pd["ec_transfer_params"] == {"ec_items": [{"transfer_id": "t0"}]}


GRID = {"image_grid_thw": [1, 4, 4]}


def test_placeholders_replace_every_reported_part_in_prompt_order():
    """Both turns' images, the same image twice: each part becomes the placeholder of the hash its
    position has, with that entry's metadata; text and the client's body are untouched."""
    body = {"model": "m", "messages": [{"role": "user", "content": [IMG, TXT]},
                                       {"role": "assistant", "content": "ok"},
                                       {"role": "user", "content": [IMG, TXT, dict(IMG, uuid="mine")]}]}
    answer = {"h-a": {"item_indices": [0, 1], "metadata": GRID, "ec_nixl": {"v": 1}},
              "h-b": {"item_indices": [2], "metadata": {"image_grid_thw": [1, 2, 2]}}}
    out = placeholder_body(body, answer)
    ph = [{"type": "image_embeds", "image_embeds": GRID, "uuid": "h-a"}] * 2 + [
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": "h-b"}]
    assert out["messages"][0]["content"] == [ph[0], TXT]
    assert out["messages"][1] == body["messages"][1]
    assert out["messages"][2]["content"] == [ph[1], TXT, ph[2]]
    assert body["messages"][0]["content"][0] == IMG, "the client's body must not be modified"
    pd, media = pd_body(body, answer, "placeholders", answer)
    assert media == "placeholders" and pd == dict(out, ec_transfer_params=answer)
    video = {"type": "video_url", "video_url": {"url": "v"}}
    out = placeholder_body(chat(video), {"v": {"item_indices": [0], "metadata": {"video_grid_thw": [2, 4, 4]}}})
    assert out["messages"][0]["content"] == [{"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4]},
                                              "uuid": "v"}]


@pytest.mark.parametrize("answer", [
    None, "junk", {},
    {"h": {"item_indices": [0], "metadata": GRID}},  # the second image is not reported
    {"h": {"item_indices": [0, 1], "metadata": {}}},  # no metadata (vLLM's on an encoder-cache hit)
    {"h": {"item_indices": [0, 1]}},
    {"h": {"item_indices": [0, 1], "metadata": "x"}},
    {"h": {"item_indices": ["0", 1], "metadata": GRID}},
])
def test_placeholders_all_or_nothing(answer: Any):
    """A part that cannot be described keeps the whole body's media: vLLM refuses raw media and
    embeddings mixed, and the media still let the PD encode what fails to load."""
    body = chat(IMG, TXT, IMG)
    assert placeholder_body(body, answer) is None
    pd, media = pd_body(body, {"p": 1}, "placeholders", answer)
    assert media == "media" and pd == dict(body, ec_transfer_params={"p": 1})
    assert placeholder_body(chat({"type": "mystery"}), {"h": {"item_indices": [0], "metadata": GRID}}) is None
    assert placeholder_body({"prompt": "p"}, {"h": {"item_indices": [0], "metadata": GRID}}) is None


def test_config_validation():
    base = dict(encoders=["http://e"], pd=["http://p0", "http://p1/"])
    assert ProxyConfig(**base).flow == "pull"
    cfg = ProxyConfig(**base, flow="mooncake", pd_ec_addresses=["127.0.0.1:15608", ZMQ[1]])
    assert cfg.pd == ["http://p0", "http://p1"] and cfg.pd_ec_addresses == ZMQ and cfg.flow == "push"
    with pytest.raises(ValueError, match="unknown flow"):
        ProxyConfig(**base, flow="shove")
    with pytest.raises(ValueError, match="unknown pd_media"):
        ProxyConfig(**base, pd_media="pixels")
    with pytest.raises(ValueError, match="pd_media must be 'media'"):
        ProxyConfig(**base, flow="overlap", pd_media="placeholders")
    assert ProxyConfig(**base, pd_media="placeholders").pd_media == "placeholders"
    with pytest.raises(ValueError, match="one consumer address per PD"):
        ProxyConfig(**base, flow="push", pd_ec_addresses=ZMQ[:1])
    with pytest.raises(ValueError, match="only used by flow 'push'"):
        ProxyConfig(**base, pd_ec_addresses=ZMQ)
    with pytest.raises(ValueError, match="not host:port"):
        ProxyConfig(**base, flow="mooncake", pd_ec_addresses=[ZMQ[0], "localhost"])
    with pytest.raises(ValueError, match="listed twice"):
        ProxyConfig(encoders=["http://e"], pd=["http://p", "http://p"], flow="mooncake", pd_ec_addresses=ZMQ)


def test_cli():
    a = parse_args(["--encoders", "http://e", "--pd", "http://p0,http://p1", "--flow", "mooncake",
                    "--pd-ec-addresses", f"{ZMQ[0]}, 127.0.0.1:15616"])
    cfg = config_from_args(a)
    assert (cfg.flow, cfg.pd_ec_addresses, cfg.pd_media) == ("push", ZMQ, "media")
    cfg = config_from_args(parse_args(["--encoders", "http://e", "--pd", "http://p", "--pd-media", "placeholders"]))
    assert (cfg.flow, cfg.pd_ec_addresses, cfg.pd_media) == ("pull", [], "placeholders")


def mooncake_encoder(answer_hash: str = "h"):
    """A stub encoder answering as ECMooncakeScheduler.request_finished does: one entry per item of
    the request's ec_items, keyed by a fake mm_hash, echoing the transfer_id."""

    async def handler(stub: Stub, request: web.Request, body: Any) -> web.Response:
        if request.path == "/health":
            return web.Response(text="")
        items = body["ec_transfer_params"]["ec_items"]
        params = {f"{answer_hash}{i}": {"item_indices": [i], "metadata": {}, "transfer_id": it["transfer_id"]}
                  for i, it in enumerate(items)} or None
        return web.json_response({"choices": [], "ec_transfer_params": params})

    return handler


def test_push_flow_end_to_end_through_stubs():
    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            es = [await Stub(f"e{i}", mooncake_encoder(f"e{i}-h")).start(stack) for i in range(2)]
            pds = [await Stub(f"pd{i}", pd_echo).start(stack) for i in range(2)]
            proxy = await start_proxy(stack, [e.url for e in es], [p.url for p in pds], flow="push",
                                      pd_ec_addresses=ZMQ)
            body = chat(IMG, TXT, IMG, temperature=0.0)
            for i in range(4):
                status, answer = await post(s, proxy, body)
                assert status == 200 and answer["served_by"] == f"pd{i % 2}"
                e_body = es[i % 2].seen[-1][1]
                # the encoder was told to push to the PD the request then went to, with fresh ids
                params = e_body["ec_transfer_params"]
                assert params["consumer_zmq"] == ZMQ[i % 2] and e_body["max_tokens"] == 1
                ids = [it["transfer_id"] for it in params["ec_items"]]
                assert len(ids) == 2 and len(set(ids)) == 2
                entries = {f"e{i % 2}-h{k}": {"item_indices": [k], "metadata": {}, "transfer_id": ids[k]}
                           for k in range(2)}
                assert answer["received"] == dict(body, ec_transfer_params=dict(entries, ec_items=[
                    {"transfer_id": ids[0], "mm_hash": f"e{i % 2}-h0"},
                    {"transfer_id": ids[1], "mm_hash": f"e{i % 2}-h1"}]))
            all_ids = [it["transfer_id"] for e in es for _, b in e.seen for it in b["ec_transfer_params"]["ec_items"]]
            assert len(all_ids) == len(set(all_ids)) == 8, "transfer ids must be unique per request and item"

            # text-only chat: no encoder call, body untouched; the PD round-robin still advances
            assert await post(s, proxy, TEXT_CHAT) == (200, {"served_by": "pd0", "received": TEXT_CHAT})
            assert [len(e.seen) for e in es] == [2, 2]

    run(main())


def test_push_flow_has_no_encoder_fallback():
    """A Mooncake PD never encodes by itself: an encoder failure is an error naming the encoder
    (even with encoder_fallback on), not a PD request that waits out its push timeout."""

    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            failing = await Stub("fail", fail).start(stack)
            pd = await Stub("pd", pd_echo).start(stack)
            gone = dead_url()
            for enc, status, words in [(failing.url, 502, "HTTP 500"), (gone, 503, "unreachable")]:
                proxy = await start_proxy(stack, [enc], [pd.url], flow="push", pd_ec_addresses=ZMQ[:1],
                                          encoder_fallback=True, connect_timeout_s=0.5)
                t0 = time.perf_counter()
                got, answer = await post(s, proxy, IMAGE_CHAT)
                err = answer["error"]
                assert (got, err["stage"], err["backend"]) == (status, "encoder", enc), err
                assert words in err["message"] and time.perf_counter() - t0 < 2.0
            assert pd.seen == []

    run(main())


def test_pull_flow_is_unchanged_by_the_new_fields():
    """The default flow sends the encoder no ec_transfer_params and forwards its answer's as is."""

    async def encoder(stub: Stub, request: web.Request, body: Any) -> web.Response:
        return web.json_response({"choices": [], "ec_transfer_params": {"h": {"peer": 1}}})

    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            e = await Stub("e", encoder).start(stack)
            pd = await Stub("pd", pd_echo).start(stack)
            proxy = await start_proxy(stack, [e.url], [pd.url])
            assert await post(s, proxy, IMAGE_CHAT) == (
                200, {"served_by": "pd", "received": dict(IMAGE_CHAT, ec_transfer_params={"h": {"peer": 1}})})
            assert e.seen == [("/v1/chat/completions", encoder_body(IMAGE_CHAT))]

    asyncio.run(main())


def test_placeholders_through_the_proxy_and_the_header_that_says_so():
    """``--pd-media placeholders``: the PD gets the placeholder body when the encoder described
    every item (``X-EC-PD-Media: placeholders``), the media otherwise (``media``), and a text-only
    request gets no header; the encoder always gets the media."""
    answers = [{"h": {"item_indices": [0], "metadata": GRID}}, {"h": {"item_indices": [0], "metadata": {}}}]

    async def encoder(stub: Stub, request: web.Request, body: Any) -> web.Response:
        return web.json_response({"choices": [], "ec_transfer_params": answers[len(stub.seen) - 1]})

    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            e = await Stub("e", encoder).start(stack)
            pd = await Stub("pd", pd_echo).start(stack)
            proxy = await start_proxy(stack, [e.url], [pd.url], pd_media="placeholders")
            for answer, media in zip(answers, ("placeholders", "media")):
                async with s.post(proxy + "/v1/chat/completions", json=IMAGE_CHAT) as r:
                    assert r.status == 200 and r.headers.get("X-EC-PD-Media") == media
                    got = (await r.json())["received"]
                want = placeholder_body(IMAGE_CHAT, answer) if media == "placeholders" else IMAGE_CHAT
                assert got == dict(want, ec_transfer_params=answer)
            assert [b for _, b in e.seen] == [encoder_body(IMAGE_CHAT)] * 2
            async with s.post(proxy + "/v1/chat/completions", json=TEXT_CHAT) as r:
                assert r.status == 200 and "X-EC-PD-Media" not in r.headers

    asyncio.run(main())
