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
reached, times out, fails (5xx) or, while it runs the request, stops answering ``/health``
(``encoder_watch_s``: a host that vanished; a busy encoder still answers) is skipped and the request goes to the PD without
``ec_transfer_params``: the PD encodes the media itself, so an encoder restart costs latency, not
errors. The answer then carries the header ``X-EC-Fallback`` naming the encoder and the cause. A
4xx from the encoder (a bad request) is still answered as is.

    python -m ec_nixl.disagg.proxy --encoders http://127.0.0.1:8100 --pd http://127.0.0.1:8200 --port 8000

``--flow overlap`` (NixlECConnector only; opt-in, also through ``ec-nixl serve-disagg --proxy-args``) sends the PD its request
at the same time as the encoder, instead of after the encoder's answer: the PD's own preprocessing
(image decoding, the processor, tokenization) and its scheduling overlap the encoder's work, and
its transfer starts the moment the encoder publishes, before the encoder has even answered. The
PD's ``ec_transfer_params`` then only name the producer the items will be at
(``{"ec_nixl_expect": {"v": 1, "producer": "host:port"}}``); its connector waits there for each
item of the request (``expect_wait_s``, 5 s by default). The proxy learns each encoder's producer
address from that encoder's first answer, so the first request to an encoder goes E then PD. An
encoder that fails before the PD has answered anything makes the proxy cancel the PD's request
and resend it without ``ec_transfer_params`` (the PD encodes the media itself, as above; a 4xx is
answered as is); one that fails later costs at most ``expect_wait_s`` before the PD encodes.

