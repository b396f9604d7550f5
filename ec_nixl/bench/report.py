"""What a run prints and writes: the table, the idle-cost table, the goal lines, JSON and a plot.

The table has one row per (path, item size, items per step), with two ratios measured in the
same run: ``x ref`` = p50 / reference-copy p50 (against the physical copy) and ``x raw`` =
p50 / raw-nixl p50 of the same direction (the connector's own cost over plain NIXL).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from typing import Optional

from ec_nixl.bench import goals
from ec_nixl.bench.paths import ALL_PATHS
from ec_nixl.bench.units import SCHEMA, fmt_us, human

# The raw-nixl row each path is compared with in the 'x raw' column (same direction).
RAW_OF = {"ours-read": "raw-nixl-read", "ours-write": "raw-nixl-write", "staged-write": "raw-nixl-write",
          "raw-nixl-read": "raw-nixl-read", "raw-nixl-write": "raw-nixl-write"}


def report(state: dict, cfg: dict, args) -> None:
    rows, env = state["rows"], state["env"]
    print()
    print(f"ec-nixl bench — {env.get('gpu') or 'CPU'} — device={cfg['device']} torch {env.get('torch', '?')} "
          f"nixl {env.get('nixl', '?')} — {datetime.datetime.now().isoformat(timespec='seconds')}")
    l0, l1 = state.get("load", ("?", "?"))
    print(f"{os.cpu_count()} CPUs; load average (1/5/15 min) at start {l0}, at end {l1} — other work on this "
          f"host inflates tails and small-item latencies")
    if env.get("producer"):
        print(f"across hosts: producer at {env['producer']}, consumer here ({socket.gethostname()}); "
              f"'x raw' is ours / plain NIXL over the same link")
    table(rows)
    descs = [f"{r['path']} {r['label']} x{r['items']}: {r['descs_per_request']:.1f}" for r in rows
             if r.get("descs_per_request") is not None and r["items"] > 1]
    if descs:
        print("NIXL descriptors per READ request (NIXL telemetry; contiguous blocks merge into one): "
              + ", ".join(descs))
    for p, why in state["skipped"].items():
        print(f"{p}: skipped: {why}")
    cb = state.get("copybw")
    if cb:
        print(f"copy bandwidth ({cb['kind']}, {human(cb['bytes'])} in one process): {cb['gbps']:.1f} GB/s "
              f"({fmt_us(cb['us'])})")
    ps = state.get("prodstats")
    if ps:
        print(f"producer: {ps['published']} items published, {ps['staging_copies']} staging copies "
              f"(staged-write only), {ps['left_bytes']} B left in its pools after the run")
    if "raw_params" in env:
        on = [k for k, v in (env.get("raw_threads") or {}).items() if v]
        print(f"raw-nixl agents: UCX backend parameters {env['raw_params'] or '{}'} "
              f"({'NIXL progress thread: ' + ', '.join(on) if on else 'no progress thread'})")
    if "host-bounce" in cfg["paths"] and cfg["device"] == "cuda" and not env.get("pinned", True):
        print("note: host buffers could not be pinned (cudaHostRegister failed): host-bounce used pageable DRAM")
    print("(sizes are per item; 'x ref' = p50 / reference-copy p50 and 'x raw' = p50 / raw-nixl p50 of the same "
          "direction, at the same size and items; staged paths add the producer's stage time to the consumer's "
          "per sample; raw-nixl-* move data only (no notification), raw-nixl-write timed on the producer's clock)")
    cpu_table(state.get("cpu") or {})
    lines = goals.print_goals(state, cfg)
    save(state, cfg, args, lines)


def save(state: dict, cfg: dict, args, goal_lines: list) -> None:
    """Write the files the options ask for: the explicit ``--json``/``--plot`` paths, or both into
    ``args.out`` (the default folder, made only now, so a run that measured nothing leaves none)."""
    from ec_nixl.bench import plot

    folder = getattr(args, "out", None)
    if folder:
        folder = _fresh(folder, named=not getattr(args, "out_default", False))
        jpath, ppath = os.path.join(folder, "results.json"), os.path.join(folder, "results.png")
    else:
        jpath, ppath = args.json, args.plot
    wrote = []
    if jpath:
        write_json(jpath, state, cfg, goal_lines)
        wrote.append(jpath)
    if ppath and plot.plot(ppath, state["rows"], cfg, state["env"]):
        wrote.append(ppath)
    if folder and wrote:
        print(f"wrote {' and '.join(os.path.basename(w) for w in wrote)} to {os.path.abspath(folder)}")
    else:
        for w in wrote:
            print(f"wrote {w}")


def _fresh(folder: str, named: bool) -> str:
    """Make ``folder``; a default one that exists already (a run started in the same second) becomes
    ``folder-2``, ``-3``..., so two runs never mix their files. A folder the user named is reused."""
    base, n = folder, 1
    while not named and os.path.exists(folder):
        n += 1
        folder = f"{base}-{n}"
    os.makedirs(folder, exist_ok=True)
    return folder


def table(rows: list) -> None:
    by = {(r["path"], r["bytes"], r["items"]): r for r in rows}
    cols = (f"{'path':<15} {'size':>9} {'items':>5} {'bytes/op':>10} {'p50':>10} {'p99':>10} {'GB/s':>8} "
            f"{'x ref':>7} {'x raw':>7} {'n':>4}")
    print(cols)
    print("-" * len(cols))
    last = None
    for r in sorted(rows, key=lambda r: (r["path"] == "barrier-landed", r["items"], r["bytes"],
                                         ALL_PATHS.index(r["path"]) if r["path"] in ALL_PATHS else 99)):
        k = (r["bytes"], r["items"])
        if last is not None and k != last:
            print()
        last = k
        landed = r["path"] == "barrier-landed"
        print(f"{r['path']:<15} {r['label']:>9} {r['items']:>5} {human(r['bytes']):>10} {fmt_us(r['p50_us']):>10} "
              f"{fmt_us(r['p99_us']):>10} {'' if landed else format(r['gbps'], '.2f'):>8} "
              f"{_ratio(r, by.get(('reference-copy', *k))) if not landed else '':>7} "
              f"{_ratio(r, by.get((RAW_OF.get(r['path']), *k))):>7} {r['n']:>4}")


def _ratio(r: dict, base) -> str:
    return f"{r['p50_us'] / base['p50_us']:.2f}x" if base and base["p50_us"] > 0 else ""


def cpu_table(cpu: dict) -> None:
    """CPU seconds per wall second of each bench process, idle and under load."""
    if "idle_skipped" in cpu:
        print(f"idle cost: skipped: {cpu['idle_skipped']}")
    idle, loaded = cpu.get("idle"), cpu.get("loaded")
    if not idle and not loaded:
        return
    print(f"\nCPU cost, cores = CPU seconds per wall second of the whole process, all threads "
          f"({cpu.get('source', '?')}):")
    head_i = f"idle {idle['wall_s']:.1f} s after the handshake" if idle else "idle: not measured"
    head_l = f"under load (ours-* cases, {loaded['wall_s']:.1f} s)" if loaded else "under load: not measured"
    print(f"{'process':<10} {head_i:>36} {head_l:>36}")
    for who in ("producer", "consumer"):
        i = f"{idle['cores'][who]:.3f}" if idle else "-"
        ld = f"{loaded['cores'][who]:.3f}" if loaded else "-"
        print(f"{who:<10} {i:>36} {ld:>36}")


def write_json(path: str, state: dict, cfg: dict, goal_lines: Optional[list] = None) -> None:
    env = state["env"]
    doc = {
        "schema": SCHEMA,
        "device": env.get("gpu") or ("cpu" if cfg["device"] == "cpu" else cfg["device"]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "results": [{"path": r["path"], "bytes": int(r["bytes"]), "items": int(r["items"]),
                     "p50_us": float(r["p50_us"]), "p99_us": float(r["p99_us"]), "gbps": float(r["gbps"]),
                     **({"descs_per_request": r["descs_per_request"]} if "descs_per_request" in r else {})}
                    for r in state["rows"]],
        "cpu": state.get("cpu") or {},  # added in place of a schema bump: readers of /1 ignore it
        "skipped": state["skipped"],
        "load": state.get("load"),
        "producer": env.get("producer"),  # across hosts: where the producer ran (else None)
        "goals": [g.strip() for g in goal_lines or []],  # as printed, so a saved run keeps its verdicts
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
