"""Time to first token of streamed multimodal chat requests against one OpenAI-compatible URL.

Point it at a colocated vLLM server or at the disaggregation proxy to compare the two (and one
connector with another) on the same requests:

    python -m ec_nixl.disagg.ttft --url http://127.0.0.1:8000 -n 20 --images 1

Every request carries fresh images (seeded, so runs are repeatable but no request hits an encoder
cache or prefix cache warmed by an earlier one). TTFT is the time from sending the request to the
first streamed chunk that carries a generated token. Prints p50/p90 of TTFT and of the whole request.
The image and request builders are shared with the e2e tests. No vLLM import.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import random
import statistics
import sys
import time
import zlib
from typing import Any, Optional

import aiohttp

# image sizes cycled through by the requests: small to the processor's usual maximum
SIZES = [(96, 80), (56, 56), (112, 84), (150, 120), (80, 120), (64, 100)]


def image_data_url(size: tuple[int, int], seed: int) -> str:
    """A PNG data URL: a colour gradient picked by ``seed``, so each (size, seed) is a distinct image."""
    from PIL import Image

    w, h = size
    r = random.Random(seed)
    c0, c1 = [r.randrange(256) for _ in range(3)], [r.randrange(256) for _ in range(3)]
    img = Image.new("RGB", size)
    img.putdata([tuple(a + (b - a) * (x + y) // (w + h) for a, b in zip(c0, c1, strict=True))
                 for y in range(h) for x in range(w)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(model: str, sizes: list[tuple[int, int]], tag: str, max_tokens: int = 8,
              stream: bool = False) -> dict[str, Any]:
    """A greedy chat request with one image per entry of ``sizes``; ``tag`` picks the images and
    the text (same tag, same request)."""
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_data_url(s, zlib.crc32(f"{tag}/{i}".encode()))}}
        for i, s in enumerate(sizes)
    ]
    parts.append({"type": "text", "text": f"describe {tag}"})
    return {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "stream": stream}


def _has_token(chunk: dict[str, Any]) -> bool:
    for c in chunk.get("choices") or []:
        delta = c.get("delta") or {}
        if c.get("token_ids") or delta.get("content") or c.get("text"):
            return True
    return False


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(TTFT, total) in seconds for one streamed request."""
    t0 = time.perf_counter()
    ttft: Optional[float] = None
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                # vLLM fails a request after the 200 and maybe after some tokens (e.g. when its
                # encoder outputs did not arrive): an error event, then [DONE]. Not a success.
                err = chunk["error"]
                raise RuntimeError(f"stream failed: {err.get('message', err) if isinstance(err, dict) else err}")
            if ttft is None and _has_token(chunk):
                ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("stream ended without a token")
    return ttft, total


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


async def run(url: str, model: Optional[str], n: int, images: int, max_tokens: int, warmup: int,
              seed: int, timeout_s: float) -> dict[str, Any]:
    url = url.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        if model is None:
            async with session.get(url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        ttfts, totals = [], []
        for i in range(warmup + n):
            sizes = [SIZES[(i * images + k) % len(SIZES)] for k in range(images)]
            body = chat_body(model, sizes, f"ttft-{seed}-{i}", max_tokens, stream=True)
            ttft, total = await one_request(session, url, body)
            if i >= warmup:
                ttfts.append(ttft)
                totals.append(total)
    ms = lambda xs, q: round(percentile(xs, q) * 1e3, 1)  # noqa: E731
    return {"url": url, "n": n, "images": images, "max_tokens": max_tokens,
            "ttft_ms": {"p50": ms(ttfts, 50), "p90": ms(ttfts, 90), "mean": round(statistics.mean(ttfts) * 1e3, 1)},
            "total_ms": {"p50": ms(totals, 50), "p90": ms(totals, 90)}}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ec_nixl.disagg.ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server or proxy base URL")
    p.add_argument("--model", help="default: the first model the server lists")
    p.add_argument("-n", type=int, default=20, help="measured requests (sequential)")
    p.add_argument("--images", type=int, default=1, help="images per request")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    p.add_argument("--seed", type=int, default=0, help="changes every image (a rerun with the same seed "
                                                      "against the same servers hits their caches)")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    a = p.parse_args(argv)
    try:
        res = asyncio.run(run(a.url, a.model, a.n, a.images, a.max_tokens, a.warmup, a.seed, a.timeout))
    except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
        print(f"ttft: {a.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(res))
    else:
        t, w = res["ttft_ms"], res["total_ms"]
        print(f"{res['url']}  n={a.n} images={a.images} max_tokens={a.max_tokens}  "
              f"TTFT p50 {t['p50']} ms  p90 {t['p90']} ms  (mean {t['mean']})  |  "
              f"request p50 {w['p50']} ms  p90 {w['p90']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
