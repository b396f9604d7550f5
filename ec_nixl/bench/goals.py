"""The project's goals as ratios of numbers measured in the same run: reported, never asserted.

Each line names the goal, the measured ratio with the two numbers it comes from, and met/MISSED;
a goal this run cannot judge says ``n/a`` and why (a path skipped, a size not run), and a goal set
for another device than the one measured says ``n/a here`` with the device it is for.
The goals come from the issues: 10/11 (the hot path at the physical limit: vs the CUDA-IPC copy,
vs plain NIXL, batch throughput, step-side cost), 12 (idle cost, the CPU data path) and 25 (on
the H200: a step at copy-engine speed, each direction's own cost over plain NIXL, publish ->
landed within a few copies).
"""

from __future__ import annotations

from typing import Optional

from ec_nixl.bench.units import fmt_us, human, parse_size

QWEN = parse_size("9.8M").nbytes

# The device each goal was set for. The issues set the hot-path targets on one H200 (ratios to the
# CUDA-IPC copy, to VRAM bandwidth, to a disk or a host bounce, which mean nothing on DRAM) and
# the data-path target for CPU hosts; the connector's own cost over plain NIXL, the barrier and
# the idle cost are judged wherever the bench runs. A goal for another device than the one
# measured prints its number and "n/a here": a CPU run does not fail an H200 target.
H200, CPU, ANY = "cuda", "cpu", None
_FOR_NAME = {H200: "an H200 goal", CPU: "a CPU goal"}


class _Lines:
    def __init__(self, device: str):
        self.device = device
        self.out: list[str] = []

    def add(self, name: str, value: Optional[str], goal: str = "", met: bool = False, detail: str = "",
            device: Optional[str] = ANY) -> None:
        """One goal line; ``device`` is the device the goal is for (ANY: judged on every run)."""
        elsewhere = device is not None and device != self.device
        here = f"n/a here ({_FOR_NAME[device]}; this run is on {self.device})" if elsewhere else ""
        if value is None:
            s = f"  {name}: {here or 'n/a'}" + (f" ({detail})" if detail and not elsewhere else "")
        elif elsewhere:
            s = f"  {name}: {value} — goal {goal}: {here}"
        else:
            s = f"  {name}: {value} — goal {goal}: {'met' if met else 'MISSED'}" + (f" ({detail})" if detail else "")
        self.out.append(s)
        print(s)


def print_goals(state: dict, cfg: dict) -> list[str]:
    rows = state["rows"]
    by = {(r["path"], r["bytes"], r["items"]): r for r in rows}
    gpu = cfg["device"] == "cuda"
    out = _Lines(cfg["device"])

    def best_ours(nbytes: int, items: int):
        cands = [by.get((p, nbytes, items)) for p in ("ours-read", "ours-write")]
        return min((c for c in cands if c), key=lambda r: r["p50_us"], default=None)

    print(f"\nGoals (measured in this run, on {cfg['device']}; reported, never asserted):")
    o, ref = best_ours(QWEN, 1), by.get(("reference-copy", QWEN, 1))
    _near_reference(out, "9.8 MB post->barrier vs reference-copy", o, ref, f"{o['path']} " if o else "",
                    "needs 9.8M, ours-* and reference-copy")
    for nbytes in (QWEN, 64 << 20):
        _vs_raw(out, by, nbytes, state["skipped"])
    for ours, raw, limit in (("ours-read", "raw-nixl-read", 1.3), ("ours-write", "raw-nixl-write", 1.5)):
        o1, r1 = by.get((ours, QWEN, 1)), by.get((raw, QWEN, 1))
        name = f"9.8 MB {ours} vs {raw}"
        if o1 and r1:
            x = o1["p50_us"] / r1["p50_us"]
            out.add(name, f"{x:.2f}x ({fmt_us(o1['p50_us'])} vs {fmt_us(r1['p50_us'])})", f"<= {limit}x", x <= limit,
                    "" if x <= limit else f"over by {(x / limit - 1) * 100:.0f}%", device=H200)
        else:
            out.add(name, None, detail=f"needs 9.8M, {ours} and {raw}", device=H200)
    _batch(out, rows, by, state.get("copybw"), gpu, best_ours)
    for path, goal in (("host-bounce", 30.0), ("file", 120.0)):
        p = by.get((path, QWEN, 1))
        if o and p:
            x = p["p50_us"] / o["p50_us"]
            out.add(f"9.8 MB vs {path}", f"{x:.1f}x lower ({fmt_us(o['p50_us'])} vs {fmt_us(p['p50_us'])})",
                    f">= {goal:.0f}x lower", x >= goal, "" if x >= goal else f"short by {(1 - x / goal) * 100:.0f}%",
                    device=H200)
        else:
            out.add(f"9.8 MB vs {path}", None, detail=state["skipped"].get(path, "not measured"), device=H200)
    n16 = parse_size("16M").nbytes
    o16, r16 = best_ours(n16, 1), by.get(("reference-copy", n16, 1))
    if not gpu and o16 and r16:
        x = o16["gbps"] / r16["gbps"]
        out.add("CPU 16 MiB across processes vs single-threaded memcpy", f"{x:.2f}x ({o16['path']} "
                f"{o16['gbps']:.2f} GB/s vs memcpy {r16['gbps']:.2f} GB/s)", ">= 0.8x", x >= 0.8,
                "" if x >= 0.8 else f"short by {(1 - x / 0.8) * 100:.0f}%", device=CPU)
    else:
        out.add("CPU 16 MiB across processes vs single-threaded memcpy", None,
                detail="needs 16M among the sizes, ours-* and reference-copy", device=CPU)
    for b in sorted((b for b in rows if b["path"] == "barrier-landed"), key=lambda b: b["items"]):
        # One item: the barrier's own cost (p50). A step's items: what prefetched loads add to the
        # scheduled step (issue 11: p99).
        q, v = ("p50", b["p50_us"]) if b["items"] == 1 else ("p99", b["p99_us"])
        out.add(f"barrier pass, {b['items']} landed item(s)", f"{b['p50_us']:.1f} us (p99 {b['p99_us']:.1f} us)",
                f"{q} <= 50 us", v <= 50, "" if v <= 50 else f"{q} over by {v - 50:.1f} us", device=ANY)
    _near_reference(out, "9.8 MB publish->landed vs reference-copy", by.get(("publish-landed", QWEN, 1)), ref, "",
                    state["skipped"].get("publish-landed", "needs 9.8M, publish-landed and reference-copy"), limit=4.0)
    _idle(out, state.get("cpu") or {})
    return out.out


