"""The ``ec-nixl bench`` command: its options, the plan they make, and the run.

``main`` parses the options into a *plan* (a plain dict both peer processes receive: device,
paths, cases, pool size, repeats, idle window), hands it to the orchestrator and prints the report. Unless told otherwise (``--json``/``--plot``,
``--no-save``) it also leaves results.json and results.png in a fresh ``ec-nixl-bench-<time>``
folder, so a first run has a picture to look at.
Exit status: 0 when the run finished (skipped paths included), 1 when it failed or was stopped
(what was measured is still reported), 2 on bad options.

``ec-nixl bench producer ...`` is the producer side alone, for a consumer on another host
(``--producer HOST:PORT`` there); see ``remote``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Optional

from ec_nixl.bench import orchestrator, proc, report
from ec_nixl.bench.paths import ALL_PATHS
from ec_nixl.bench.units import BLOCK, CPU_GOAL_SIZE, DEFAULT_SIZES, PROBE_BYTES, QUICK_SIZES, blocks, human, parse_size

STEPS_PER_CHUNK = 4
"""Steps a default pool holds, so that most timed steps follow another one (see ``plan``)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ec-nixl bench",
        description="Time ec-nixl's data plane (post -> barrier passed) against the physical reference, plain NIXL "
                    "and the other EC connectors' data paths, between two processes on this machine, or against "
                    "`ec-nixl bench producer` on another host (--producer).",
        epilog="Across hosts: `ec-nixl bench producer --listen 0.0.0.0:15700` on the Encode host, then "
               "`ec-nixl bench --producer ENCODE_HOST:15700 ...` here (`ec-nixl bench producer --help`).")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where pools and items live (default: cuda if available, else cpu)")
    p.add_argument("--sizes", default=None,
                   help=f"item sizes, comma list (default {DEFAULT_SIZES}, --quick {QUICK_SIZES}; 9.8M = 1369x3584 "
                        f"bf16; a CPU run adds {CPU_GOAL_SIZE} for the CPU goal)")
    p.add_argument("--items", type=int, default=None, help="items per step of the batch case (default 32; 0: none)")
    p.add_argument("--batch-size", default="9.8M", help="item size of the batch case (default 9.8M)")
    p.add_argument("--repeats", type=int, default=None, help="most timed repeats per case (default 50)")
    p.add_argument("--min-repeats", type=int, default=None, help="fewest timed repeats per case (default 5)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds aimed at per case; repeats adapt between --min-repeats and --repeats (default 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed operations first, per case (default 3)")
    p.add_argument("--paths", default=",".join(ALL_PATHS), help=f"comma list of {', '.join(ALL_PATHS)}")
    p.add_argument("--pool-bytes", default=None,
                   help="pool size per endpoint (default: room for 4 steps, or 4 of the largest item)")
    p.add_argument("--idle-s", type=float, default=None,
                   help="idle window after the handshake, for the CPU cost of an idle pair (default 10, --quick 3; "
                        "0: none)")
    p.add_argument("--quick", action="store_true", help="a short run (fewer sizes and repeats)")
    p.add_argument("--nixl-progress-thread", choices=("auto", "on", "off"), default="auto",
                   help="NIXL's own (spinning) progress thread: auto = on for the producer only")
    p.add_argument("--backend-params", default=None, metavar="JSON",
                   help='NIXL UCX backend parameters for every endpoint, e.g. \'{"ucx_error_handling_mode":"none"}\'')
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for results.json and results.png when neither --json nor --plot is given "
                        "(default: ./ec-nixl-bench-YYYYmmdd-HHMMSS, named when the run starts)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write results as JSON (schema ec-nixl-bench/1) here, and nothing into --out")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a latency-vs-size PNG (needs matplotlib) here, and nothing into --out")
    p.add_argument("--no-save", action="store_true", help="write no file (the table and goals are only printed)")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up (killing both processes) after this many s")
    p.add_argument("--check", choices=("ends", "full"), default="ends",
                   help="what of each timed item is compared with what the producer wrote: its first and last "
                        "8 bytes (default), or all of it (a digest per item, untimed; for tests)")
    p.add_argument("--producer", default=None, metavar="HOST:PORT",
                   help="run the consumer side only, against `ec-nixl bench producer` at HOST:PORT (another host); "
                        "paths that need one host (reference-copy, file, publish-landed, expect-landed, expect-write, ucx) are "
                        "skipped")
    return p


