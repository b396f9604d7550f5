"""Encode -> Prefill/Decode request router (aiohttp; imports no vLLM).

For ``POST /v1/chat/completions`` and ``POST /v1/completions`` the proxy

1. sends a copy of the body to an encoder instance (round-robin) as a 1-token, non-streaming
   request: the encoder runs the multimodal encoder, its connector publishes the outputs, and the
   top-level ``ec_transfer_params`` of its JSON answer says where they are (absent or null when
   there is nothing to move, e.g. a text-only prompt);
2. adds that field, unchanged, as top-level ``ec_transfer_params`` of the original body and sends
   it to a prefill/decode instance (round-robin);
3. passes the PD answer (status, content type, bytes; streamed or not) through to the client.

Chat requests without any non-text content part skip step 1. ``GET /health`` is 200 only when every
backend's ``/health`` is; ``GET /v1/models`` goes to a PD instance.

Every backend call has a timeout. A backend that cannot be reached gives 503, one that times out,
drops the connection or answers 5xx gives 502, one that answers 4xx (a bad request) keeps its
status; the JSON error always names the instance (URL) and the stage that failed.

Except for the encoder stage (``encoder_fallback``, on by default): an encoder that cannot be
reached, times out or fails (5xx) is skipped and the request goes to the PD without
``ec_transfer_params``: the PD encodes the media itself, so an encoder restart costs latency, not
errors. The answer then carries the header ``X-EC-Fallback`` naming the encoder and the cause. A
4xx from the encoder (a bad request) is still answered as is.

    python -m ec_nixl.disagg.proxy --encoders http://127.0.0.1:8100 --pd http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp
from aiohttp import web

log = logging.getLogger("ec_nixl.proxy")

# Headers worth passing to the backends (auth, tracing); hop-by-hop ones must not be.
FORWARD_HEADERS = ("Authorization", "X-Request-Id")
TEXT_PART_TYPES = ("text", "input_text")


@dataclass
class ProxyConfig:
    encoders: list[str]
    pd: list[str]
    connect_timeout_s: float = 5.0
    """TCP connect to any backend."""
    encode_timeout_s: float = 120.0
    """Whole encoder request (it returns after one step)."""
    pd_timeout_s: float = 600.0
    """Longest silence while reading a PD answer (between streamed chunks, or until a
    non-streamed answer is complete)."""
    health_timeout_s: float = 5.0
    encoder_fallback: bool = True
    """Send the request to the PD without ``ec_transfer_params`` when the encoder stage fails (not
    for a 4xx): the PD encodes the media itself."""

    def __post_init__(self) -> None:
        if not self.encoders or not self.pd:
            raise ValueError("need at least one encoder URL and one PD URL")
        self.encoders = [u.rstrip("/") for u in self.encoders]
        self.pd = [u.rstrip("/") for u in self.pd]


class BackendError(Exception):
    """A backend call failed; becomes the JSON error answered to the client."""

    def __init__(self, status: int, stage: str, url: str, reason: str):
        super().__init__(f"{stage} instance {url} failed: {reason}")
        self.status, self.stage, self.url, self.reason = status, stage, url, reason

    def response(self) -> web.Response:
        err = {"message": str(self), "type": "BackendError", "code": self.status, "stage": self.stage,
               "backend": self.url}
        return web.json_response({"error": err}, status=self.status)


def needs_encoder(body: dict[str, Any]) -> bool:
    """False only for chat requests whose contents are all text; anything else may carry media."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return True
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            not (isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES) for p in content
        ):
            return True
    return False


def encoder_body(body: dict[str, Any]) -> dict[str, Any]:
    """The encoder's copy: same prompt and media, one token, no streaming."""
    e = dict(body, max_tokens=1, stream=False)
    e.pop("stream_options", None)
    if "max_completion_tokens" in e:
        e["max_completion_tokens"] = 1
    return e


def _error_status(backend_status: int) -> int:
    return backend_status if 400 <= backend_status < 500 else 502