``--flow push`` (first named ``mooncake``) is vLLM's EPD protocol as vllm-router speaks it: the
encoder is told, in its own request, which consumer the items are for. vLLM's in-tree
``ECMooncakeConnector`` needs it (its encoder *pushes* into that consumer, so with the pull flow it
would never push and every PD request would wait out the consumer's ``push_wait_timeout_s``);
NixlECConnector serves it too (its PD pulls with the coordinates in the encoder's entries). For
each request with media the proxy

1. picks the PD first (round-robin), and one fresh ``transfer_id`` per media part of the body;
2. sends the encoder the 1-token copy with ``ec_transfer_params = {"consumer_zmq": <that PD's
   consumer control address>, "ec_items": [{"transfer_id": t}, ...]}`` (one entry per media item,
   in prompt order);
3. once the encoder answered, sends the PD the body with ``ec_transfer_params`` = the encoder's
   entries plus ``"ec_items": [{"transfer_id": t, "mm_hash": h}, ...]``, the same ids in the same
   order, with ``mm_hash`` taken from the encoder's answer (its ``item_indices`` say which
   position each hash is) so the PD matches items by the engine's own hash, not only by position.

There is no encoder fallback in this flow: a Mooncake consumer never encodes by itself, it would
only wait for a push that is not coming.

    python -m ec_nixl.disagg.proxy --flow push --encoders http://127.0.0.1:8100 \
        --pd http://127.0.0.1:8200 --pd-ec-addresses tcp://127.0.0.1:15608 --port 8000

``--route cache-aware`` (flow pull; ``ec-nixl serve-disagg``'s default with more than one E or
PD) sends each request where its items' embeddings already are, as the engines' own
encoder-cache events (``--events``, ``ec_nixl.events``) say: straight to a PD whose encoder cache
holds them all (no encoder call), else each item to an encoder that holds it or the least-loaded
one, the PD by where the items are and by load, with a balance guard (``routing.py``). Answers
carry ``X-EC-Route`` (``pd-cache`` or ``encoder``); ``GET /ec-nixl/routing`` says what it decided.

``--pd-media placeholders`` (flows pull and push) sends the PD, instead of the media the encoder
reported, ``<modality>_embeds`` placeholders carrying the encoder's metadata and mm_hash, as
vllm-router does (``placeholders.py``): the PD skips fetching, decoding and preprocessing, and has
nothing to encode itself if a load fails (that request fails with the reason).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp
from aiohttp import web

from ec_nixl.disagg.items import map_back, subset_body, with_content_ids
from ec_nixl.disagg.placeholders import hashes_by_position, media_parts, placeholder_body
from ec_nixl.disagg.routing import BalanceGuard, CacheAwareRouter, Loads
from ec_nixl.params import announced_producer, build_expect, build_route

log = logging.getLogger("ec_nixl.proxy")

# Headers worth passing to the backends (auth, tracing); hop-by-hop ones must not be.
FORWARD_HEADERS = ("Authorization", "X-Request-Id")
FLOWS = ("pull", "overlap", "push", "mooncake")
FLOW_ALIASES = {"mooncake": "push"}  # the push flow's first name (ECMooncake was its only user)
PD_MEDIA = ("media", "placeholders")
ROUTES = ("round-robin", "cache-aware")


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
    encoder_watch_s: float = 1.0
    """While an encoder request runs longer than this, the encoder's ``/health`` is asked every
    this often over a fresh connection (0: never). A busy encoder answers it (vLLM's API server
    is not its engine); a host that vanished, whose in-flight request would otherwise wait out
    ``encode_timeout_s`` on a connection nothing answers, does not."""
    encoder_watch_timeout_s: float = 2.0
    """How long one such ``/health`` may take before the encoder is given up on (its request is
    then failed over like any encoder failure: the PD encodes)."""
    encoder_fallback: bool = True
    """Send the request to the PD without ``ec_transfer_params`` when the encoder stage fails (not
    for a 4xx): the PD encodes the media itself. Flow "pull" only (a Mooncake PD cannot)."""
    flow: str = "pull"
    """"pull": the encoder answers first and its ``ec_transfer_params`` go to the PD as is (the PD
    pulls). "overlap" (NixlECConnector): the PD gets the request at the same time as the encoder
    (see the module docstring). "push" (alias "mooncake"): vLLM's EPD protocol as vllm-router
    speaks it; the encoder is told the PD's consumer address up front (ECMooncakeConnector pushes
    there; see the module docstring)."""
    pd_media: str = "media"
    """Flows "pull" and "push": what the PD gets for the media the encoder reported. "media": the
    original parts (the PD preprocesses them, and can encode them itself if a load fails).
    "placeholders": ``<modality>_embeds`` parts with the encoder's metadata and mm_hash, as
    vllm-router sends (``disagg/placeholders.py``): no fetching, decoding or preprocessing on the
    PD, and no local encode to fall back on. Each answer says which in ``X-EC-PD-Media``."""
    pd_ec_addresses: list[str] = field(default_factory=list)
    """Flow "push" only: each PD's consumer control address, in the order of ``pd``: its
    ``tcp://ec_ip:ec_port`` (the first TP rank's port; one DP replica per PD URL). ``host:port``
    is taken as ``tcp://host:port``."""
    route: str = "round-robin"
    """"round-robin", or "cache-aware" (flow pull, needs ``events``; see the module docstring)."""
    events: list[str] = field(default_factory=list)
    """The encoder-cache event publishers of the backends (``tcp://host:port``, replay at port + 1)."""
    balance_abs: int = BalanceGuard.abs_threshold
    balance_rel: float = BalanceGuard.rel_threshold
    content_ids: Optional[bool] = None
    """Give media parts without a ``uuid`` one derived from their content (default: with cache-aware
    routing, which looks items up by them; ``items.py``)."""

    def __post_init__(self) -> None:
        if not self.encoders or not self.pd:
            raise ValueError("need at least one encoder URL and one PD URL")
        self.encoders = [u.rstrip("/") for u in self.encoders]
        self.pd = [u.rstrip("/") for u in self.pd]
        if self.encoder_watch_s < 0 or self.encoder_watch_timeout_s <= 0:
            raise ValueError("encoder_watch_s must be >= 0 and encoder_watch_timeout_s > 0")
        if self.flow not in FLOWS:
            raise ValueError(f"unknown flow {self.flow!r}; choose one of {', '.join(FLOWS)}")
        self.flow = FLOW_ALIASES.get(self.flow, self.flow)
        if self.pd_media not in PD_MEDIA:
            raise ValueError(f"unknown pd_media {self.pd_media!r}; choose one of {', '.join(PD_MEDIA)}")
        if self.flow == "overlap" and self.pd_media != "media":
            raise ValueError("flow 'overlap' sends the PD its request before the encoder has described "
                             "the media: pd_media must be 'media'")
        if self.route not in ROUTES:
            raise ValueError(f"unknown route {self.route!r}; choose one of {', '.join(ROUTES)}")
        if self.route == "cache-aware" and (self.flow != "pull" or not self.events):
            raise ValueError("route 'cache-aware' needs flow 'pull' and the backends' event publishers (events)")
        from ec_nixl.events.subscriber import parse_source

        for e in self.events:
            parse_source(e)  # (a ConfigError, a ValueError, names a malformed one)
        BalanceGuard(self.balance_abs, self.balance_rel)  # (validates them)
        if self.content_ids is None:
            self.content_ids = self.route == "cache-aware"
        if self.flow != "push":
            if self.pd_ec_addresses:
                raise ValueError("pd_ec_addresses is only used by flow 'push'")
            return
        # The encoder is told where to push before anything else happens; a PD without an
        # address could only be sent requests that wait out their push timeout.
        if len(self.pd_ec_addresses) != len(self.pd):
            raise ValueError(f"flow 'push' needs one consumer address per PD: got "
                             f"{len(self.pd_ec_addresses)} for {len(self.pd)} PD URLs {self.pd}")
        self.pd_ec_addresses = [_zmq_address(a) for a in self.pd_ec_addresses]
        seen: dict[str, str] = {}
        for url, addr in zip(self.pd, self.pd_ec_addresses):
            if seen.setdefault(url, addr) != addr:
                raise ValueError(f"PD {url} is listed twice with different consumer addresses")


def _zmq_address(addr: str) -> str:
    addr = addr.strip()
    if not addr or addr.endswith(":") or ":" not in addr:
        raise ValueError(f"consumer address {addr!r} is not host:port or tcp://host:port")
    return addr if "://" in addr else "tcp://" + addr


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
    return not isinstance(body.get("messages"), list) or bool(media_parts(body))


def encoder_body(body: dict[str, Any]) -> dict[str, Any]:
    """The encoder's copy: same prompt and media, one token, no streaming."""
    e = dict(body, max_tokens=1, stream=False)
    e.pop("stream_options", None)
    if "max_completion_tokens" in e:
        e["max_completion_tokens"] = 1
    return e


def media_items(body: dict[str, Any]) -> int:
    """How many multimodal items the engine will see: the non-text content parts of a chat body, in
    prompt order (each image, video or audio part is one item). 0 for a body without ``messages``,
    whose media (if any) the proxy cannot see; those items are then matched by content hash only."""
    return len(media_parts(body))


def push_encoder_body(body: dict[str, Any], consumer_zmq: str, transfer_ids: list[str]) -> dict[str, Any]:
    """The encoder's copy for flow "push": the 1-token copy, plus where to push (the chosen PD's
    consumer control address) and under which id each item goes (position i <-> ``mm_features[i]``
    on the encoder, which reads ``ec_items`` by position when they carry no ``mm_hash``)."""
    e = encoder_body(body)
    e["ec_transfer_params"] = {"consumer_zmq": consumer_zmq,
                               "ec_items": [{"transfer_id": t} for t in transfer_ids]}
    return e


def push_pd_params(transfer_ids: list[str], encoder_params: Any) -> dict[str, Any]:
    """The PD's ``ec_transfer_params`` for flow "push", as vllm-router builds them: the encoder's
    entries (keyed by mm_hash; a pulling connector such as NixlEC reads its coordinates there)
    plus ``ec_items``, the ids the encoder pushed under, in the order it was given them.

    Each position an entry's ``item_indices`` names gets that ``mm_hash``, so the PD matches the
    item by the engine-reported hash (a hash the proxy computed itself could differ: the engine
    folds processor kwargs into it); positions no entry names are matched by position. A
    client's own ``ec_transfer_params`` are replaced, not merged (the router keeps them)."""
    hashes = hashes_by_position(encoder_params, len(transfer_ids))
    items = [dict(transfer_id=t, **({"mm_hash": hashes[i]} if i in hashes else {}))
             for i, t in enumerate(transfer_ids)]
    entries = {h: e for h, e in encoder_params.items() if isinstance(e, dict)} \
        if isinstance(encoder_params, dict) else {}
    return dict(entries, ec_items=items)


def pd_body(body: dict[str, Any], params: dict[str, Any], pd_media: str,
            encoder_params: Any) -> tuple[dict[str, Any], str]:
    """The PD's body: ``params`` as its ``ec_transfer_params``, and its media as ``pd_media`` asks
    when the encoder's answer allows (see ``placeholders``). Returns (body, media sent)."""
    if pd_media == "placeholders":
        meta_only = placeholder_body(body, encoder_params)
        if meta_only is not None:
            return dict(meta_only, ec_transfer_params=params), "placeholders"
    return dict(body, ec_transfer_params=params), "media"


def _error_status(backend_status: int) -> int:
    return backend_status if 400 <= backend_status < 500 else 502


class Proxy:
    """Routes requests E -> PD; one instance serves one aiohttp app."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self._rr = {"encoder": itertools.cycle(cfg.encoders), "pd": itertools.cycle(cfg.pd)}
        self._pd_ec = dict(zip(cfg.pd, cfg.pd_ec_addresses))
        self._producers: dict[str, str] = {}  # flow overlap: encoder URL -> the producer its answers announce
        self._session: Optional[aiohttp.ClientSession] = None
        self._watch_session: Optional[aiohttp.ClientSession] = None
        self.loads = Loads()
        self.router: Optional[CacheAwareRouter] = None
        self._events = None  # the subscriber thread of the cache-aware route
        if cfg.route == "cache-aware":
            from ec_nixl.events.index import EventIndex

            self.router = CacheAwareRouter(cfg.encoders, cfg.pd, EventIndex(),
                                           BalanceGuard(cfg.balance_abs, cfg.balance_rel), self.loads)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)  # images travel inline as base64
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/ec-nixl/routing", self._routing)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        # the encoder watch must not reuse a pooled connection: that may be the one that hangs
        self._watch_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
        if self.router is not None:
            from ec_nixl.events.subscriber import Subscriber, SubscriberThread, parse_source

            sub = Subscriber([parse_source(e) for e in self.cfg.events], self.router.index)
            self._events = SubscriberThread(sub).start()

    async def _close(self, _app: web.Application) -> None:
        if self._events is not None:
            self._events.stop()
        if self._session is not None:
            await self._session.close()
        if self._watch_session is not None:
            await self._watch_session.close()

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

    async def _encode(self, path: str, body: dict[str, Any], headers: dict[str, str],
                      url: Optional[str] = None) -> Any:
        url = url or next(self._rr["encoder"])
        params = await self._post_encoder(url, path, encoder_body(body), headers)
        producer = announced_producer(params)
        if producer is not None:
            self._producers[url] = producer  # flow overlap: where this encoder's items will be
        return params

    async def _overlapped(self, path: str, body: dict[str, Any], headers: dict[str, str], e_url: str,
                          producer: str) -> tuple[str, aiohttp.ClientResponse, bytes, str]:
        """Flow "overlap": the encoder and the PD get the request at once; the PD is told to
        expect the items at ``producer``. Returns the PD's URL, its open answer, the answer's
        first bytes and the fallback note (see the module docstring for failures)."""
        e_task = asyncio.ensure_future(self._encode(path, body, headers, e_url))
        url = next(self._rr["pd"])
        t = self._timeout(read=self.cfg.pd_timeout_s)

        async def first_bytes(b: dict[str, Any]) -> tuple[aiohttp.ClientResponse, bytes]:
            resp = await self._call("pd", url, "POST", path, t, json=b, headers=headers)
            try:
                return resp, await resp.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionResetError) as e:
                resp.close()
                raise BackendError(502, "pd", url, f"{type(e).__name__}: {e}") from e
            except BaseException:
                resp.close()
                raise

        pd_task = asyncio.ensure_future(first_bytes(dict(body, ec_transfer_params=build_expect(producer))))
        try:
            await asyncio.wait({e_task, pd_task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client went away: so do both backend calls
            pd_task.cancel()
            e_task.cancel()
            raise
        e_error = e_task.exception() if e_task.done() else None
        if e_error is None or pd_task.done():
            e_task.add_done_callback(_log_late_encoder_failure)
            pd, first = await pd_task
            return url, pd, first, ""
        # The encoder failed before the PD answered anything: the PD would wait for items that
        # will not come. Cancel it (vLLM aborts a request whose connection closes) and do what
        # the pull flow does with an encoder failure.
        pd_task.cancel()
        await asyncio.gather(pd_task, return_exceptions=True)
        note = self._fall_back(e_error, path, "it")
        pd, first = await first_bytes(body)
        return url, pd, first, note

    def _falls_back(self, e: BackendError) -> bool:
        """An encoder failure the PD covers by encoding itself (``encoder_fallback``; never a 4xx)."""
        return self.cfg.encoder_fallback and not 400 <= e.status < 500

    def _fall_back(self, e: BaseException, where: str, what: str) -> str:
        """An encoder's failure ``e`` that the PD covers by encoding ``what`` itself: logged, and its
        note for ``X-EC-Fallback`` returned; any other failure is raised again (every flow's rule)."""
        if not isinstance(e, BackendError) or not self._falls_back(e):
            raise e
        log.warning("%s: %s; the PD encodes %s instead", where, e, what)
        return str(e)[:300]

    async def _post_encoder(self, url: str, path: str, e_body: dict[str, Any], headers: dict[str, str]) -> Any:
        """Send ``e_body`` to encoder ``url``; its answer's top-level ``ec_transfer_params``. An
        encoder that stops answering ``/health`` meanwhile fails the call (``_watch_encoder``)."""
        t = self._timeout(total=self.cfg.encode_timeout_s)

        async def post() -> str:
            async with await self._call("encoder", url, "POST", path, t, json=e_body, headers=headers) as r:
                return await _read_text(r, "encoder", url, t)

        if not self.cfg.encoder_watch_s:
            text = await post()
        else:
            call, watch = asyncio.ensure_future(post()), asyncio.ensure_future(self._watch_encoder(url))
            try:
                await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (call, watch):
                    if not task.done():
                        task.cancel()
                await asyncio.gather(call, watch, return_exceptions=True)
            text = call.result() if call.done() and not call.cancelled() else watch.result()
        try:
            return json.loads(text).get("ec_transfer_params")
        except (ValueError, AttributeError) as e:
            raise BackendError(502, "encoder", url, f"answer is not a JSON object: {text[:200]!r}") from e

    async def _watch_encoder(self, url: str) -> str:
        """Ask encoder ``url``'s ``/health`` every ``encoder_watch_s``, each over a new connection
        bounded by ``encoder_watch_timeout_s``; raise a BackendError (503) the first time it does
        not answer 200. Never returns normally (the encoder call it watches is cancelled then)."""
        assert self._watch_session is not None
        limit = self.cfg.encoder_watch_timeout_s
        t = aiohttp.ClientTimeout(total=limit, sock_connect=limit)
        while True:
            await asyncio.sleep(self.cfg.encoder_watch_s)
            try:
                async with self._watch_session.get(url + "/health", timeout=t) as r:
                    if r.status == 200:
                        continue
                    why = f"HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise BackendError(503, "encoder", url, f"stopped answering /health within {limit:g}s while "
                               f"encoding ({why})")

    async def _encode_push(self, path: str, body: dict[str, Any],
                           headers: dict[str, str]) -> tuple[str, dict[str, Any], str]:
        """Flow "push": the PD chosen for this request, the body it gets and the media sent.

        The PD is chosen first because the encoder must be told where to push. Encoder failures
        are not fallen back from: the PD's connector never encodes by itself.
        """
        pd_url = next(self._rr["pd"])
        if not needs_encoder(body):
            return pd_url, body, ""
        transfer_ids = [uuid.uuid4().hex for _ in range(media_items(body))]
        e_url = next(self._rr["encoder"])
        params = await self._post_encoder(e_url, path, push_encoder_body(body, self._pd_ec[pd_url], transfer_ids),
                                          headers)
        return (pd_url, *pd_body(body, push_pd_params(transfer_ids, params), self.cfg.pd_media, params))

    async def _cache_aware(self, path: str, body: dict[str, Any],
                           headers: dict[str, str]) -> tuple[str, dict[str, Any], str, str, str]:
        """Route ``cache-aware`` (``routing.py``): the PD chosen, its body, the media it got, the
        fallback note and the route taken. Items the PD holds are named to it (``ec_nixl_route``);
        the rest go to their encoders, each call carrying only its items, all at once; an encoder
        that fails is fallen back from as in the pull flow (the PD encodes those items)."""
        assert self.router is not None
        ids = with_content_ids(body)[1]
        plan = self.router.plan(ids)
        params: dict[str, Any] = build_route([ids[p] for p in plan.held_at_pd]) if plan.held_at_pd else {}
        if plan.skips_encoder:
            return plan.pd, dict(body, ec_transfer_params=params), "", "", "pd-cache"
        whole = len(plan.encoders) == 1 and not plan.held_at_pd

        async def encode(url: str, positions: list[int]) -> Any:
            e_body = encoder_body(body if whole else subset_body(body, positions))
            held = [ids[p] for p in plan.held_at_encoder.get(url, [])]
            if held:
                e_body["ec_transfer_params"] = build_route(held)
            self.loads.inc(url)
            try:
                answer = await self._post_encoder(url, path, e_body, headers)
            finally:
                self.loads.dec(url)
            return answer if whole else map_back(answer, positions)

        results = await asyncio.gather(*(encode(u, ps) for u, ps in plan.encoders.items()), return_exceptions=True)
        entries: dict[str, Any] = {}
        fallback = []
        for r in results:
            if isinstance(r, BaseException):
                fallback.append(self._fall_back(r, path, "its items"))
            elif isinstance(r, dict):
                entries.update(r)
        if not entries:
            return plan.pd, dict(body, ec_transfer_params=params), "", "; ".join(fallback), "encoder"
        pd_b, media = pd_body(body, dict(entries, **params), self.cfg.pd_media, entries)
        return plan.pd, pd_b, media, "; ".join(fallback), "encoder"

    async def _routing(self, request: web.Request) -> web.Response:
        """What the cache-aware route decided so far, the loads, the index's sources; with
        ``?item=ID``, who the index says holds that item."""
        out: dict[str, Any] = {"route": self.cfg.route, "loads": self.loads.snapshot()}
        if self.router is not None:
            out["decisions"] = dict(self.router.counters)
            out["index_entries"] = len(self.router.index)
            item = request.query.get("item")
            if item:
                out["holders"] = [{"instance": h.instance, "medium": h.medium, "nbytes": h.nbytes}
                                  for h in self.router.index.holders(item)]
        if self._events is not None:
            sub = self._events.subscriber
            out["events"] = {"sources": sub.status(), "counters": dict(sub.counters)}
        return web.json_response(out)

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
        media = ""  # what the PD got for the reported media: "media" or "placeholders" ("": no encoder)
        first = b""
        pd: Optional[aiohttp.ClientResponse] = None  # opened by the overlapped flow, else below
        e_url = next(self._rr["encoder"]) if self.cfg.flow == "overlap" and needs_encoder(body) else None
        route = ""  # cache-aware: "pd-cache" (no encoder call) or "encoder"
        if self.cfg.content_ids:
            body = with_content_ids(body)[0]
        try:
            if self.router is not None and media_parts(body):
                url, body, media, fallback, route = await self._cache_aware(request.path, body, headers)
            elif e_url is not None and e_url in self._producers:
                url, pd, first, fallback = await self._overlapped(request.path, body, headers, e_url,
                                                                  self._producers[e_url])
            elif self.cfg.flow == "push":
                url, body, media = await self._encode_push(request.path, body, headers)
            else:
                if needs_encoder(body):
                    try:
                        # (flow overlap: the first request to each encoder learns its producer)
                        params = await self._encode(request.path, body, headers, e_url)
                    except BackendError as e:
                        fallback = self._fall_back(e, f"{request.method} {request.path}", "it")
                        params = None
                    if params is not None:
                        body, media = pd_body(body, params, self.cfg.pd_media, params)
                url = next(self._rr["pd"])
            t_enc = time.perf_counter() - t0
            if pd is None:
                t = self._timeout(read=self.cfg.pd_timeout_s)
                self.loads.inc(url)
                try:
                    pd = await self._call("pd", url, "POST", request.path, t, json=body, headers=headers)
                except BaseException:
                    self.loads.dec(url)
                    raise
            else:
                self.loads.inc(url)
        except BackendError as e:
            log.warning("%s %s: %s", request.method, request.path, e)
            return e.response()
        try:
            return await self._relay(request, pd, url, first, fallback, media, route, t0, t_enc)
        finally:
            self.loads.dec(url)

    async def _relay(self, request: web.Request, pd: aiohttp.ClientResponse, url: str, first: bytes, fallback: str,
                     media: str, route: str, t0: float, t_enc: float) -> web.StreamResponse:
        """Pass the PD's answer (opened, maybe with its first bytes read) through to the client."""
        async with pd:
            out = web.StreamResponse(status=pd.status)
            out.headers["Content-Type"] = pd.headers.get("Content-Type", "application/json")
            if fallback:
                out.headers["X-EC-Fallback"] = fallback
            if media:
                out.headers["X-EC-PD-Media"] = media
            if route:
                out.headers["X-EC-Route"] = route
            await out.prepare(request)
            try:
                if first:
                    await out.write(first)
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


def _log_late_encoder_failure(task: "asyncio.Future[Any]") -> None:
    """Flow overlap: an encoder that fails after the PD started answering costs nothing more (the
    PD waits ``expect_wait_s``, then encodes the media itself); say so in the log."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("encoder failed after the PD started answering: %s", task.exception())


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
    p.add_argument("--encoder-watch", type=float, default=ProxyConfig.encoder_watch_s,
                   help="while an encoder request runs, ask that encoder's /health this often (s; 0: never)")
    p.add_argument("--encoder-watch-timeout", type=float, default=ProxyConfig.encoder_watch_timeout_s,
                   help="an encoder whose /health does not answer within this (s) is given up on")
    p.add_argument("--no-encoder-fallback", dest="encoder_fallback", action="store_false",
                   help="answer an encoder failure with an error instead of letting the PD encode")
    p.add_argument("--flow", choices=FLOWS, default=ProxyConfig.flow,
                   help="'pull' (default): the PD gets the encoder's answer's ec_transfer_params; 'overlap' "
                        "(NixlECConnector): the PD gets the request while the encoder runs it; 'push' (alias "
                        "'mooncake'): vLLM's EPD protocol as vllm-router speaks it, the encoder is told the "
                        "PD's consumer address (needs --pd-ec-addresses)")
    p.add_argument("--pd-media", choices=PD_MEDIA, default=ProxyConfig.pd_media,
                   help="flows pull and push: 'media' (default): the PD gets the original media parts; "
                        "'placeholders': <modality>_embeds parts with the encoder's metadata and mm_hash, as "
                        "vllm-router sends (no preprocessing on the PD, no local encode if a load fails)")
    p.add_argument("--pd-ec-addresses", type=_urls, default=[],
                   help="flow push: comma-separated consumer control address (tcp://ec_ip:ec_port) of each "
                        "PD, in --pd order")
    p.add_argument("--route", choices=ROUTES, default=ProxyConfig.route,
                   help="'round-robin' (default) or 'cache-aware': each request where its items' embeddings are, "
                        "from the engines' encoder-cache events (flow pull; needs --events)")
    p.add_argument("--events", type=_urls, default=[],
                   help="comma-separated encoder-cache event publishers of the backends (tcp://host:port)")
    p.add_argument("--balance-abs", type=int, default=ProxyConfig.balance_abs,
                   help="cache-aware: in-flight requests a holder may have beyond the least-loaded instance")
    p.add_argument("--balance-rel", type=float, default=ProxyConfig.balance_rel,
                   help="cache-aware: ...and the factor it may exceed it by (both exceeded: least-loaded)")
    p.add_argument("--content-ids", dest="content_ids", action="store_true", default=None,
                   help="give media parts without a uuid one from their content (default with cache-aware)")
    p.add_argument("--no-content-ids", dest="content_ids", action="store_false")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(encoders=a.encoders, pd=a.pd, connect_timeout_s=a.connect_timeout,
                       encode_timeout_s=a.encode_timeout, pd_timeout_s=a.pd_timeout,
                       health_timeout_s=a.health_timeout, encoder_watch_s=a.encoder_watch,
                       encoder_watch_timeout_s=a.encoder_watch_timeout, encoder_fallback=a.encoder_fallback,
                       flow=a.flow, pd_media=a.pd_media, pd_ec_addresses=a.pd_ec_addresses, route=a.route,
                       events=a.events, balance_abs=a.balance_abs, balance_rel=a.balance_rel,
                       content_ids=a.content_ids)


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(a)
    log.info("proxy on http://%s:%d  encoders=%s  pd=%s%s", a.host, a.port, cfg.encoders, cfg.pd,
             f"  flow={cfg.flow}  pd_media={cfg.pd_media}"
             + (f"  pd_ec_addresses={cfg.pd_ec_addresses}" if cfg.flow == "push" else ""))
    web.run_app(Proxy(cfg).app(), host=a.host, port=a.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
