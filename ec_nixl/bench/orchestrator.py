"""Runs one bench: spawns the producer and the consumer, follows the consumer's messages, cleans up.

The orchestrator never touches NIXL or the device: it only starts the two peers (``spawn``, so
each has a fresh CUDA context and its own NIXL agent), shows progress, and collects what the
consumer streams on its control pipe into one ``state`` dict for the report:

    ("env", {...})        versions and device (merged)     ("case", label)   progress
    ("row", {...})        one timed case                   ("skip", path, why)
    ("cpu", {...})        idle / under-load CPU (merged)   ("copybw", {...})  copy bandwidth
    ("prodstats", {...})  the producer's counters           ("done", None)    finished
    ("error", text)       from either peer: the run failed

A timeout, a dead peer or Ctrl-C stops both processes; whatever was measured is still reported.
With ``cfg['producer']`` (``--producer HOST:PORT``) the producer runs on another host
(``ec-nixl bench producer``, see ``remote``): only the consumer is spawned, and it reaches the
producer over TCP instead of a pipe; its failures come back as the consumer's.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import sys
import time

from ec_nixl.bench import proc
from ec_nixl.bench.consumer import consumer_main
from ec_nixl.bench.producer import producer_main
from ec_nixl.bench.progress import Progress


def run(cfg: dict, timeout_s: float) -> tuple[bool, dict]:
    """(finished, state): ``finished`` is False after a failure, a timeout or an interrupt."""
    tmpdir = proc.shm_tmpdir()
    cfg = {**cfg, "tmpdir": tmpdir, "parent_pid": os.getpid()}
    ctx = mp.get_context("spawn")
    remote = bool(cfg.get("producer"))
    cons_ctl_r, cons_ctl_w = ctx.Pipe(duplex=False)
    ends, readers, procs = [cons_ctl_w], [cons_ctl_r], []
    p_cons = None
    if not remote:
        c_prod, p_cons = ctx.Pipe()
        prod_ctl_r, prod_ctl_w = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=producer_main, args=(cfg, c_prod, prod_ctl_w),
                                 name="ec-nixl-bench-producer", daemon=True))
        ends += [c_prod, p_cons, prod_ctl_w]
        readers.append(prod_ctl_r)
    cons = ctx.Process(target=consumer_main, args=(cfg, p_cons, cons_ctl_w), name="ec-nixl-bench-consumer",
                       daemon=True)
    procs.insert(0, cons)
    total = len(cfg["cases"]) * len(cfg["paths"]) + (1 if cfg["barrier"] else 0) + 1 + (cfg["idle_s"] > 0)
    state: dict = {"rows": [], "skipped": {}, "env": {}, "cpu": {}, "copybw": None, "prodstats": None}
    bar, ok = None, False
    old_term = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread
        pass
    try:
        for p in reversed(procs):  # the producer first
            p.start()
        for end in ends:
            end.close()
        bar = Progress(total)
        _follow(cfg, state, bar, cons, readers, time.monotonic() + timeout_s, timeout_s)
        ok = True
    except KeyboardInterrupt:
        print("\nec-nixl bench: interrupted", file=sys.stderr)
    except Exception as e:
        print(f"\nec-nixl bench: FAILED: {e}", file=sys.stderr)
    finally:
        if bar is not None:
            bar.close()
        _stop(procs, graceful=ok)
        shutil.rmtree(tmpdir, ignore_errors=True)
        try:
            signal.signal(signal.SIGTERM, old_term)
        except (ValueError, TypeError):
            pass
    return ok, state


def _follow(cfg: dict, state: dict, bar: Progress, cons, readers: list, deadline: float, timeout_s: float) -> None:
    """Collect the consumer's messages until ``done``; raise on an error, a dead peer or a timeout."""
    cons_ctl = readers[0]
    last = time.monotonic()
    while True:
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"benchmark did not finish within --timeout {timeout_s} s")
        if now - last > cfg["idle_timeout_s"]:
            raise TimeoutError(f"no progress for {cfg['idle_timeout_s']} s")
        for r in mpc.wait(readers + [cons.sentinel], timeout=1.0):
            if r is cons.sentinel:
                if not cons_ctl.poll():
                    cons.join(1.0)
                    raise RuntimeError(f"consumer process exited (code {cons.exitcode}) before finishing")
                continue
            try:
                kind, *msg = r.recv()
            except EOFError:
                if r is cons_ctl:
                    raise RuntimeError("consumer closed its control pipe before finishing") from None
                readers.remove(r)  # the producer finished (or died: the consumer will say so)
                continue
            last = time.monotonic()
            if kind == "error":
                raise RuntimeError(msg[0])
            if kind == "done":
                return
            if kind in ("env", "cpu"):
                state[kind].update(msg[0])
            elif kind == "case":
                bar.step(msg[0])
            elif kind == "row":
                state["rows"].append(msg[0])
            elif kind == "skip":
                state["skipped"][msg[0]] = msg[1]
                bar.write(f"{msg[0]}: skipped: {msg[1]}")
            elif kind in ("copybw", "prodstats"):
                state[kind] = msg[0]


def _stop(procs: list, graceful: bool) -> None:
    for p in procs:
        if p.pid is not None:
            p.join(20 if graceful else 0.5)
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
            p.join(5)
        if p.pid is not None and p.is_alive():
            p.kill()
            p.join(5)


def _interrupt(signum, frame):
    raise KeyboardInterrupt
