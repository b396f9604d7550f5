"""Unit tests of the E -> PD proxy (ec_nixl.disagg.proxy): routing, forwarding, streaming, errors.

The backends here are small aiohttp stubs started inside each test. They stand in for vLLM only to
exercise the proxy's routing, streaming and error handling; the proxy against real vLLM servers is
covered by tests/e2e/test_e2e_example.py.
"""

from __future__ import annotations

import asyncio
import socket
import time
from contextlib import AsyncExitStack
from typing import Any, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from ec_nixl.disagg.proxy import Proxy, ProxyConfig, encoder_body, needs_encoder

IMAGE_CHAT = {
    "model": "m",
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "describe"},
            ],
        }
    ],
    "max_tokens": 8,
    "temperature": 0.0,
}
TEXT_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Stub:
    """One fake backend: records every request, answers with ``handler``."""

    def __init__(self, name: str, handler: Callable[["Stub", web.Request, Any], Awaitable[web.StreamResponse]]):
        self.name, self.handler = name, handler
        self.seen: list[tuple[str, Any]] = []
        self.url = ""

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.method == "POST" else None
        self.seen.append((request.path, body))
        return await self.handler(self, request, body)

    async def start(self, stack: AsyncExitStack) -> "Stub":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self.url = await serve(app, stack)
        return self


async def serve(app: web.Application, stack: AsyncExitStack) -> str:
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


async def encoder_ok(stub: Stub, request: web.Request, body: Any) -> web.Response:
    if request.path == "/health":
        return web.Response(text="")
    return web.json_response({"choices": [], "ec_transfer_params": params_of(stub.name)})


def params_of(name: str) -> dict:
    """What encoder ``name`` answers: nested values of every JSON type, to check exact forwarding."""
    return {"from": name, "h1": {"peer": "10.0.0.1:15600", "size": 1 << 40, "f": 0.1, "ok": True, "none": None,
                                 "l": [1, "a", []]}}


async def pd_echo(stub: Stub, request: web.Request, body: Any) -> web.Response:
    if request.path == "/health":
        return web.Response(text="")
    if request.path == "/v1/models":
        return web.json_response({"data": [{"id": "m", "served_by": stub.name}]})
    return web.json_response({"served_by": stub.name, "received": body})


async def fail(stub: Stub, request: web.Request, body: Any) -> web.Response:
    """A backend that answers every request 500."""
    return web.json_response({"error": "boom"}, status=500)