def plan(args) -> dict:
    """The run's plan from the options; raises ValueError (bad sizes) or SystemExit (bad setup)."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ec-nixl bench: --device cuda but torch sees no CUDA device")
    q = args.quick
    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if q else DEFAULT_SIZES)).split(",") if s.strip()]
    notes = []
    if device == "cpu" and args.sizes is None:
        goal = parse_size(CPU_GOAL_SIZE)
        if all(s.nbytes != goal.nbytes for s in sizes):
            sizes.append(goal)
            notes.append(f"added {CPU_GOAL_SIZE} (the CPU goal's size) to the default sizes")
    sizes.sort(key=lambda s: s.nbytes)
    items = args.items if args.items is not None else (8 if q else 32)
    bspec = parse_size(args.batch_size)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in ALL_PATHS]
    if bad:
        raise SystemExit(f"ec-nixl bench: unknown path(s) {bad}; known: {', '.join(ALL_PATHS)}")
    cases = [((s.nbytes, s.shape, s.dtype, s.label), 1) for s in sizes]
    if items > 1:
        cases.append(((bspec.nbytes, bspec.shape, bspec.dtype, bspec.label), items))
    # Room for STEPS_PER_CHUNK steps (or 4 of the largest item): a chunk's operations run back to
    # back, but its first one follows the producer's making of the items and a Hold round trip,
    # with this process asleep in between. On the H200 host that first 32-item step ran ~170 us
    # slower (440 vs 270 us, bench/probes/hotpath.py --batch 1 vs 10, 2026-12-05): with room for
    # 2 steps, half of ours-read's samples were such first ones and its p50 was 1.3-1.5x the
    # probe's, while raw-nixl (little host work per operation) hardly paid it.
    largest = max([blocks(s.nbytes) * BLOCK * 4 for s in sizes]
                  + [blocks(bspec.nbytes) * BLOCK * max(items, 1) * STEPS_PER_CHUNK])
    pool = parse_size(args.pool_bytes).nbytes if args.pool_bytes else largest + PROBE_BYTES + BLOCK
    pool = -(-pool // BLOCK) * BLOCK
    need = max([blocks(s.nbytes) * BLOCK for s in sizes] + [blocks(bspec.nbytes) * BLOCK * max(items, 1)])
    if pool - PROBE_BYTES - BLOCK < need:
        raise SystemExit(f"ec-nixl bench: --pool-bytes {pool} cannot hold one step of {need} B")
    idle_s = args.idle_s if args.idle_s is not None else (3.0 if q else 10.0)
    return {
        "device": device,
        "paths": paths,
        "cases": cases,
        "pool_bytes": pool,
        "src_bytes": pool,
        "repeats": args.repeats if args.repeats is not None else (20 if q else 50),
        "min_repeats": args.min_repeats if args.min_repeats is not None else (3 if q else 5),
        "budget_s": args.budget_s if args.budget_s is not None else (0.3 if q else 2.0),
        "warmup": max(1, args.warmup if args.warmup is not None else (2 if q else 3)),
        "barrier": ((bspec.nbytes, bspec.shape, bspec.dtype, bspec.label), max(items, 1))
        if "ours-read" in paths else None,
        "copy_bw_bytes": max(blocks(bspec.nbytes) * BLOCK * max(items, 1), 64 << 20),
        "idle_s": max(0.0, idle_s),
        "idle_timeout_s": 300.0 + max(0.0, idle_s),
        "notes": notes,
        "backend_params": json.loads(args.backend_params) if args.backend_params else {},
        "nixl_progress_thread": {"on": True, "off": False}.get(args.nixl_progress_thread),
        "producer": args.producer,
        "check": args.check,
    }


def out_folder(args) -> Optional[str]:
    """The folder the default run writes into, or None when the user chose files (or none).

    A plain ``ec-nixl bench`` leaves its JSON and PNG behind so that a first run has a picture to
    look at; explicit ``--json``/``--plot`` keep meaning "exactly these files" (scripts and tests
    rely on nothing else appearing in their working directory)."""
    if args.no_save or args.json or args.plot:
        return None
    if args.out:
        return args.out
    return f"ec-nixl-bench-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["producer"]:
        from ec_nixl.bench import remote

        return remote.producer_main(argv[1:])
    args = parser().parse_args(argv)
    if args.no_save and (args.json or args.plot or args.out):
        print("ec-nixl bench: --no-save with --json, --plot or --out", file=sys.stderr)
        return 2
    if args.out and (args.json or args.plot):
        print("ec-nixl bench: --out names the folder of the default files; with --json/--plot give full paths",
              file=sys.stderr)
        return 2
    args.out_default = not args.out
    args.out = out_folder(args)
    try:
        if args.producer:
            from ec_nixl.bench.remote import DEFAULT_PORT, split_hostport

            split_hostport(args.producer, DEFAULT_PORT)
        cfg = plan(args)
    except ValueError as e:
        print(f"ec-nixl bench: {e}", file=sys.stderr)
        return 2
    load0 = proc.loadavg()
    print(f"ec-nixl bench: device={cfg['device']} paths={','.join(cfg['paths'])} "
          f"pool={human(cfg['pool_bytes'])}/endpoint repeats<= {cfg['repeats']} (>= {cfg['min_repeats']}, "
          f"~{cfg['budget_s']} s per case) warmup={cfg['warmup']} idle={cfg['idle_s']:g} s"
          + (f" producer={cfg['producer']} (another host)" if cfg["producer"] else ""), flush=True)
    for n in cfg["notes"]:
        print(f"  note: {n}", flush=True)
    ok, state = orchestrator.run(cfg, args.timeout)
    state["load"] = (load0, proc.loadavg())
    if state["rows"]:
        report.report(state, cfg, args)
    return 0 if ok else 1
