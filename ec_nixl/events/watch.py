"""``ec-nixl events``: the reference subscriber on the command line.

    ec-nixl events tcp://127.0.0.1:16600 tcp://127.0.0.1:16602     # follow: one line per change
    ec-nixl events --dump 127.0.0.1:16600 127.0.0.1:16608           # the merged index, as JSON

Each endpoint is a publisher's PUB socket (its replay socket is on the next port). Following
prints every change as it is applied (``+`` stored, ``-`` removed, ``x`` medium cleared) and every
recovery step (snapshot, gap, restart, instance lost); ``--json`` prints JSON lines instead.
``--dump`` waits until every publisher is in sync (a snapshot, then what followed it) and prints
``{instance: {medium: [mm_hash, ...]}}``; it exits 1, naming them, when some are not within
``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional

from ec_nixl.errors import ConfigError
from ec_nixl.events import schema as S
from ec_nixl.events.subscriber import Source, Subscriber, parse_source


def _line(kind: str, source: Source, detail: Any, as_json: bool) -> list[str]:
    now = time.strftime("%H:%M:%S")
    if kind == "batch":
        seq, batch = detail
        out = []
        for ev in batch.events:
            if as_json:
                out.append(json.dumps({"seq": seq, "instance": batch.instance, "event": type(ev).__name__,
                                       **{f: getattr(ev, f) for f in ev.__struct_fields__}}))
            elif isinstance(ev, S.EncoderItemStored):
                out.append(f"{now} {batch.instance} {ev.medium} + {ev.mm_hash} ({ev.modality}, {ev.nbytes} B)")
            elif isinstance(ev, S.EncoderItemRemoved):
                out.append(f"{now} {batch.instance} {ev.medium} - {ev.mm_hash}")
            else:
                out.append(f"{now} {batch.instance} {ev.medium} x (cleared)")
        return out
    if kind == "snapshot":
        text = f"snapshot at seq {detail.seq}: {len(detail.entries)} item(s) of {detail.instance}"
    elif kind == "gap":
        text = f"gap after seq {detail[0]} (saw {detail[1]}): replaying"
    elif kind == "reset":
        text = f"publisher restarted (seq {detail}): its entries dropped, asking for a snapshot"
    elif kind == "lost":
        text = f"silent too long: its {detail} entries dropped"
    else:
        text = f"{kind}: {detail}"
    if as_json:
        return [json.dumps({"source": source.endpoint, "note": kind, "text": text})]
    return [f"{now} [{source.endpoint}] {text}"]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ec-nixl events", description=__doc__.split("\n\n")[0])
    ap.add_argument("endpoints", nargs="+", help="publishers' PUB addresses, tcp://host:port or host:port")
    ap.add_argument("--dump", action="store_true", help="print the merged index once in sync, then exit")
    ap.add_argument("--json", action="store_true", help="follow: one JSON object per line")
    ap.add_argument("--timeout", type=float, default=10.0, help="--dump: longest wait for every publisher (s)")
    ap.add_argument("--dead-after", type=float, default=3.0, help="drop a publisher silent this long (s)")
    ap.add_argument("--topic", default="", help="subscribe to this topic prefix only")
    ap.add_argument("--max-events", type=int, default=0, help="follow: exit after this many changes (0: never)")
    a = ap.parse_args(argv)
    try:
        sources = [parse_source(e) for e in a.endpoints]
    except ConfigError as e:
        print(f"ec-nixl events: {e}", file=sys.stderr)
        return 2
    seen = [0]

    def show(kind: str, source: Source, detail: Any) -> None:
        if a.dump:
            return
        for line in _line(kind, source, detail, a.json):
            print(line, flush=True)
        if kind == "batch":
            seen[0] += len(detail[1].events)

    sub = Subscriber(sources, topic=a.topic, dead_after_s=a.dead_after, listener=show)
    try:
        if a.dump:
            deadline = time.monotonic() + a.timeout
            while not sub.synced() and time.monotonic() < deadline:
                sub.poll(0.05)
            if not sub.synced():
                late = [s["endpoint"] for s in sub.status() if s["state"] != "live"]
                print(f"ec-nixl events: not in sync after {a.timeout:g}s: {', '.join(late)}", file=sys.stderr)
                return 1
            print(json.dumps(sub.index.dump(), indent=1))
            return 0
        while not a.max_events or seen[0] < a.max_events:
            sub.poll(0.25)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        sub.close()