def dead_url() -> str:
    """A URL on which nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def start_proxy(stack: AsyncExitStack, encoders: list[str], pd: list[str], **kw: float) -> str:
    return await serve(Proxy(ProxyConfig(encoders=encoders, pd=pd, **kw)).app(), stack)


async def post(session: aiohttp.ClientSession, url: str, body: dict, path: str = "/v1/chat/completions"):
    async with session.post(url + path, json=body) as r:
        return r.status, await r.json()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)


def test_body_helpers():
    assert needs_encoder(IMAGE_CHAT) and needs_encoder({"prompt": "x"})
    assert not needs_encoder(TEXT_CHAT)
    assert not needs_encoder({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    e = encoder_body(dict(IMAGE_CHAT, stream=True, stream_options={"include_usage": True}, max_completion_tokens=9))
    assert (e["max_tokens"], e["max_completion_tokens"], e["stream"]) == (1, 1, False)
    assert "stream_options" not in e and e["messages"] == IMAGE_CHAT["messages"]


def test_round_robin_and_exact_forwarding():
    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            es = [await Stub(f"e{i}", encoder_ok).start(stack) for i in range(2)]
            pds = [await Stub(f"pd{i}", pd_echo).start(stack) for i in range(2)]
            proxy = await start_proxy(stack, [e.url for e in es], [p.url for p in pds])
            completion = {"model": "m", "prompt": "p", "max_tokens": 8}
            requests = [("/v1/chat/completions", IMAGE_CHAT), ("/v1/completions", completion)] * 2
            for i, (path, body) in enumerate(requests):
                status, answer = await post(s, proxy, body, path)
                # request i: encoder i % 2, then PD i % 2 with the original body + that encoder's params
                assert status == 200 and answer["served_by"] == f"pd{i % 2}"
                assert answer["received"] == dict(body, ec_transfer_params=params_of(f"e{i % 2}"))
            assert [[p for p, _ in e.seen] for e in es] == [["/v1/chat/completions"] * 2, ["/v1/completions"] * 2]
            assert [len(p.seen) for p in pds] == [2, 2]
            for _, b in es[0].seen + es[1].seen:
                assert b["max_tokens"] == 1 and b["stream"] is False

    run(main())


def test_text_only_and_paramless_requests_go_straight_to_pd():
    async def encoder_no_params(stub: Stub, request: web.Request, body: Any) -> web.Response:
        return web.json_response({"choices": [], "ec_transfer_params": None})

    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            e = await Stub("e", encoder_no_params).start(stack)
            pd = await Stub("pd", pd_echo).start(stack)
            proxy = await start_proxy(stack, [e.url], [pd.url])
            assert (await post(s, proxy, TEXT_CHAT)) == (200, {"served_by": "pd", "received": TEXT_CHAT})
            assert e.seen == []
            assert (await post(s, proxy, IMAGE_CHAT)) == (200, {"served_by": "pd", "received": IMAGE_CHAT})
            assert len(e.seen) == 1

    run(main())


def test_streaming_is_passed_through_as_it_arrives():
    chunks = [b'data: {"n": 0}\n\n', b'data: {"n": 1}\n\n', b"data: [DONE]\n\n"]
    gap_s = 0.3

    async def pd_stream(stub: Stub, request: web.Request, body: Any) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        for c in chunks:
            await out.write(c)
            await asyncio.sleep(gap_s)
        await out.write_eof()
        return out

    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            e = await Stub("e", encoder_ok).start(stack)
            pd = await Stub("pd", pd_stream).start(stack)
            proxy = await start_proxy(stack, [e.url], [pd.url])
            t0 = time.perf_counter()
            async with s.post(proxy + "/v1/chat/completions", json=dict(IMAGE_CHAT, stream=True)) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                got, first_s = b"", None
                async for data in r.content.iter_any():
                    first_s = first_s if first_s is not None else time.perf_counter() - t0
                    got += data
            assert got == b"".join(chunks)
            assert first_s < gap_s * (len(chunks) - 1), "first chunk arrived only after the PD finished"
            assert pd.seen[0][1]["stream"] is True and pd.seen[0][1]["ec_transfer_params"]["from"] == "e"
            assert e.seen[0][1]["stream"] is False

    run(main())


def test_dead_or_failing_backends_are_named():
    async def hang(stub: Stub, request: web.Request, body: Any) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(text="late")

    async def reject(stub: Stub, request: web.Request, body: Any) -> web.Response:
        return web.json_response({"error": "too many images"}, status=400)

    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            ok_e = await Stub("e", encoder_ok).start(stack)
            ok_pd = await Stub("pd", pd_echo).start(stack)
            hung = await Stub("hung", hang).start(stack)
            failing = await Stub("fail", fail).start(stack)
            rejecting = await Stub("reject", reject).start(stack)
            gone = dead_url()
            timeouts = dict(connect_timeout_s=0.5, encode_timeout_s=0.5, pd_timeout_s=0.5, encoder_fallback=False)
            cases = [  # (encoder, pd, status, stage, url, words in the message)
                (gone, ok_pd.url, 503, "encoder", gone, "unreachable"),
                (ok_e.url, gone, 503, "pd", gone, "unreachable"),
                (hung.url, ok_pd.url, 502, "encoder", hung.url, "timed out"),
                (ok_e.url, hung.url, 502, "pd", hung.url, "timed out"),
                (failing.url, ok_pd.url, 502, "encoder", failing.url, "HTTP 500"),
                (ok_e.url, failing.url, 502, "pd", failing.url, "boom"),
                (rejecting.url, ok_pd.url, 400, "encoder", rejecting.url, "too many images"),
            ]
            for enc, pd, status, stage, url, words in cases:
                proxy = await start_proxy(stack, [enc], [pd], **timeouts)
                t0 = time.perf_counter()
                got_status, answer = await post(s, proxy, IMAGE_CHAT)
                took = time.perf_counter() - t0
                err = answer["error"]
                assert (got_status, err["stage"], err["backend"]) == (status, stage, url), err
                assert url in err["message"] and words in err["message"], err
                assert took < 2.0, f"{stage} failure took {took:.1f}s"

    run(main())


def test_encoder_that_stops_answering_health_is_failed_over_and_a_busy_one_is_not():
    """An encoder whose host vanished mid-request answers nothing, not even ``/health``: its
    request fails over to the PD (which encodes) after ``encoder_watch_s`` + the watch timeout,
    not after ``encode_timeout_s``. An encoder that is only slow (its request takes longer than
    several watch periods) still answers ``/health`` and keeps its request."""

    async def busy(stub: Stub, request: web.Request, body: Any) -> web.Response:
        if request.path == "/health":
            return web.Response(text="")
        await asyncio.sleep(1.5)
        return web.json_response({"choices": [], "ec_transfer_params": params_of(stub.name)})

    async def vanished(stub: Stub, request: web.Request, body: Any) -> web.Response:
        await asyncio.sleep(30)  # nothing answers: neither the request nor /health
        return web.Response(text="late")

    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            pd = await Stub("pd", pd_echo).start(stack)
            slow = await Stub("busy", busy).start(stack)
            gone = await Stub("gone", vanished).start(stack)
            watch = dict(encoder_watch_s=0.3, encoder_watch_timeout_s=0.5, encode_timeout_s=30.0)
            for enc, want_params in ((slow, params_of("busy")), (gone, None)):
                proxy = await start_proxy(stack, [enc.url], [pd.url], **watch)
                t0 = time.perf_counter()
                async with s.post(proxy + "/v1/chat/completions", json=IMAGE_CHAT) as r:
                    status, answer, fallback = r.status, await r.json(), r.headers.get("X-EC-Fallback", "")
                took = time.perf_counter() - t0
                assert status == 200, answer
                assert answer["received"].get("ec_transfer_params") == want_params, answer
                if want_params is None:
                    assert "/health" in fallback and enc.url in fallback, fallback
                    assert took < 0.3 + 0.5 + 1.0, f"failed over after {took:.2f}s"
                else:
                    assert not fallback and took >= 1.5, (fallback, took)
                    assert sum(1 for path, _ in enc.seen if path == "/health") >= 2, enc.seen

    run(main())


def test_health_and_models():
    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            e = await Stub("e", encoder_ok).start(stack)
            pd = await Stub("pd", pd_echo).start(stack)
            proxy = await start_proxy(stack, [e.url], [pd.url])
            async with s.get(proxy + "/health") as r:
                assert r.status == 200
                assert [(b["role"], b["url"], b["ok"]) for b in (await r.json())["backends"]] == [
                    ("encoder", e.url, True), ("pd", pd.url, True)]
            async with s.get(proxy + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["served_by"] == "pd"

            gone = dead_url()
            proxy = await start_proxy(stack, [e.url], [pd.url, gone], health_timeout_s=0.5)
            async with s.get(proxy + "/health") as r:
                assert r.status == 503
                state = {b["url"]: b for b in (await r.json())["backends"]}
                assert state[e.url]["ok"] and state[pd.url]["ok"]
                assert not state[gone]["ok"] and "unreachable" in state[gone]["error"]

    run(main())


def test_bad_body_is_rejected_without_backend_calls():
    async def main() -> None:
        async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
            e = await Stub("e", encoder_ok).start(stack)
            pd = await Stub("pd", pd_echo).start(stack)
            proxy = await start_proxy(stack, [e.url], [pd.url])
            async with s.post(proxy + "/v1/completions", data=b"not json") as r:
                assert r.status == 400
            assert e.seen == [] and pd.seen == []

    run(main())


@pytest.mark.parametrize("cfg", [dict(encoders=[], pd=["http://x"]), dict(encoders=["http://x"], pd=[])])
def test_config_needs_backends(cfg: dict):
    with pytest.raises(ValueError):
        ProxyConfig(**cfg)