def _near_reference(out: _Lines, name: str, row: Optional[dict], ref: Optional[dict], label: str,
                    missing: str, limit: float = 1.25) -> None:
    """``row`` within ``limit`` x the reference copy's p50 (the CUDA-IPC copy on an H200: issue 11
    asks 1.25x of a load, issue 25 4x of publish -> landed), or n/a with ``missing``."""
    if not (row and ref):
        out.add(name, None, detail=missing, device=H200)
        return
    x = row["p50_us"] / ref["p50_us"]
    out.add(name, f"{x:.2f}x ({label}{fmt_us(row['p50_us'])} vs {fmt_us(ref['p50_us'])})", f"<= {limit:g}x",
            x <= limit, "" if x <= limit else f"over by {(x / limit - 1) * 100:.0f}%", device=H200)


def _vs_raw(out: _Lines, by: dict, nbytes: int, skipped: dict) -> None:
    """ours ÷ raw-nixl in each direction at one size (issue 11: <= 1.1x); judged on the better one,
    since a link uses one direction (the handshake's link probe picks it)."""
    name = f"{human(nbytes) if nbytes != QWEN else '9.8 MB'} ours vs raw-nixl (connector's own cost)"
    parts, best = [], None
    for ours, raw in (("ours-read", "raw-nixl-read"), ("ours-write", "raw-nixl-write")):
        o, r = by.get((ours, nbytes, 1)), by.get((raw, nbytes, 1))
        if o and r:
            x = o["p50_us"] / r["p50_us"]
            parts.append(f"{ours.split('-')[1]} {x:.2f}x ({fmt_us(o['p50_us'])} vs {fmt_us(r['p50_us'])})")
            best = x if best is None else min(best, x)
    if best is None:
        why = skipped.get("raw-nixl-read") or skipped.get("raw-nixl-write") or "needs the size, ours-* and raw-nixl-*"
        out.add(name, None, detail=why, device=ANY)
    else:
        out.add(name, ", ".join(parts), "<= 1.1x (best direction)", best <= 1.1,
                "" if best <= 1.1 else f"over by {(best / 1.1 - 1) * 100:.0f}%", device=ANY)


def _batch(out: _Lines, rows: list, by: dict, cb: Optional[dict], gpu: bool, best_ours) -> None:
    """A step of many items: against the in-process copy bandwidth (>= 85%, issue 25; issue 10 had
    asked 70%, when one descriptor per item capped plain NIXL at ~64%) and the cross-process
    reference copy of the same step (>= 1.0x its throughput, issue 10); targets for VRAM."""
    items = max([r["items"] for r in rows if r["items"] > 1] or [0])
    ob = None
    if items:
        nbytes = next((r["bytes"] for r in rows if r["items"] == items and r["path"].startswith("ours")), 0)
        ob = best_ours(nbytes, items)
    if not ob:
        out.add("batch per step vs copy bandwidth", None, detail="needs a batch case with ours-*", device=H200)
        return
    step = f"{items}x{human(ob['bytes'] // items)} per step"
    if cb:
        frac = ob["gbps"] / cb["gbps"]
        out.add(f"{step} vs {'D2D copy' if gpu else 'memcpy'} bandwidth", f"{frac * 100:.0f}% ({ob['path']} "
                f"{ob['gbps']:.1f} GB/s vs {cb['gbps']:.1f} GB/s)", ">= 85%", frac >= 0.85,
                "" if frac >= 0.85 else f"short by {(0.85 - frac) * 100:.0f} points", device=H200)
    rb = by.get(("reference-copy", ob["bytes"], items))
    if rb:
        x = ob["gbps"] / rb["gbps"]
        out.add(f"{step} vs reference-copy throughput", f"{x:.2f}x ({ob['path']} {ob['gbps']:.1f} GB/s vs "
                f"{rb['gbps']:.1f} GB/s)", ">= 1.0x", x >= 1.0, "" if x >= 1.0 else f"short by {(1 - x) * 100:.0f}%",
                device=H200)
    else:
        out.add(f"{step} vs reference-copy throughput", None, detail="reference-copy not measured", device=H200)


def _idle(out: _Lines, cpu: dict) -> None:
    """Issue 12: an idle, handshaken pair costs <= 2 % of one core per process."""
    idle = cpu.get("idle")
    if not idle:
        out.add("idle CPU per process", None, detail=cpu.get("idle_skipped", "not measured (--idle-s 0)"), device=ANY)
        return
    cores = idle["cores"]
    worst = max(cores.values())
    out.add("idle CPU per process", ", ".join(f"{k} {v * 100:.1f}%" for k, v in cores.items()) +
            f" of one core over {idle['wall_s']:.1f} s", "<= 2% of one core", worst <= 0.02,
            "" if worst <= 0.02 else f"worst {worst / 0.02:.0f}x the goal", device=ANY)
