"""``ec-nixl bench serve --workload multi-turn|shared-image|reuse``: workloads that send the same
images again, cache-aware routing against round-robin (issue 49).

* ``multi-turn``: conversations of ``--turns`` turns with 1 or 2 images each (alternately); every
  turn sends the whole history with the images again, as chat clients do, and waits for the
  previous answer (its text goes into the history). ``--reuse-concurrency`` conversations at a time.
* ``shared-image``: ``--shared-requests`` requests of one image each, drawn from
  ``--shared-images`` distinct images with Zipf(``--zipf``) popularity (a few hot images).
* ``reuse``: both, one after the other, on each deployment.

Deployments (``serve.deployment``): ``colocated`` (the token reference), ``nixl-rr:ExPD`` (E then
PD, the proxy round-robin: today's) and ``nixl-cache:ExPD`` (the same with the engines' events
and the cache-aware route). Each is started afresh per round and warmed with one image request
per encoder -> PD pair first (by hand: each link's first load pays its handshake). Per workload
and deployment it reports: E encodes per distinct image (the encoders' ``encoded`` counters), the
busiest PD's share of the requests, the share of requests served with no encoder call (the
proxy's ``X-EC-Route``), the PDs' items served from their own caches (prefix or encoder cache) and
misroutes (the engines' counters), TTFT p50/p99 per turn, token ids equal to ``colocated``'s,
and the events' cost: the CPU of each instance's ``ec-nixl-events`` threads and the event
messages the proxy received per request. Cache-aware's TTFT is divided by round-robin's of the
same shape in the same round (the median of rounds is reported).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

WORKLOADS = ("multi-turn", "shared-image", "reuse")
DEFAULT_DEPLOYMENTS = "colocated,nixl-rr:1x2,nixl-cache:1x2,nixl-rr:2x2,nixl-cache:2x2"
IMAGE_SIZES = [(224, 224), (200, 160), (160, 224)]
GOALS = {"encodes_per_image": 1.05, "no_e_share_turns_2_4": 0.90, "ttft_p50_turns_2_4_vs_rr": 0.7}


# ------------------------------------------------------------------------------ workloads


def conversations(n: int, turns: int, seed: int) -> list[dict]:
    """``n`` conversations: the images of each (1 or 2) and its user texts, one per turn."""
    from ec_nixl.disagg.ttft import image_data_url

    out = []
    for c in range(n):
        k = 1 + c % 2
        imgs = [image_data_url(IMAGE_SIZES[(c + j) % len(IMAGE_SIZES)], seed * 100_003 + c * 7 + j) for j in range(k)]
        out.append({"images": imgs, "texts": [f"conversation {c}, turn {t}: what changed?" for t in range(turns)]})
    return out


def shared_requests(n_images: int, n_requests: int, s: float, seed: int) -> list[str]:
    """One image per request, from ``n_images`` with Zipf(``s``) popularity."""
    from ec_nixl.disagg.ttft import image_data_url

    imgs = [image_data_url(IMAGE_SIZES[i % len(IMAGE_SIZES)], seed * 100_003 + 50_000 + i) for i in range(n_images)]
    weights = [1.0 / (k + 1) ** s for k in range(n_images)]
    return random.Random(seed).choices(imgs, weights=weights, k=n_requests)


def _body(model: str, messages: list, max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}


def _user(images: list[str], text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]
            + [{"type": "text", "text": text}]}


async def one(session, url: str, body: dict) -> dict:
    """One streamed request: TTFT, total, token ids, text, the proxy's route, or the error."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"ttft": None, "ids": [], "text": "", "route": "", "error": ""}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            out["route"] = r.headers.get("X-EC-Route", "")
            if r.status != 200:
                out["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
                return out
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = str(chunk["error"])[:200]
                    break
                for c in chunk.get("choices") or []:
                    ids = c.get("token_ids") or []
                    if ids and out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - t0
                    out["ids"] += ids
                    out["text"] += (c.get("delta") or {}).get("content") or ""
    except Exception as e:  # a failed request is counted, never the end of the run
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    out["total"] = time.perf_counter() - t0
    return out


async def _all(tasks) -> None:
    """Run ``tasks(session)`` (coroutines) over one HTTP session."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*tasks(s))


async def run_multi_turn(url: str, model: str, convs: list[dict], conc: int, max_tokens: int) -> list[dict]:
    sem = asyncio.Semaphore(conc)
    rows: list[dict] = []

    async def conversation(session, c: int, conv: dict) -> None:
        async with sem:
            history = [_user(conv["images"], conv["texts"][0])]
            for t in range(len(conv["texts"])):
                if t:
                    history.append({"role": "user", "content": conv["texts"][t]})
                r = await one(session, url, _body(model, history, max_tokens))
                rows.append(dict(r, key=f"c{c}t{t}", turn=t + 1, images=len(conv["images"])))
                history.append({"role": "assistant", "content": r["text"]})

    await _all(lambda s: [conversation(s, c, conv) for c, conv in enumerate(convs)])
    return rows


async def run_shared(url: str, model: str, images: list[str], conc: int, max_tokens: int) -> list[dict]:
    sem = asyncio.Semaphore(conc)
    rows: list[dict] = []

    async def request(session, i: int, img: str) -> None:
        async with sem:
            r = await one(session, url, _body(model, [_user([img], f"request {i}: describe")], max_tokens))
            rows.append(dict(r, key=f"s{i}", turn=1, images=1))

    await _all(lambda s: [request(s, i, img) for i, img in enumerate(images)])
    return rows


# ------------------------------------------------------------------------------ what the engines say


def counters(url: str) -> dict[str, float]:
    """An instance's ``vllm:nixl_ec_num_*_total`` counters, summed over label sets ({} if none)."""
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for m in re.finditer(r"^vllm:nixl_ec_num_(\w+)_total(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    for m in re.finditer(r"^vllm:request_success_total(?:\{[^}]*\})? (\S+)$", text, re.M):
        out["requests_done"] = out.get("requests_done", 0.0) + float(m.group(1))  # (vLLM's own, every reason)
    return out


def routing(proxy: str) -> dict:
    try:
        return json.loads(urllib.request.urlopen(proxy + "/ec-nixl/routing", timeout=10).read())
    except (OSError, ValueError):
        return {}


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _pct(xs: list[float], q: float) -> Optional[float]:
    """Percentile ``q`` with linear interpolation (numpy's default, as vLLM's benchmark reports)."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 3)


def measure(urls: dict, rows: list[dict], distinct: int, wall_s: float, before: dict, after: dict,
            threads: dict[str, float]) -> dict:
    """One workload on one deployment: what ``bench serve`` reports for it (see the module docstring)."""
    ok = [r for r in rows if not r["error"] and r["ttft"] is not None]
    res: dict[str, Any] = {"requests": len(rows), "failed": len(rows) - len(ok), "wall_s": round(wall_s, 2),
                           "distinct_images": distinct}
    for t in sorted({r["turn"] for r in rows}):
        tt = [r["ttft"] * 1e3 for r in ok if r["turn"] == t]
        res[f"ttft_p50_ms_t{t}"] = _pct(tt, 0.5)
        res[f"ttft_p99_ms_t{t}"] = _pct(tt, 0.99)
        res[f"no_e_share_t{t}"] = sum(1 for r in rows if r["turn"] == t and r["route"] == "pd-cache") / \
            max(1, sum(1 for r in rows if r["turn"] == t))
    later = [r for r in rows if r["turn"] >= 2]
    if later:
        res["ttft_p50_ms_later"] = _pct([r["ttft"] * 1e3 for r in ok if r["turn"] >= 2], 0.5)
        res["no_e_share_later"] = sum(1 for r in later if r["route"] == "pd-cache") / len(later)
    res["ttft_p50_ms"] = _pct([r["ttft"] * 1e3 for r in ok], 0.5)
    res["ttft_p99_ms"] = _pct([r["ttft"] * 1e3 for r in ok], 0.99)
    res["no_e_share"] = sum(1 for r in rows if r["route"] == "pd-cache") / max(1, len(rows))
    if urls["encoders"]:
        enc = sum(_delta(after[u], before[u], "encoded") for u in urls["encoders"])
        res["e_encodes"] = enc
        res["e_encodes_per_image"] = round(enc / distinct, 3) if distinct else None
        pds = urls["pds"]
        items = sum(_delta(after[u], before[u], "mm_items") + _delta(after[u], before[u], "mm_kv_hits") for u in pds)
        own = sum(_delta(after[u], before[u], "mm_cache_hits") + _delta(after[u], before[u], "mm_kv_hits") for u in pds)
        res["pd_items"] = items
        res["pd_own_cache_share"] = round(own / items, 3) if items else None
        needed = sum(_delta(after[u], before[u], "mm_items") for u in pds)
        res["pd_encoder_cache_hit_rate"] = round(sum(_delta(after[u], before[u], "mm_cache_hits") for u in pds)
                                                 / needed, 3) if needed else None
        res["pd_local_encodes"] = sum(_delta(after[u], before[u], "encoded") for u in pds)
        served = [_delta(after[u], before[u], "requests_done") for u in pds]
        res["pd_busiest_share"] = round(max(served) / sum(served), 3) if sum(served) else None
        res["misroutes"] = sum(_delta(after[u], before[u], "cache_route_misses") for u in urls["encoders"] + pds)
        ev_b, ev_a = before.get("_events", {}), after.get("_events", {})
        if ev_a:
            res["event_messages_per_request"] = round((ev_a.get("messages", 0) - ev_b.get("messages", 0)) / len(rows), 2)
            res["event_batches_per_request"] = round((ev_a.get("batches", 0) - ev_b.get("batches", 0)) / len(rows), 2)
        events_cpu: dict[str, float] = {}
        for k, v in threads.items():  # "role:process:thread" (a process name may hold colons: VLLM::EngineCore)
            role, thread = k.split(":", 1)[0], k.rsplit(":", 1)[1]
            if thread.startswith("ec-nixl-events"):
                events_cpu[role] = events_cpu.get(role, 0.0) + v
        res["events_cpu_pct"] = {role: round(100 * v / wall_s, 3) for role, v in sorted(events_cpu.items())}
    return res


# ------------------------------------------------------------------------------ the run


def _snapshot(urls: dict) -> dict:
    snap = {u: counters(u) for u in urls["encoders"] + urls["pds"]}
    snap["_events"] = (routing(urls["url"]).get("events") or {}).get("counters", {}) if urls["encoders"] else {}
    return snap


def _warm(urls: dict, model: str, seed: int) -> None:
    """First-use costs off the clock: every encoder -> PD link once (each pair's first load pays
    its NIXL handshake), by hand (E, then that PD with E's params), with images of its own; a
    colocated instance gets one request."""
    from ec_nixl.disagg.ttft import image_data_url

    async def go(s) -> None:
        pairs = [(e, p) for e in urls["encoders"] for p in urls["pds"]] or [(None, urls["url"])]
        for i, (e, p) in enumerate(pairs):
            body = _body(model, [_user([image_data_url((112, 112), seed * 100_003 + 90_000 + i)], "warm up")], 2)
            if e is not None:
                async with s.post(e + "/v1/chat/completions", json=dict(body, stream=False, max_tokens=1)) as r:
                    body["ec_transfer_params"] = (await r.json()).get("ec_transfer_params")
            r = await one(s, p, body)
            if r["error"]:
                raise RuntimeError(f"warm-up request {e} -> {p} failed: {r['error']}")

    asyncio.run(_all(lambda s: [go(s)]))


def run(args, model: str, deps: list[str], vllm_args: list[str], deployment, thread_seconds) -> int:
    """The reuse workloads on ``deps`` (``serve.main`` passes its ``deployment`` and ``thread_seconds``)."""
    workloads = ["multi-turn", "shared-image"] if args.workload == "reuse" else [args.workload]
    print(f"ec-nixl bench serve --workload {args.workload}: {', '.join(deps)} x {args.rounds} rounds; "
          f"{args.conversations} conversations x {args.turns} turns, {args.shared_requests} requests over "
          f"{args.shared_images} images (Zipf {args.zipf}); concurrency {args.reuse_concurrency}; model {model}",
          flush=True)
    results: list[dict] = []
    tokens: dict[tuple[int, str, str], list[int]] = {}
    for rnd in range(args.rounds):
        for i, d in enumerate(deps):
            tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"reuse-r{rnd}-{d}")
            t0 = time.monotonic()
            try:
                with deployment(d, model, args.port + 100 * i, args.out / tag, vllm_args) as urls:
                    _warm(urls, model, rnd)
                    for w in workloads:
                        if w == "multi-turn":
                            convs = conversations(args.conversations, args.turns, seed=rnd + 1)
                            distinct = sum(len(c["images"]) for c in convs)
                            coro = run_multi_turn(urls["url"], model, convs, args.reuse_concurrency, args.output_len)
                        else:
                            imgs = shared_requests(args.shared_images, args.shared_requests, args.zipf, seed=rnd + 1)
                            distinct = len(set(imgs))
                            coro = run_shared(urls["url"], model, imgs, args.reuse_concurrency, args.output_len)
                        before, th0 = _snapshot(urls), thread_seconds(urls["procs"])
                        w0 = time.monotonic()
                        rows = asyncio.run(coro)
                        wall = time.monotonic() - w0
                        time.sleep(1.0)  # (the engines' front-ends record a step's counters just after it)
                        after, th1 = _snapshot(urls), thread_seconds(urls["procs"])
                        res = measure(urls, rows, distinct, wall, before, after,
                                      {k: v - th0.get(k, 0.0) for k, v in th1.items()})
                        for r in rows:
                            tokens[(rnd, w, d, r["key"])] = r["ids"]
                        results.append(dict(res, round=rnd, workload=w, deployment=d))
                        print(f"  {tag} {w}: {json.dumps(res)}", flush=True)
            except Exception as e:  # a deployment that cannot start is reported, the others still run
                print(f"  {tag}: failed to run: {e}", flush=True)
                for w in workloads:
                    results.append({"round": rnd, "workload": w, "deployment": d, "error": str(e)[:300]})
            print(f"  {tag}: {time.monotonic() - t0:.0f} s", flush=True)
    for res in results:  # token ids against colocated's for the same request of the same round
        if "error" in res or res["deployment"] == "colocated":
            continue
        keys = [k for k in tokens if k[:3] == (res["round"], res["workload"], res["deployment"])]
        ref = [tokens.get((k[0], k[1], "colocated", k[3])) for k in keys]
        if any(r is not None for r in ref):
            res["tokens_equal"] = sum(1 for k, r in zip(keys, ref) if r is not None and tokens[k] == r)
            res["tokens_compared"] = sum(1 for r in ref if r is not None)
    summary = summarize(results)
    print()
    print(table(summary))
    print()
    print(goals(summary))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"schema": "ec-nixl-bench-serve-reuse/1", "results": results,
                                               "summary": summary}, indent=1, default=str))
        print(f"wrote {args.json}")
    failed = sum(r.get("failed", 0) for r in results if "error" not in r)
    return 0 if not failed and not any("error" in r for r in results) else 1


def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def summarize(results: list[dict]) -> list[dict]:
    """Per (workload, deployment): medians over rounds; cache-aware's TTFT over round-robin's of the
    same shape, per round, then the median."""
    out = []
    for w in dict.fromkeys(r["workload"] for r in results):
        for d in dict.fromkeys(r["deployment"] for r in results if r["workload"] == w):
            mine = [r for r in results if r["workload"] == w and r["deployment"] == d and "error" not in r]
            s: dict[str, Any] = {"workload": w, "deployment": d, "rounds": len(mine),
                                 "failed": sum(r["failed"] for r in mine), "requests": sum(r["requests"] for r in mine)}
            keys = {k for r in mine for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for k in sorted(keys - {"round", "requests", "failed"}):
                s[k] = _median([r.get(k) for r in mine])
            s["events_cpu_pct"] = {role: _median([r.get("events_cpu_pct", {}).get(role) for r in mine])
                                   for role in sorted({x for r in mine for x in r.get("events_cpu_pct", {})})}
            if "tokens_compared" in keys:
                s["tokens_equal"] = sum(r.get("tokens_equal", 0) for r in mine)
                s["tokens_compared"] = sum(r.get("tokens_compared", 0) for r in mine)
            rr = d.replace("nixl-cache", "nixl-rr")
            if rr != d:
                ratios = {}
                for k in ("ttft_p50_ms_later", "ttft_p50_ms", "ttft_p99_ms"):
                    per = [r[k] / b[k] for r in mine for b in results
                           if b.get("deployment") == rr and b.get("workload") == w and b.get("round") == r["round"]
                           and "error" not in b and r.get(k) and b.get(k)]
                    ratios[k] = _median(per)
                s["vs_rr"] = ratios
            out.append(s)
    return out


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "—" if v is None else fmt.format(v)


def table(summary: list[dict]) -> str:
    turns = sorted({int(k.rsplit("t", 1)[1]) for s in summary for k in s if k.startswith("ttft_p50_ms_t")})
    head = ["workload", "deployment", "E encodes / image", "no E call", "PD own-cache share", "PD enc-cache hits",
            "busiest PD", "misroutes", "failed"] + [f"TTFT p50/p99 t{t} ms" for t in turns] + \
        ["p50 t2-4 ÷ rr", "tokens = colocated", "events CPU % (max inst)", "event msgs / req"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        cpu = max(s.get("events_cpu_pct", {}).values(), default=None)
        row = [s["workload"], s["deployment"], _f(s.get("e_encodes_per_image"), "{:.2f}"),
               _f(s.get("no_e_share"), "{:.0%}") if s["deployment"] != "colocated" else "—",
               _f(s.get("pd_own_cache_share"), "{:.0%}"), _f(s.get("pd_encoder_cache_hit_rate"), "{:.0%}"),
               _f(s.get("pd_busiest_share"), "{:.0%}"), _f(s.get("misroutes"), "{:.0f}"),
               f"{s['failed']} of {s['requests']}"]
        row += [f"{_f(s.get(f'ttft_p50_ms_t{t}'))} / {_f(s.get(f'ttft_p99_ms_t{t}'))}" for t in turns]
        row += [_f((s.get("vs_rr") or {}).get("ttft_p50_ms_later"), "{:.2f}"),
                f"{s['tokens_equal']} of {s['tokens_compared']}" if "tokens_compared" in s else "—",
                _f(cpu, "{:.2f}"), _f(s.get("event_messages_per_request"), "{:.2f}")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def goals(summary: list[dict]) -> str:
    """Issue 49's goals that this run measures, each against its target."""
    out = ["goals (multi-turn, cache-aware):"]
    for s in summary:
        if s["workload"] != "multi-turn" or "nixl-cache" not in s["deployment"]:
            continue
        e = s.get("e_encodes_per_image")
        share = s.get("no_e_share_later")
        ratio = (s.get("vs_rr") or {}).get("ttft_p50_ms_later")
        checks = [("E encodes per distinct image", e, GOALS["encodes_per_image"], "<="),
                  ("turns 2-4 with no E call", share, GOALS["no_e_share_turns_2_4"], ">="),
                  ("TTFT p50 turns 2-4 / round-robin's", ratio, GOALS["ttft_p50_turns_2_4_vs_rr"], "<=")]
        for name, v, target, op in checks:
            met = v is not None and (v <= target if op == "<=" else v >= target)
            out.append(f"  {s['deployment']}: {name} {_f(v, '{:.3f}')} (target {op} {target}): "
                       f"{'met' if met else 'MISSED'}")
        if "tokens_compared" in s:
            out.append(f"  {s['deployment']}: tokens equal to colocated {s['tokens_equal']} of "
                       f"{s['tokens_compared']}, failed {s['failed']}")
    return "\n".join(out)