class Proxy:
    """Routes requests E -> PD; one instance serves one aiohttp app."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self._rr = {"encoder": itertools.cycle(cfg.encoders), "pd": itertools.cycle(cfg.pd)}
        self._session: Optional[aiohttp.ClientSession] = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)  # images travel inline as base64
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _timeout(self, total: Optional[float] = None, read: Optional[float] = None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, sock_connect=self.cfg.connect_timeout_s, sock_read=read)

    async def _call(self, stage: str, url: str, method: str, path: str, timeout: aiohttp.ClientTimeout,
                    **kw: Any) -> aiohttp.ClientResponse:
        """Start a backend request; map every way it can fail to a BackendError naming ``url``."""
        assert self._session is not None
        try:
            resp = await self._session.request(method, url + path, timeout=timeout, **kw)
        except aiohttp.ClientConnectorError as e:
            raise BackendError(503, stage, url, f"unreachable ({e.os_error or e})") from e
        except asyncio.TimeoutError as e:
            raise BackendError(502, stage, url, f"timed out ({_limits(timeout)})") from e
        except aiohttp.ClientError as e:
            raise BackendError(502, stage, url, f"{type(e).__name__}: {e}") from e
        if resp.status >= 400:
            async with resp:
                text = await _read_text(resp, stage, url, timeout)
            raise BackendError(_error_status(resp.status), stage, url, f"HTTP {resp.status}: {text[:500]}")
        return resp

    async def _encode(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        url = next(self._rr["encoder"])
        t = self._timeout(total=self.cfg.encode_timeout_s)
        async with await self._call("encoder", url, "POST", path, t, json=encoder_body(body), headers=headers) as r:
            text = await _read_text(r, "encoder", url, t)
        try:
            return json.loads(text).get("ec_transfer_params")
        except (ValueError, AttributeError) as e:
            raise BackendError(502, "encoder", url, f"answer is not a JSON object: {text[:200]!r}") from e

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body must be a JSON object", "code": 400}}, status=400)
        headers = {h: request.headers[h] for h in FORWARD_HEADERS if h in request.headers}
        t0 = time.perf_counter()
        fallback = ""
        try:
            if needs_encoder(body):
                try:
                    params = await self._encode(request.path, body, headers)
                except BackendError as e:
                    if not self.cfg.encoder_fallback or 400 <= e.status < 500:
                        raise
                    fallback = str(e)[:300]
                    log.warning("%s %s: %s; the PD encodes it instead", request.method, request.path, e)
                    params = None
                if params is not None:
                    body = dict(body, ec_transfer_params=params)
            t_enc = time.perf_counter() - t0
            url = next(self._rr["pd"])
            t = self._timeout(read=self.cfg.pd_timeout_s)
            pd = await self._call("pd", url, "POST", request.path, t, json=body, headers=headers)
        except BackendError as e:
            log.warning("%s %s: %s", request.method, request.path, e)
            return e.response()
        async with pd:
            out = web.StreamResponse(status=pd.status)
            out.headers["Content-Type"] = pd.headers.get("Content-Type", "application/json")
            if fallback:
                out.headers["X-EC-Fallback"] = fallback
            await out.prepare(request)
            try:
                async for chunk in pd.content.iter_any():
                    await out.write(chunk)
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionResetError) as e:
                # Headers are gone already (or the client is): log and cut the stream short.
                log.warning("pd instance %s: answer cut short: %s", url, str(e) or type(e).__name__)
                return out
            await out.write_eof()
        log.debug("%s E %.1f ms, E+PD %.1f ms via %s", request.path, t_enc * 1e3,
                  (time.perf_counter() - t0) * 1e3, url)
        return out

    async def _probe(self, role: str, url: str) -> dict[str, Any]:
        state: dict[str, Any] = {"role": role, "url": url}
        try:
            async with await self._call(role, url, "GET", "/health", self._timeout(self.cfg.health_timeout_s)) as r:
                state.update(ok=True, status=r.status)
        except BackendError as e:
            state.update(ok=False, error=e.reason)
        return state

    async def _health(self, _request: web.Request) -> web.Response:
        backends = await asyncio.gather(*(self._probe("encoder", u) for u in self.cfg.encoders),
                                        *(self._probe("pd", u) for u in self.cfg.pd))
        ok = all(b["ok"] for b in backends)
        return web.json_response({"status": "ok" if ok else "unhealthy", "backends": backends},
                                 status=200 if ok else 503)

    async def _models(self, request: web.Request) -> web.Response:
        url = next(self._rr["pd"])
        headers = {h: request.headers[h] for h in FORWARD_HEADERS if h in request.headers}
        t = self._timeout(self.cfg.health_timeout_s)
        try:
            async with await self._call("pd", url, "GET", "/v1/models", t, headers=headers) as r:
                body = await _read_bytes(r, "pd", url, t)
        except BackendError as e:
            return e.response()
        return web.Response(body=body, status=r.status, content_type=r.content_type)


def _limits(t: aiohttp.ClientTimeout) -> str:
    parts = {"total": t.total, "connect": t.sock_connect, "read": t.sock_read}
    return ", ".join(f"{k} {v:g}s" for k, v in parts.items() if v)


async def _read_bytes(resp: aiohttp.ClientResponse, stage: str, url: str, t: aiohttp.ClientTimeout) -> bytes:
    try:
        return await resp.read()
    except asyncio.TimeoutError as e:
        raise BackendError(502, stage, url, f"timed out reading the answer ({_limits(t)})") from e
    except aiohttp.ClientError as e:
        raise BackendError(502, stage, url, f"{type(e).__name__} reading the answer: {e}") from e


async def _read_text(resp: aiohttp.ClientResponse, stage: str, url: str, t: aiohttp.ClientTimeout) -> str:
    return (await _read_bytes(resp, stage, url, t)).decode("utf-8", "replace")


def _urls(s: str) -> list[str]:
    return [u.strip() for u in s.split(",") if u.strip()]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ec_nixl.disagg.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--encoders", required=True, type=_urls, help="comma-separated encoder base URLs")
    p.add_argument("--pd", required=True, type=_urls, help="comma-separated prefill/decode base URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--connect-timeout", type=float, default=ProxyConfig.connect_timeout_s)
    p.add_argument("--encode-timeout", type=float, default=ProxyConfig.encode_timeout_s)
    p.add_argument("--pd-timeout", type=float, default=ProxyConfig.pd_timeout_s)
    p.add_argument("--health-timeout", type=float, default=ProxyConfig.health_timeout_s)
    p.add_argument("--no-encoder-fallback", dest="encoder_fallback", action="store_false",
                   help="answer an encoder failure with an error instead of letting the PD encode")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(encoders=a.encoders, pd=a.pd, connect_timeout_s=a.connect_timeout,
                       encode_timeout_s=a.encode_timeout, pd_timeout_s=a.pd_timeout,
                       health_timeout_s=a.health_timeout, encoder_fallback=a.encoder_fallback)


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(a)
    log.info("proxy on http://%s:%d  encoders=%s  pd=%s", a.host, a.port, cfg.encoders, cfg.pd)
    web.run_app(Proxy(cfg).app(), host=a.host, port=a.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
