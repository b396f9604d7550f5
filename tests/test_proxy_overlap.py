"""The proxy's overlapped flow (``--flow overlap``, what serve-disagg runs for NixlECConnector):
the PD gets the request at the same time as the encoder, told to expect the items at the producer
the encoder's earlier answers announced.

Backends are the aiohttp stubs of tests/test_proxy.py (the flow against real vLLM servers is in
tests/e2e/test_e2e_nixl.py); they record when each request arrived and can hold their answer
back, so the tests order events by those records, not by sleeps deciding outcomes.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
from aiohttp import web

from ec_nixl.params import EXPECT_KEY, build_expect
from test_proxy import IMAGE_CHAT, TEXT_CHAT, Stub, pd_echo, post, run, start_proxy

PRODUCER = "10.1.2.3:15600"
E_PARAMS = {"h1": {"item_indices": [0], "ec_nixl": {"v": 1, "producer": PRODUCER, "shape": [4, 8],
                                                     "dtype": "bfloat16", "nbytes": 64}}}


def encoder(release: asyncio.Event, status: int = 200):
    """An encoder that answers once ``release`` is set (the first request at once)."""
    async def handler(stub: Stub, request: web.Request, body: Any) -> web.Response:
        if len(stub.seen) > 1:
            await release.wait()
        stub.times.append(time.monotonic())
        if status != 200:
            return web.json_response({"error": {"message": "encoder broke"}}, status=status)
        return web.json_response({"choices": [], "ec_transfer_params": E_PARAMS})
    return handler


def timed(handler):
    async def wrapped(stub: Stub, request: web.Request, body: Any) -> web.StreamResponse:
        stub.times.append(time.monotonic())
        return await handler(stub, request, body)
    return wrapped


async def overlap_proxy(stack: AsyncExitStack, e_handler, pd_handler) -> tuple[Stub, Stub, str]:
    """One encoder stub, one PD stub (each recording when requests arrived) and the proxy."""
    e, pd = Stub("e0", e_handler), Stub("pd0", pd_handler)
    e.times, pd.times = [], []
    await e.start(stack)
    await pd.start(stack)
    return e, pd, await start_proxy(stack, [e.url], [pd.url], flow="overlap")


def test_first_request_learns_the_producer_then_pd_runs_beside_the_encoder():
    async def main() -> None:
        release = asyncio.Event()
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            e, pd, proxy = await overlap_proxy(stack, encoder(release), timed(pd_echo))
            # 1st: E then PD, with E's params as they are (the proxy does not know the producer yet)
            status, answer = await post(s, proxy, IMAGE_CHAT)
            assert status == 200 and answer["received"] == dict(IMAGE_CHAT, ec_transfer_params=E_PARAMS)
            # 2nd: E holds its answer back; the PD answers all the same, told to expect the items
            status, answer = await post(s, proxy, IMAGE_CHAT)
            assert status == 200
            assert answer["received"] == dict(IMAGE_CHAT, ec_transfer_params=build_expect(PRODUCER))
            assert len(e.seen) == 2 and len(e.times) == 1, "the PD's answer waited for the encoder's"
            release.set()
            # text-only: no encoder, no params
            status, answer = await post(s, proxy, TEXT_CHAT)
            assert status == 200 and answer["received"] == TEXT_CHAT and len(e.seen) == 2

    run(main())


def test_encoder_failure_before_the_pd_answers_cancels_it_and_resends_without_params():
    async def main() -> None:
        release = asyncio.Event()
        e_state = {"fail": False}

        async def e_handler(stub: Stub, request: web.Request, body: Any) -> web.Response:
            if e_state["fail"]:
                await release.wait()  # fails only once the PD holds the request
                return web.json_response({"error": {"message": "encoder broke"}}, status=500)
            return web.json_response({"choices": [], "ec_transfer_params": E_PARAMS})

        cancelled = asyncio.Event()

        async def pd_handler(stub: Stub, request: web.Request, body: Any) -> web.StreamResponse:
            if EXPECT_KEY in (body.get("ec_transfer_params") or {}):
                release.set()  # the PD waits for items that will not come: until the proxy hangs up
                for _ in range(3000):
                    if request.transport is None or request.transport.is_closing():
                        cancelled.set()  # (vLLM aborts a request whose connection closed)
                        break
                    await asyncio.sleep(0.01)
            return await pd_echo(stub, request, body)

        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            e, pd, proxy = await overlap_proxy(stack, e_handler, pd_handler)
            assert (await post(s, proxy, IMAGE_CHAT))[0] == 200  # learns the producer
            e_state["fail"] = True
            t0 = time.monotonic()
            async with s.post(proxy + "/v1/chat/completions", json=IMAGE_CHAT) as r:
                status, answer, note = r.status, await r.json(), r.headers.get("X-EC-Fallback", "")
            assert time.monotonic() - t0 < 10, "the proxy waited for the PD instead of cancelling it"
            assert status == 200 and answer["received"] == IMAGE_CHAT, answer  # no params: PD encodes
            assert "encoder" in note and "500" in note, note
            await asyncio.wait_for(cancelled.wait(), 5)  # the waiting PD request was hung up on
            assert [b.get("ec_transfer_params") for _, b in pd.seen] == [E_PARAMS, build_expect(PRODUCER), None]

    run(main())


def test_encoder_bad_request_is_answered_as_is():
    async def main() -> None:
        calls = {"n": 0}

        async def e_handler(stub: Stub, request: web.Request, body: Any) -> web.Response:
            calls["n"] += 1
            if calls["n"] == 1:
                return web.json_response({"choices": [], "ec_transfer_params": E_PARAMS})
            return web.json_response({"error": {"message": "image too large"}}, status=400)

        async def pd_slow(stub: Stub, request: web.Request, body: Any) -> web.StreamResponse:
            if EXPECT_KEY in (body.get("ec_transfer_params") or {}):
                await asyncio.sleep(30)
            return await pd_echo(stub, request, body)

        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            e, pd, proxy = await overlap_proxy(stack, e_handler, pd_slow)
            assert (await post(s, proxy, IMAGE_CHAT))[0] == 200
            status, answer = await post(s, proxy, IMAGE_CHAT)
            assert status == 400 and "image too large" in answer["error"]["message"], answer

    run(main())


def test_an_empty_pd_answer_is_passed_on_not_asked_again():
    """The overlapped PD call's first read may be empty (a body-less answer): that is its answer,
    and the PD must not get the request a second time."""
    async def main() -> None:
        async def e_handler(stub: Stub, request: web.Request, body: Any) -> web.Response:
            return web.json_response({"choices": [], "ec_transfer_params": E_PARAMS})

        async def pd_empty(stub: Stub, request: web.Request, body: Any) -> web.Response:
            return web.Response(status=200, body=b"", content_type="application/json")

        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            e, pd, proxy = await overlap_proxy(stack, e_handler, pd_empty)
            for _ in range(2):  # the 1st learns the producer, the 2nd is overlapped
                async with s.post(proxy + "/v1/chat/completions", json=IMAGE_CHAT) as r:
                    assert r.status == 200 and await r.read() == b""
            assert len(pd.seen) == 2, [b.get("ec_transfer_params") for _, b in pd.seen]

    run(main())
