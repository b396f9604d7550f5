"""The bench across hosts: ``ec-nixl bench producer`` on host A, ``ec-nixl bench --producer A:PORT`` on B.

On one host the orchestrator spawns both peers and hands them a pipe. Across hosts the producer is
started by hand and listens; the consumer (spawned by the orchestrator on B as usual) connects to
it over TCP (``wire.Channel``) and everything the pipe carried goes over that connection
unchanged: first ``("open", hello)`` with the run's plan, then the producer's commands (``info``
with the endpoints' addresses, ``items``, ``raw_open`` with both raw agents' NIXL metadata,
``raw_prep`` / ``raw_serve`` / ``raw_write``, ``stats``, ``drain``, ``cpu_seconds``) until
``close``. So ours and the raw-NIXL floor are timed between the same two processes over the same
link in one run. Only commands in ``COMMANDS`` are served: the listener is reachable from the
network.

What cannot run across hosts is skipped with its reason (``LOCAL_ONLY``): the paths that read the
producer's memory directly or share a file system with it, and those timed on the clock both
processes share. The producer's CPU is read by the producer itself (``cpu_seconds``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import threading
import time
import traceback
from typing import Optional

from ec_nixl.bench import proc
from ec_nixl.bench.wire import Channel

WIRE_VERSION = 1
DEFAULT_PORT = 15700
CONNECT_WAIT_S = 60.0  # how long the consumer retries a producer that is not listening yet

LOCAL_ONLY = {
    "reference-copy": "needs the producer's memory mapped in this process (one host only)",
    "file": "needs a file system both processes see (one host only)",
    "publish-landed": "timed on a clock both processes share (one host only)",
    "expect-landed": "timed on a clock both processes share (one host only)",
    "expect-write": "timed on a clock both processes share (one host only)",
    "ucx": "checks its bytes against the producer's memory mapped here (one host only)",
}

COMMANDS = frozenset({"info", "items", "stage_unpublished", "publish_staged", "publish_when_parked", "stats",
                      "drain", "ucx_start", "raw_open", "raw_prep", "raw_serve", "raw_write", "raw_stop",
                      "cpu_seconds"})


def split_hostport(addr: str, default_port: Optional[int] = None) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep:
        host, port = addr, ""
    host = host.strip("[]")
    if not port and default_port is not None:
        return host, default_port
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"bad address {addr!r}: expected HOST:PORT")
    return host, int(port)


def reachable(address: str, producer_host: str) -> str:
    """An endpoint address as the consumer must dial it: a wildcard host becomes the host the
    consumer reached the producer at (the producer cannot know which of its addresses that is)."""
    host, port = split_hostport(address)
    if host in ("0.0.0.0", "::", ""):
        host = producer_host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- the consumer's side ----------------------------------------------------------------------


def connect(cfg: dict) -> Channel:
    """Reach the producer at ``cfg['producer']`` (retrying while it is not listening yet), send the
    plan, and wait until it has made its endpoints."""
    host, port = split_hostport(cfg["producer"], DEFAULT_PORT)
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            break
        except OSError as e:  # refused or unreachable: it may be starting; a name that does not resolve is not
            if isinstance(e, socket.gaierror) or time.monotonic() > deadline:
                raise proc.BenchError(f"cannot reach the bench producer at {host}:{port}: {e} "
                                      f"(is `ec-nixl bench producer --listen 0.0.0.0:{port}` running there?)") from None
            time.sleep(0.5)
    chan = Channel(sock)
    plan = {k: v for k, v in cfg.items() if k not in ("tmpdir", "parent_pid")}  # 'producer': across hosts
    from ec_nixl import __version__

    chan.send(("open", ({"wire": WIRE_VERSION, "ec_nixl": __version__, "plan": plan},)))
    try:
        proc.reply(chan, "open", timeout=180)
    except BaseException:
        chan.close()
        raise
    return chan


# --- the producer's side ----------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ec-nixl bench producer",
        description="The Encode side of `ec-nixl bench`, for a consumer on another host "
                    "(`ec-nixl bench --producer THIS_HOST:PORT` there). Serves one run (or --runs) and exits.")
    p.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help=f"control address (default 0.0.0.0:{DEFAULT_PORT}); the producer's ec-nixl endpoints "
                        "listen on PORT+1 and PORT+2 of the same host (any free ports when PORT is 0)")
    p.add_argument("--advertise", default=None, metavar="HOST",
                   help="host the consumer dials for the endpoints (default: the host it reached --listen at)")
    p.add_argument("--runs", type=int, default=1, help="consumer runs to serve before exiting (0: until stopped)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="exit (status 1) after this many seconds, whatever is in progress")
    return p


def producer_main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    try:
        host, port = split_hostport(args.listen, DEFAULT_PORT)
    except ValueError as e:
        print(f"ec-nixl bench producer: {e}", file=sys.stderr)
        return 2
    try:
        lsock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                     reuse_port=False)
    except OSError as e:
        print(f"ec-nixl bench producer: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 2
    port = lsock.getsockname()[1]
    state = {"tmpdir": None}
    _deadline(args.timeout, state)
    proc.quiet_logs()
    print(f"ec-nixl bench producer: listening on {host}:{port} (pid {os.getpid()}); "
          f"run `ec-nixl bench --producer {args.advertise or socket.gethostname()}:{port}` on the consumer's host",
          flush=True)
    ok, n = True, 0
    try:
        while args.runs <= 0 or n < args.runs:
            conn, peer = lsock.accept()
            n += 1
            print(f"run {n}: consumer {peer[0]}:{peer[1]}", flush=True)
            good = serve_run(Channel(conn), host, port, args.advertise, state)
            print(f"run {n}: {'done' if good else 'FAILED'}", flush=True)
            ok = ok and good
    except KeyboardInterrupt:
        print("ec-nixl bench producer: interrupted", file=sys.stderr)
        ok = False
    finally:
        lsock.close()
    return 0 if ok else 1


def serve_run(chan: Channel, host: str, port: int, advertise: Optional[str], state: dict) -> bool:
    """One consumer's run: its plan, a ``Producer`` for it, its commands until ``close``. True when
    the consumer closed the run (its own failures are its to report), False when it vanished or
    the plan was refused."""
    from ec_nixl.bench.producer import Producer

    prod, tmpdir = None, proc.shm_tmpdir()
    state["tmpdir"] = tmpdir
    try:
        try:
            if not chan.poll(60):
                raise TimeoutError("the consumer sent no plan within 60 s")
            cmd, args = chan.recv()
            hello = args[0] if cmd == "open" and args and isinstance(args[0], dict) else {}
            if hello.get("wire") != WIRE_VERSION:
                raise ValueError(f"not a bench consumer of this version (wire {hello.get('wire')!r}, "
                                 f"want {WIRE_VERSION}; ec-nixl {hello.get('ec_nixl', '?')})")
            plan = hello["plan"]
            ports = (port + 1, port + 2) if port else (0, 0)
            cfg = {**plan, "tmpdir": tmpdir, "ep_host": host, "ep_ports": ports, "advertise": advertise}
            prod = Producer(cfg, chan)
        except EOFError as e:
            print(f"  consumer went away: {e}", flush=True)
            return False
        except Exception as e:
            text = str(e) if isinstance(e, proc.BenchError) else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            print(f"  refused: {text}", file=sys.stderr, flush=True)
            try:
                chan.send(("error", f"remote producer: {text}"))
            except OSError:
                pass
            return False
        chan.send(("ok", None))
        print(f"  device={cfg['device']} paths={','.join(cfg['paths'])} pool={cfg['pool_bytes']} B; "
              f"endpoint {prod.ep.address}", flush=True)
        closed = proc.serve(_Commands(prod), chan, cfg["idle_timeout_s"])
        if not closed:
            print("  the consumer closed the connection without ending the run", flush=True)
        return bool(closed)
    except TimeoutError as e:
        print(f"  {e}", flush=True)
        return False
    finally:
        if prod is not None:
            try:
                prod.close()
            except Exception:
                pass
        chan.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
        state["tmpdir"] = None


class _Commands:
    """The producer as the network sees it: its commands and nothing else."""

    def __init__(self, prod):
        self._prod = prod

    def __getattr__(self, name: str):
        if name not in COMMANDS:
            raise AttributeError(f"{name!r} is not a bench producer command")
        return getattr(self._prod, name)


def _deadline(timeout_s: float, state: dict) -> None:
    """``--timeout``: whatever is in progress (a consumer that never comes, a run that hangs in
    NIXL), the process ends then, leaving no source file behind."""

    def wait():
        time.sleep(timeout_s)
        print(f"ec-nixl bench producer: --timeout {timeout_s:g} s reached, exiting", file=sys.stderr, flush=True)
        if state.get("tmpdir"):
            shutil.rmtree(state["tmpdir"], ignore_errors=True)
        os._exit(1)

    threading.Thread(target=wait, name="ec-nixl-bench-deadline", daemon=True).start()
